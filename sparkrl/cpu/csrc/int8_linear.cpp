// y = x W^T + b with 8-bit weights and activations (sparkrl/cpu/native.py `int8_linear`): W quantized once per
// output row (symmetric, one float32 scale per row, values in [-127, 127]), x quantized per row as it comes in
// (the same quantizer, `quantize_rows`), the dot products summed exactly in int32, then y = acc * (sx * sw) + b in
// float32, rounded to x's dtype. Integer sums have no order, so a row's output never depends on its batch.
//
// On AVX2 without VNNI the products use the sign trick: |x| (u8) times w with x's sign (s8), `vpmaddubsw` adding
// pairs into int16 (at most 2 * 127 * 127 = 32258: never saturates, as values are kept in [-127, 127]) and
// `vpmaddwd` widening them into int32 sums. Tiles of MR = 3 rows x NR = 4 outputs keep 12 sums in registers as in
// small_linear.cpp, and the first tile prefetches the next block of weight rows. Rows are padded with zeros to a
// multiple of 32 values.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int MR = 3;
constexpr int NR = 4;
constexpr int64_t ALIGN = 32;  // values per step of k: a row is padded to a multiple of it

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float value(float v) { return v; }
inline float value(c10::BFloat16 v) { return static_cast<float>(v); }

// One row: scale = max |x| / 127 (1 for a row of zeros), q = x / scale rounded to nearest even, in [-127, 127].
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, int8_t* q, float* scale) {
  float top = 0.0f;
  for (int64_t k = 0; k < K; ++k) top = std::max(top, std::fabs(value(x[k])));
  const float s = top > 0.0f ? top / 127.0f : 1.0f;
  for (int64_t k = 0; k < K; ++k)
    q[k] = static_cast<int8_t>(std::clamp(std::nearbyint(value(x[k]) / s), -127.0f, 127.0f));
  std::fill(q + K, q + Kp, int8_t{0});
  *scale = s;
}

template <int R, int C, bool PF>
inline void tile(const int8_t* x, int64_t Kp, const int8_t* w, int32_t* acc_out, int64_t ld) {
  __m256i acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const char* next = reinterpret_cast<const char*>(w + C * Kp);
  for (int64_t k = 0; k < Kp; k += ALIGN) {
    if (PF)
      for (int line = 0; line < C * ALIGN; line += 64) _mm_prefetch(next + k * C + line, _MM_HINT_T0);
    __m256i xv[R], ax[R];
    for (int i = 0; i < R; ++i) {
      xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * Kp + k));
      ax[i] = _mm256_abs_epi8(xv[i]);
    }
    for (int j = 0; j < C; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * Kp + k));
      for (int i = 0; i < R; ++i) {
        const __m256i pairs = _mm256_maddubs_epi16(ax[i], _mm256_sign_epi8(wv, xv[i]));
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc_out[i * ld + j] = hsum(acc[i][j]);
}

template <int C>
void rows(const int8_t* x, int64_t M, int64_t Kp, const int8_t* w, int32_t* acc, int64_t ld) {
  int64_t m = 0;
  if (M >= MR) {
    tile<MR, C, true>(x, Kp, w, acc, ld);
    m = MR;
  }
  for (; m + MR <= M; m += MR) tile<MR, C, false>(x + m * Kp, Kp, w, acc + m * ld, ld);
  if (M - m == 2) tile<2, C, true>(x + m * Kp, Kp, w, acc + m * ld, ld);
  if (M - m == 1) tile<1, C, true>(x + m * Kp, Kp, w, acc + m * ld, ld);
}

// y[m][n] = acc[m][n] * (sx[m] * sw[n]) + b[n], rounded to T, for the rows [m0, m1)
template <typename T>
void epilogue(const int32_t* acc, const float* sx, const float* sw, const T* b, T* y, int64_t m0, int64_t m1,
              int64_t N) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float v = static_cast<float>(acc[m * N + n]) * (sx[m] * sw[n]);
      y[m * N + n] = static_cast<T>(b ? v + static_cast<float>(b[n]) : v);
    }
}

}  // namespace

namespace sparkrl_native {

// x (M, K) float32 or bfloat16 -> (int8 (M, Kp), float32 scales (M,)), Kp = K rounded up to a multiple of 32
std::vector<at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows: a contiguous float32 or bfloat16 CPU x (M, K)");
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + ALIGN - 1) / ALIGN * ALIGN;
  at::Tensor q = at::empty({M, Kp}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      if (x.scalar_type() == at::kFloat)
        quantize_row(x.data_ptr<float>() + m * K, K, Kp, qp + m * Kp, sp + m);
      else
        quantize_row(x.data_ptr<c10::BFloat16>() + m * K, K, Kp, qp + m * Kp, sp + m);
    }
  });
  return {q, s};
}

// x (M, K) float32 or bfloat16; wq (N, Kp) int8 and ws (N,) float32 from quantize_rows(W); bias (N,) in x's dtype
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& ws,
                       const c10::optional<at::Tensor>& bias) {
  auto qx = quantize_rows(x);
  const int64_t M = x.size(0), N = wq.size(0), Kp = wq.size(1);
  TORCH_CHECK(wq.scalar_type() == at::kChar && wq.is_contiguous() && qx[0].size(1) == Kp && ws.numel() == N &&
                  ws.scalar_type() == at::kFloat && ws.is_contiguous(),
              "int8_linear: wq (N, Kp) int8 and ws (N,) float32 from quantize_rows of the weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == N,
                "int8_linear: bias (N,) in x's dtype");
  at::Tensor acc = at::empty({M, N}, x.options().dtype(at::kInt));
  const int8_t* xp = qx[0].data_ptr<int8_t>();
  const int8_t* wp = wq.data_ptr<int8_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  at::parallel_for(0, (N + NR - 1) / NR, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += 48) {
      const int64_t mb = std::min<int64_t>(48, M - m0);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n = blk * NR;
        if (n + NR <= N)
          rows<NR>(xp + m0 * Kp, mb, Kp, wp + n * Kp, ap + m0 * N + n, N);
        else
          for (int64_t j = n; j < N; ++j) rows<1>(xp + m0 * Kp, mb, Kp, wp + j * Kp, ap + m0 * N + j, N);
      }
    }
  });
  at::Tensor y = at::empty({M, N}, x.options());
  const float* sx = qx[1].data_ptr<float>();
  const float* sw = ws.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(N, 1)), [&](int64_t b, int64_t e) {
    if (x.scalar_type() == at::kFloat)
      epilogue(ap, sx, sw, has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), b, e, N);
    else
      epilogue(ap, sx, sw, has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), b, e,
               N);
  });
  return y;
}

}  // namespace sparkrl_native

TORCH_LIBRARY_FRAGMENT(sparkrl_native, m) {
  m.def("quantize_rows(Tensor x) -> Tensor[]", &sparkrl_native::quantize_rows);
  m.def("int8_linear(Tensor x, Tensor wq, Tensor ws, Tensor? bias) -> Tensor", &sparkrl_native::int8_linear);
}
