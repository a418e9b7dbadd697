// y = x W^T + b in bfloat16 on a CPU with AVX512-BF16 (sparkrl/cpu/native.py): the hardware's bfloat16 dot
// products (vdpbf16ps: each of 16 float32 sums adds the two exact products of a pair of bfloat16 values)
// on W repacked once into pairs, so that one instruction yields 16 outputs.
//
// Layout of the packed W (`pack_pairs`): groups of G = 64 outputs; within a group, for every pair of
// inputs (2k, 2k + 1), 4 blocks of 16 outputs x 2 values: 256 contiguous bytes, the whole group's
// weights for that input pair. A tile of up to MR = 6 rows of x keeps 6 x 4 sums of 16 outputs in
// zmm registers (24 of 32) while it walks the input pairs: 4 weight loads and 6 broadcasts of an x pair
// feed 24 dot-product instructions. Each thread takes whole groups, so the weights stream from memory
// once per product; every output's sum runs in the same order whatever the number of rows. Outputs past
// N (the zero padding of the last group) are not written. y is rounded to bfloat16 to nearest even.
// Its rows do not depend on the batch (what `--cpu-kernels auto` needs); its speed per call beside torch's
// products is measured by bench/roofline.py (docs/experiments/bf16-products.md has the history).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int NB = 4;        // blocks of 16 outputs per group
constexpr int G = 16 * NB;   // outputs per group
constexpr int MR = 6;        // rows of x per tile
using bf16 = c10::BFloat16;

bool has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
}

// W (N, K), K even -> (ceil(N / G), K / 2, NB, 16, 2), zero-padded past N.
at::Tensor pack_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.device().is_cpu(),
              "pack_pairs: a contiguous bfloat16 CPU weight (N, K)");
  const int64_t N = w.size(0), K = w.size(1), P = K / 2;
  TORCH_CHECK(K % 2 == 0, "pack_pairs: K even");
  at::Tensor p = at::zeros({(N + G - 1) / G, P, NB, 16, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<bf16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(p.data_ptr<bf16>());
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t g = n / G, lane = n % G;  // lane = block * 16 + position in the block
      for (int64_t k = 0; k < P; ++k) {
        uint16_t* d = dst + ((g * P + k) * G + lane) * 2;
        d[0] = src[n * K + 2 * k];
        d[1] = src[n * K + 2 * k + 1];
      }
    }
  });
  return p;
}

// Rows [0, R) of x (R x K, bfloat16 pairs as 32-bit words) against one group of packed W; outputs n0.. of y.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void tile(
    const uint32_t* x, int64_t P, const __m512i* w, const bf16* b, bf16* y, int64_t ldy, int64_t n0, int64_t N) {
  __m512 acc[R][NB];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < P; ++k) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + k * NB + j);
    for (int i = 0; i < R; ++i) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[i * P + k])));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, reinterpret_cast<__m512bh>(wv[j]));
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + j * 16;
    if (n >= N) break;
    const int64_t valid = N - n < 16 ? N - n : 16;
    const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1);
    __m512 bias = _mm512_setzero_ps();
    if (b)  // 16 bfloat16 -> float32: zero-extend, shift into the high half
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + n)), 16));
    for (int i = 0; i < R; ++i) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], bias));
      _mm256_mask_storeu_epi16(y + i * ldy + n, m, reinterpret_cast<__m256i>(h));
    }
  }
}

}  // namespace

namespace sparkrl_native {

at::Tensor pairs_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_bf16_dot(), "pairs_linear: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && wp.dim() == 5 &&
                  wp.scalar_type() == at::kBFloat16 && wp.size(1) * 2 == x.size(1) && wp.size(0) * G >= N &&
                  wp.size(0) * G < N + G,
              "pairs_linear: contiguous bfloat16 x (M, K) and W packed by pack_pairs");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "pairs_linear: bias (N,) in bfloat16");
  const int64_t M = x.size(0), P = wp.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<bf16>());
  const __m512i* w = reinterpret_cast<const __m512i*>(wp.data_ptr<bf16>());
  const bf16* b = has_bias ? bias->data_ptr<bf16>() : nullptr;
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, wp.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const __m512i* wg = w + g * P * NB;  // a group: P pairs x NB blocks of 64 bytes
      int64_t m = 0;
      for (; m + MR <= M; m += MR) tile<MR>(xp + m * P, P, wg, b, yp + m * N, N, g * G, N);
      switch (M - m) {
        case 5: tile<5>(xp + m * P, P, wg, b, yp + m * N, N, g * G, N); break;
        case 4: tile<4>(xp + m * P, P, wg, b, yp + m * N, N, g * G, N); break;
        case 3: tile<3>(xp + m * P, P, wg, b, yp + m * N, N, g * G, N); break;
        case 2: tile<2>(xp + m * P, P, wg, b, yp + m * N, N, g * G, N); break;
        case 1: tile<1>(xp + m * P, P, wg, b, yp + m * N, N, g * G, N); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace sparkrl_native


TORCH_LIBRARY_FRAGMENT(sparkrl_native, m) {
  m.def("has_bf16_dot() -> bool", [] { return has_bf16_dot(); });
  m.def("pack_pairs(Tensor w) -> Tensor", &pack_pairs);
  m.def("pairs_linear(Tensor x, Tensor wp, int N, Tensor? bias) -> Tensor", &sparkrl_native::pairs_linear);
}
