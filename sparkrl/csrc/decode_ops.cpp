// The small per-layer ops of a decode step (sparkrl/native.py), each one call instead of several tensor
// ops: at one row a decode step's time goes as much to dispatching some 1,300 small ops as to the
// weights, and in bfloat16 these two make up some 30 of every layer's 60 ops. float32 or bfloat16; in bfloat16 every
// intermediate is rounded to bfloat16 where the tensor ops of sparkrl/model.py round it.
//
// rms_norm: y = w * (x / sqrt(mean(x^2) + eps)) over the last dimension, the sums in float32 (`RMSNorm`).
// rope: x * cos + rotate_half(x) * sin (`apply_rope`, Hugging Face's rotate-half convention).
// silu_mul: silu(gate) * up, SwiGLU's elementwise step (`MLP`), reading gate and up where the fused gate/up
// product left them (strided rows) instead of two strided tensor ops and a temporary.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
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

// exp(x) for x in [-87, 89] (callers clamp), branch-free so the loop around it vectorises (std::exp kept it
// scalar): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), e^r by Cephes' degree-7
// polynomial, 2^n written into the exponent bits. About 1 ulp in float32 (tested against float64); from
// x = 88.03 up (n = 128) it is inf, as float32's exp is from 88.72.
inline float exp_reduced(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
void silu_mul_rows(const T* g, const T* u, T* y, int64_t rows, int64_t F, int64_t sg, int64_t su) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gr = g + r * sg;
    const T* ur = u + r * su;
    T* yr = y + r * F;
    for (int64_t d = 0; d < F; ++d) {
      const float v = widen(gr[d]);
      // silu(v) = v / (1 + e^-v); e^-v clamped into exp_reduced's range (past it the quotient is v, or -0 as
      // e^-v is inf), a NaN kept by the comparisons' order; silu rounded to T as F.silu rounds it
      const float e = exp_reduced(std::min(std::max(-v, -87.0f), 89.0f));
      yr[d] = narrow<T>(round_as<T>(v / (1.0f + e)) * widen(ur[d]));
    }
  }
}

// rows x F views with unit stride along F and one stride between rows (a (..., F) slice of the fused output)
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const auto dtype = gate.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && up.scalar_type() == dtype,
              "silu_mul: gate and up both float32 or both bfloat16");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 && up.stride(1) == 1 &&
                  gate.device().is_cpu() && up.device().is_cpu(),
              "silu_mul: CPU gate and up (rows, F) of one shape, unit stride along F");
  const int64_t rows = gate.size(0), F = gate.size(1);
  at::Tensor y = at::empty({rows, F}, gate.options());
  if (dtype == at::kFloat)
    silu_mul_rows(gate.data_ptr<float>(), up.data_ptr<float>(), y.data_ptr<float>(), rows, F, gate.stride(0),
                  up.stride(0));
  else
    silu_mul_rows(gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows,
                  F, gate.stride(0), up.stride(0));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparkrl_native, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor", &silu_mul);
}
