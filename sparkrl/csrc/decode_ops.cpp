// The small per-layer ops of a decode step (sparkrl/native.py), each one call instead of several tensor
// ops: at one row a decode step's time goes as much to dispatching some 1,300 small ops as to the
// weights, and in bfloat16 these two make up some 30 of every layer's 60 ops. float32 or bfloat16; in bfloat16 every
// intermediate is rounded to bfloat16 where the tensor ops of sparkrl/model.py round it.
//
// rms_norm: y = w * (x / sqrt(mean(x^2) + eps)) over the last dimension, the sums in float32 (`RMSNorm`).
// rope: x * cos + rotate_half(x) * sin (`apply_rope`, Hugging Face's rotate-half convention).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// bfloat16 <-> float32 as bit operations the compiler vectorises (c10::BFloat16's conversions branch on NaN
// and kept these loops scalar: a bfloat16 RoPE of 17 positions ran 0.5x of torch's ops): widening is a shift,
// narrowing rounds to nearest even, as torch does, and keeps a NaN a NaN.
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

template <typename T>
inline float round_as(float v) { return widen(narrow<T>(v)); }  // v rounded to T, back in float32

template <typename T>
void norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    T* yr = y + r * D;
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight running sums: a reduction the compiler vectorises
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
      for (int j = 0; j < 8; ++j) {
        const float v = widen(xr[d + j]);
        part[j] += v * v;
      }
    float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; d < D; ++d) {
      const float v = widen(xr[d]);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
    for (d = 0; d < D; ++d)  // the normalised value rounded to T (a no-op in float32), then the weight
      yr[d] = narrow<T>(widen(w[d]) * round_as<T>(widen(xr[d]) * inv));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && w.scalar_type() == dtype,
              "rms_norm: x and w both float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu() && x.dim() >= 1 &&
                  w.dim() == 1 && w.size(0) == x.size(-1),
              "rms_norm: contiguous CPU x (..., D) and w (D,)");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  if (dtype == at::kFloat)
    norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, D, eps);
  else
    norm_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, D, eps);
  return y;
}

template <typename T>
void rope_rows(const at::Tensor& x, const T* c, const T* s, T* y) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const T* xp = x.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < L; ++t) {
        const T* xr = xp + b * sb + h * sh + t * st;
        const T* cr = c + (b * L + t) * D;
        const T* sr = s + (b * L + t) * D;
        T* yr = y + ((b * H + h) * L + t) * D;
        // x * cos + rotate_half(x) * sin, each product and the sum rounded to T as torch's ops round them;
        // rotate_half(x) = (-x[half:], x[:half]): the two halves as two branch-free loops
        for (int64_t d = 0; d < half; ++d)
          yr[d] = narrow<T>(round_as<T>(widen(xr[d]) * widen(cr[d])) +
                            round_as<T>(-widen(xr[d + half]) * widen(sr[d])));
        for (int64_t d = half; d < D; ++d)
          yr[d] = narrow<T>(round_as<T>(widen(xr[d]) * widen(cr[d])) + round_as<T>(widen(xr[d - half]) * widen(sr[d])));
      }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype, "rope: x, cos and sin all float32 or all bfloat16");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0 && x.device().is_cpu(),
              "rope: CPU x (B, H, T, D), D even, unit stride along D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 4 &&
                  cos.size(0) == x.size(0) && cos.size(1) == 1 && cos.size(2) == x.size(2) && cos.size(3) == x.size(3),
              "rope: contiguous cos, sin (B, 1, T, D)");
  at::Tensor y = at::empty(x.sizes(), x.options());  // contiguous
  if (dtype == at::kFloat)
    rope_rows(x, cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>());
  else
    rope_rows(x, cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparkrl_native, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
}
