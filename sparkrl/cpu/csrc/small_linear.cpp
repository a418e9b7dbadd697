// y = x W^T + b for products of a few rows (sparkrl/cpu/native.py): x (M, K) and W (N, K) row-major, both
// float32 or both bfloat16; the sums in float32, y in x's dtype (bfloat16 rounded to nearest even).
//
// The weight is streamed from memory once: each thread takes blocks of NR = 4 output rows of W, and
// for every tile of MR = 3 input rows keeps the 12 partial dot products in AVX registers (3 x rows +
// 1 W row + 12 sums = 16 of the 16 ymm registers) while it walks K eight values at a time; the 4 W
// rows (at most 24 KB at K = 1536) stay in L1 across the tiles, x in L2. A bfloat16 weight is widened
// to float32 as it is loaded (a shift of its 16 bits), so it costs half the memory traffic of a
// float32 one: what a CPU without bfloat16 dot products gains from bfloat16 weights. A bfloat16 x is
// widened once, before the tiles. Tails of M, N and K run the same code with smaller tiles and a scalar
// remainder. Threads come from torch's own pool (at::parallel_for), so torch.set_num_threads applies.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <vector>

namespace {

constexpr int MR = 3;
constexpr int NR = 4;
using bf16 = c10::BFloat16;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {  // 8 bfloat16 -> 8 float32: zero-extend to 32 bits, shift into the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// y[i][j] = b[j] + sum_k x[i][k] w[j][k] for i < R, j < C. PF: w is read from memory, and the C rows after it
// (the next block of outputs) are prefetched as it goes, one 64-byte line per 64 bytes read: a block's rows are
// ~1 KB streams too short for the hardware's prefetcher, and a one-row product read its weights at 14-19 GB/s
// of the ~31 GB/s this 2-core machine reads at (24-27 GB/s with the prefetch; the sums are the same).
template <int R, int C, bool PF = false, typename W, typename Y>
inline void tile(const float* x, const W* w, int64_t K, const W* b, Y* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  constexpr int64_t step = C * 8 * sizeof(W);  // bytes of w read per step of k
  const char* next = reinterpret_cast<const char*>(w + C * K);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (PF)
      for (int64_t line = 0; line < step; line += 64) _mm_prefetch(next + k / 8 * step + line, _MM_HINT_T0);
    __m256 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
    for (int j = 0; j < C; ++j) {
      const __m256 wv = load8(w + j * K + k);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t r = k; r < K; ++r) s += x[i * K + r] * static_cast<float>(w[j * K + r]);
      y[i * ldy + j] = static_cast<Y>(b ? s + static_cast<float>(b[j]) : s);
    }
}

// All M rows of x against C rows of w (the first tile prefetches the next block where w comes from memory).
template <int C, bool PF = true, typename W, typename Y>
void rows(const float* x, int64_t M, int64_t K, const W* w, const W* b, Y* y, int64_t N) {
  int64_t m = 0;
  if (M >= MR) {
    tile<MR, C, PF>(x, w, K, b, y, N);
    m = MR;
  }
  for (; m + MR <= M; m += MR) tile<MR, C>(x + m * K, w, K, b, y + m * N, N);
  if (M - m == 2) tile<2, C, PF>(x + m * K, w, K, b, y + m * N, N);
  if (M - m == 1) tile<1, C, PF>(x + m * K, w, K, b, y + m * N, N);
}

// The same for bfloat16 W: with more than one tile of x rows, the C rows of W are widened once into an
// L1-resident float32 block that every tile then reads (the widening costs a shift per 8 values, which
// compute-bound tiles would otherwise repeat for every tile).
template <int C, typename Y>
void rows(const float* x, int64_t M, int64_t K, const bf16* w, const bf16* b, Y* y, int64_t N) {
  if (M <= MR) {
    if (M == MR) tile<MR, C, true>(x, w, K, b, y, N);
    if (M == 2) tile<2, C, true>(x, w, K, b, y, N);
    if (M == 1) tile<1, C, true>(x, w, K, b, y, N);
    return;
  }
  thread_local std::vector<float> block;
  block.resize(C * K);
  for (int64_t i = 0; i < C * K; ++i) block[i] = static_cast<float>(w[i]);
  float bias[C];
  for (int j = 0; j < C; ++j) bias[j] = b ? static_cast<float>(b[j]) : 0.0f;
  rows<C, false>(x, M, K, block.data(), b ? bias : nullptr, y, N);
}

constexpr int64_t MB = 48;  // rows of x per pass over a thread's outputs: 48 x K floats stay in L2 (110 KB at K = 576)

// Each thread takes blocks of NR outputs and, for every MB rows of x, walks them; a row's outputs are the same
// sums in the same order whatever the number of rows (tiles and blocks only decide what is computed together).
template <typename W, typename Y>
void product(const float* x, int64_t M, int64_t K, const W* w, const W* b, Y* y, int64_t N) {
  at::parallel_for(0, (N + NR - 1) / NR, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
      const float* xm = x + m0 * K;
      Y* ym = y + m0 * N;
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n = blk * NR;
        if (n + NR <= N) {
          rows<NR>(xm, mb, K, w + n * K, b ? b + n : nullptr, ym + n, N);
        } else {
          for (int64_t j = n; j < N; ++j) rows<1>(xm, mb, K, w + j * K, b ? b + j : nullptr, ym + j, N);
        }
      }
    }
  });
}

}  // namespace

namespace sparkrl_native {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x (M, K), w (N, K)");
  const auto dtype = w.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "small_linear: x and w both float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "small_linear: contiguous CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == N,
                "small_linear: bias (N,) in w's dtype");
  at::Tensor y = at::empty({M, N}, x.options());
  if (dtype == at::kFloat) {
    product(x.data_ptr<float>(), M, K, w.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr,
            y.data_ptr<float>(), N);
    return y;
  }
  at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));  // x widened once (a few KB)
  const bf16* xp = x.data_ptr<bf16>();
  float* xfp = xf.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i) xfp[i] = static_cast<float>(xp[i]);
  product(xfp, M, K, w.data_ptr<bf16>(), has_bias ? bias->data_ptr<bf16>() : nullptr, y.data_ptr<bf16>(), N);
  return y;
}

}  // namespace sparkrl_native


TORCH_LIBRARY(sparkrl_native, m) { m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &sparkrl_native::small_linear); }
