// y = x W^T + b for float32 products of a few rows (sparkrl/native.py): x (M, K) and W (N, K) row-major.
//
// The weight is streamed from memory once: each thread takes blocks of NR = 4 output rows of W, and
// for every tile of MR = 3 input rows keeps the 12 partial dot products in AVX registers (3 x rows +
// 1 W row + 12 sums = 16 of the 16 ymm registers) while it walks K eight floats at a time; the 4 W
// rows (at most 24 KB at K = 1536) stay in L1 across the tiles, x in L2. Tails of M, N and K run the
// same code with smaller tiles and a scalar remainder. Threads come from torch's own pool
// (at::parallel_for), so torch.set_num_threads applies.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

namespace {

constexpr int MR = 3;
constexpr int NR = 4;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// y[i][j] = b[j] + sum_k x[i][k] w[j][k] for i < R, j < C.
template <int R, int C>
inline void tile(const float* x, const float* w, int64_t K, const float* b, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
    for (int j = 0; j < C; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * K + k);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t r = k; r < K; ++r) s += x[i * K + r] * w[j * K + r];
      y[i * ldy + j] = b ? s + b[j] : s;
    }
}

// All M rows of x against C rows of w.
template <int C>
void rows(const float* x, int64_t M, int64_t K, const float* w, const float* b, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, C>(x + m * K, w, K, b, y + m * N, N);
  if (M - m == 2) tile<2, C>(x + m * K, w, K, b, y + m * N, N);
  if (M - m == 1) tile<1, C>(x + m * K, w, K, b, y + m * N, N);
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "small_linear: contiguous CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "small_linear: bias (N,) float32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + NR - 1) / NR, 16, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n = blk * NR;
      if (n + NR <= N) {
        rows<NR>(xp, M, K, wp + n * K, b ? b + n : nullptr, yp + n, N);
      } else {
        for (int64_t j = n; j < N; ++j) rows<1>(xp, M, K, wp + j * K, b ? b + j : nullptr, yp + j, N);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(sparkrl_native, m) { m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &small_linear); }
