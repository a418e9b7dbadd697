// The small per-layer ops of a decode step (sparkrl/cpu/native.py), each one call instead of several tensor
// ops: at one row a decode step's time goes as much to dispatching some 1,300 small ops as to the
// weights, and in bfloat16 these two make up some 30 of every layer's 60 ops. float32 or bfloat16; in bfloat16 every
// intermediate is rounded to bfloat16 where the tensor ops of sparkrl/model/transformer.py round it.
//
// rms_norm: y = w * (x / sqrt(mean(x^2) + eps)) over the last dimension, the sums in float32 (`RMSNorm`).
// rope: x * cos + rotate_half(x) * sin (`apply_rope`, Hugging Face's rotate-half convention).
// attention: softmax(q k^T / sqrt(D), masked) v over a KV cache for a few new tokens per sequence (a decode
// step, a verify forward), grouped-query heads, written as (B, T, H, D) for the output projection.
// nucleus: top-p sampling of a row of logits and the sampled token's log-probability (below).
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
#include <cstring>
#include <limits>
#include <vector>

namespace {

// bfloat16 <-> float32 as bit operations the compiler vectorises (c10::BFloat16's conversions branch on NaN,
// which keeps such loops scalar: a bfloat16 RoPE of 17 positions then runs at 0.5x of torch's ops): widening
// is a shift, narrowing rounds to nearest even, as torch does, and keeps a NaN a NaN.
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

}  // namespace

namespace sparkrl_native {

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

}  // namespace sparkrl_native

namespace {

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

}  // namespace

namespace sparkrl_native {

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

}  // namespace sparkrl_native

namespace {

// 8 values from memory as float32 (a bfloat16 widened by a shift into the high half)
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// exp(x) of 8 values in [-87, 89] (callers clamp): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts,
// Cody-Waite), e^r by Cephes' degree-7 polynomial, 2^n written into the exponent bits. About 1 ulp in
// float32 (tested against float64); from x = 88.03 up (n = 128) it is inf, as float32's exp is from 88.72.
inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {  // (sum a, sum b, sum c, sum d)
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d), abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float hsum(__m256 v) {  // the 8 lanes' sum, added in `hsum4`'s order: a key's score is the same bits
  return _mm_cvtss_f32(hsum4(v, v, v, v));  // whether it falls in a block of four keys or in the tail
}

// mask bytes s .. s + 7 (bool: 0 or 1) as a lane mask, all ones where the position is visible
inline __m256 visible8(const bool* m) {
  const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(m8), _mm256_setzero_si256()));
}

inline bool all_visible8(const bool* m) {  // the eight bytes as one word: all of them 1
  uint64_t w;
  std::memcpy(&w, m, sizeof w);
  return w == 0x0101010101010101ULL;
}

constexpr int64_t PREFETCH = 16;  // positions ahead: a bfloat16 row of 64 is 2 cache lines, too short a stream
                                 // for the hardware prefetcher to run ahead of at a decode step's few rows

template <typename TI>
inline void prefetch_rows(const TI* x, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(x) + i, _MM_HINT_T0);
}

// The values weighted by the softmax's numerators for NR query rows at once: o[r * D + c0 + (0, 8 NC)] =
// sum_s p[r * S + s] v[s * D + c0 + (0, 8 NC)] (float32), NR x NC sums in registers (3 x 4 + 3 weights + 1 value:
// AVX2's 16), so each value row is read once for all NR rows (a decode step's G rows of a key/value head), not once
// per row; `ahead`: the bytes of value row s + PREFETCH to prefetch. A sum runs over s in cache order, whatever NR:
// a row's bits are those it gets alone.
template <int NR, int NC, typename TI>
void weighted_values_n(const float* p, int64_t S, const TI* v, int64_t D, float* o, int64_t ahead) {
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    prefetch_rows(v + (s + PREFETCH) * D, ahead);
    __m256 w[NR];
    for (int r = 0; r < NR; ++r) w[r] = _mm256_broadcast_ss(p + r * S + s);
    for (int c = 0; c < NC; ++c) {
      const __m256 x = load8f(v + s * D + 8 * c);
      for (int r = 0; r < NR; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], x, acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + r * D + 8 * c, acc[r][c]);
}

template <int NR, typename TI>
void weighted_values_rows(const float* p, int64_t S, const TI* v, int64_t D, float* o) {
  for (int64_t c0 = 0; c0 < D; c0 += 32) {  // 32 columns at a time; the first pass prefetches whole rows
    const int64_t ahead = c0 ? 0 : D * static_cast<int64_t>(sizeof(TI));
    switch (std::min<int64_t>(32, D - c0) / 8) {
      case 4: weighted_values_n<NR, 4>(p, S, v + c0, D, o + c0, ahead); break;
      case 3: weighted_values_n<NR, 3>(p, S, v + c0, D, o + c0, ahead); break;
      case 2: weighted_values_n<NR, 2>(p, S, v + c0, D, o + c0, ahead); break;
      default: weighted_values_n<NR, 1>(p, S, v + c0, D, o + c0, ahead);
    }
  }
}

// Rows [0, R) of scaled queries qs (R x D) against positions [0, S) of one key/value head (kh, vh, S x D; mask row
// of query row r: m0 + (r % T) * mt): four keys' dot products side by side (one 64-term dot product alone waits on
// its adds), the softmax's numerators (float32; a masked position weight 0, the row's visible maximum `top` taken
// out), their sum, and the values weighted by them, not yet divided by that sum: o (R x D), sum (R).
// A row that sees none of these positions gets zeros. p: scratch of R x S floats. The rows are rows
// r0.. of the head's G x T query rows (the mask row of row r is that of new token (r0 + r) % T).
template <typename TI>
inline __attribute__((always_inline)) void attend_span(const float* __restrict__ qs, int64_t R, int64_t r0, int64_t D,
                                                       int64_t T, const TI* kh, const TI* vh, const bool* m0, int64_t mt,
                                                       int64_t S, float* __restrict__ p, float* __restrict__ o,
                                                       float* sum_out) {
  const float neg = -std::numeric_limits<float>::infinity();
  int64_t s0 = 0;
  for (; s0 + 4 <= S; s0 += 4) {  // scores, four keys x three query rows at a time (12 sums in registers)
    const TI* k0 = kh + s0 * D;
    prefetch_rows(k0 + PREFETCH * D, 4 * D * static_cast<int64_t>(sizeof(TI)));
    int64_t r = 0;
    for (; r + 3 <= R; r += 3) {
      const float* q0 = qs + r * D;
      __m256 a[3][4];
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q0 + D + d), x2 = _mm256_loadu_ps(q0 + 2 * D + d);
        for (int j = 0; j < 4; ++j) {
          const __m256 kj = load8f(k0 + j * D + d);
          a[0][j] = _mm256_fmadd_ps(x0, kj, a[0][j]);
          a[1][j] = _mm256_fmadd_ps(x1, kj, a[1][j]);
          a[2][j] = _mm256_fmadd_ps(x2, kj, a[2][j]);
        }
      }
      for (int i = 0; i < 3; ++i) _mm_storeu_ps(p + (r + i) * S + s0, hsum4(a[i][0], a[i][1], a[i][2], a[i][3]));
    }
    for (; r < R; ++r) {
      const float* qr = qs + r * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(qr + d);
        a0 = _mm256_fmadd_ps(x, load8f(k0 + d), a0);
        a1 = _mm256_fmadd_ps(x, load8f(k0 + D + d), a1);
        a2 = _mm256_fmadd_ps(x, load8f(k0 + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(x, load8f(k0 + 3 * D + d), a3);
      }
      _mm_storeu_ps(p + r * S + s0, hsum4(a0, a1, a2, a3));
    }
  }
  for (; s0 < S; ++s0)
    for (int64_t r = 0; r < R; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs + r * D + d), load8f(kh + s0 * D + d), a);
      p[r * S + s0] = hsum(a);
    }
  for (int64_t r = 0; r < R; ++r) {  // the softmax's numerators of the visible scores
    float* pr = p + r * S;
    const bool* mr = m0 + ((r0 + r) % T) * mt;
    const __m256 neg8 = _mm256_set1_ps(neg);
    __m256 tops = neg8;  // the visible maximum, eight lanes at a time (a maximum is exact in any order)
    int64_t s8 = 0;
    for (; s8 + 8 <= S; s8 += 8)
      tops = _mm256_max_ps(tops, _mm256_blendv_ps(neg8, _mm256_loadu_ps(pr + s8), visible8(mr + s8)));
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    float top = *std::max_element(lanes, lanes + 8);
    for (; s8 < S; ++s8) top = std::max(top, mr[s8] ? pr[s8] : neg);
    if (top == neg) top = 0.0f;  // nothing to attend to here: zeros below, not NaN
    const __m256 top8 = _mm256_set1_ps(top), lo = _mm256_set1_ps(-87.0f);
    for (s8 = 0; s8 + 8 <= S; s8 += 8) {  // e^(score - top), 0 where masked
      const __m256 e = exp8(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(pr + s8), top8), lo));
      _mm256_storeu_ps(pr + s8, _mm256_and_ps(e, visible8(mr + s8)));
    }
    for (; s8 < S; ++s8)
      pr[s8] = mr[s8] ? _mm256_cvtss_f32(exp8(_mm256_set1_ps(std::max(pr[s8] - top, -87.0f)))) : 0.0f;
    // the sum in eight running parts, the j-th visible position into part j % 8, so the order of the adds
    // depends only on the positions the row sees, in cache order, not on the span or on where a tree put
    // them: blocks of eight visible positions (the committed prefix) as such, then one at a time
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t s = 0;
    for (; s + 8 <= S && all_visible8(mr + s); s += 8)
      for (int j = 0; j < 8; ++j) part[j] += pr[s + j];
    for (int64_t j = s; s < S; ++s)
      if (mr[s]) part[j++ & 7] += pr[s];
    const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    sum_out[r] = sum;
  }
  int64_t r = 0;  // the weighted values, three rows at a time
  for (; r + 3 <= R; r += 3) weighted_values_rows<3>(p + r * S, S, vh, D, o + r * D);
  if (R - r == 2) weighted_values_rows<2>(p + r * S, S, vh, D, o + r * D);
  if (R - r == 1) weighted_values_rows<1>(p + r * S, S, vh, D, o + r * D);
}

// softmax(q k^T / sqrt(D), masked) v for every query row of a key/value head (its grouped query heads x the new
// tokens), one (sequence, key/value head) at a time: each cached key and value row is read from memory once for
// all of them (at a decode step attention streams the cache: a float32 cache of 8 sequences x 300 positions is
// 3.7 MB a layer). A row's result depends only on its query and the positions it sees, in cache order: not on
// the span, the other rows, the number of new tokens or the thread count (a head is never split across threads),
// so a verify forward's row equals the decode step's at the same position bit for bit. q (B, H, T, D) any strides
// with unit stride along D, D a multiple of 8; k, v the cache buffers (B, Hk, capacity, D), positions [0, S) read;
// mask (B, 1, T, S) with unit stride along S.
constexpr int64_t ROW_BLOCK = 48;  // query rows per call of attend_span (a multiple of its 3-row tile)

template <typename TI, typename TO>
void attend_heads(const at::Tensor& q, const TI* kb, const TI* vb, const at::Tensor& mask, TO* out, int64_t Hk,
                  int64_t S, int64_t cap) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), G = H / Hk, R = G * T;
  const int64_t qb = q.stride(0), qh = q.stride(1), qt = q.stride(2), mb = mask.stride(0), mt = mask.stride(2);
  const TI* qp = q.data_ptr<TI>();
  const bool* mp = mask.data_ptr<bool>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    const int64_t RB = std::min<int64_t>(R, ROW_BLOCK);
    std::vector<float> qs(R * D), p(RB * S), o(RB * D), sum(RB);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hk, hk = task % Hk;
      for (int64_t r = 0; r < R; ++r) {  // row r: query head hk * G + r / T, new token r % T; scaled once
        const TI* qr = qp + b * qb + (hk * G + r / T) * qh + (r % T) * qt;
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = widen(qr[d]) * scale;
      }
      const int64_t at = (b * Hk + hk) * cap * D;
      for (int64_t r0 = 0; r0 < R; r0 += RB) {  // rows in blocks: the scratch stays small for a long prefill
        const int64_t n = std::min(RB, R - r0);
        attend_span(qs.data() + r0 * D, n, r0, D, T, kb + at, vb + at, mp + b * mb, mt, S, p.data(), o.data(),
                    sum.data());
        for (int64_t i = 0; i < n; ++i) {  // row r0 + i: o / sum, as TO
          const int64_t r = r0 + i;
          const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
          TO* y = out + ((b * T + r % T) * H + hk * G + r / T) * D;
          for (int64_t d = 0; d < D; ++d) y[d] = narrow<TO>(o[i * D + d] * inv);
        }
      }
    }
  });
}

}  // namespace

namespace sparkrl_native {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     int64_t span, c10::ScalarType out_dtype) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype && v.scalar_type() == dtype &&
                  (out_dtype == at::kFloat || out_dtype == at::kBFloat16) && (dtype == at::kFloat || out_dtype == dtype),
              "attention: q, k, v all float32 (out float32 or bfloat16) or all bfloat16 (out bfloat16)");
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1 && k.dim() == 4 && k.is_contiguous() && v.is_contiguous() &&
                  k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0 && span >= 0 && span <= k.size(2) && q.device().is_cpu() &&
                  k.device().is_cpu() && v.device().is_cpu(),
              "attention: CPU q (B, H, T, D) with unit stride along D; contiguous k, v (B, Hk, capacity, D), H a "
              "multiple of Hk; span <= capacity");
  TORCH_CHECK(q.size(3) % 8 == 0, "attention: a head size that is a multiple of 8");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == q.size(0) && mask.size(1) == 1 &&
                  mask.size(2) == q.size(2) && mask.size(3) == span && (span == 0 || mask.stride(3) == 1),
              "attention: bool mask (B, 1, T, span) with unit stride along span");
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options().dtype(out_dtype));
  const int64_t Hk = k.size(1), cap = k.size(2);
  if (dtype == at::kBFloat16)
    attend_heads(q, k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), mask, out.data_ptr<c10::BFloat16>(),
                 Hk, span, cap);
  else if (out_dtype == at::kBFloat16)
    attend_heads(q, k.data_ptr<float>(), v.data_ptr<float>(), mask, out.data_ptr<c10::BFloat16>(), Hk, span, cap);
  else
    attend_heads(q, k.data_ptr<float>(), v.data_ptr<float>(), mask, out.data_ptr<float>(), Hk, span, cap);
  return out;
}

}  // namespace sparkrl_native

namespace {


// nucleus: the sampling after a decode step's LM head, per row of logits (N, V): x = logits / T - max, p =
// softmax, the nucleus (tokens by descending p, ties lower id first, kept while the mass before them is below
// top_p), renormalised, listed in token-id order; the token the row's uniform u picks from it in id order (the
// inverse CDF, `sampling.sample_in_id_order`); and log softmax at that token (`sampling.logprob_of`). Nothing
// sorts the vocabulary: one pass makes exp(x) and a histogram of the mass by x (16 bins per unit, 40 units:
// below that a token's p is under 4e-18 of the top one's); the nucleus ends in the first bin where the mass
// reaches top_p; only the tokens of that bin and its two neighbours are sorted, to find the last one kept.
constexpr int BINS_PER_UNIT = 16, BIN_UNITS = 40, NBINS = BINS_PER_UNIT * BIN_UNITS;

struct Nucleus {
  std::vector<float> p;       // the nucleus's probabilities, renormalised, in id order
  std::vector<int64_t> id;    // their token ids, ascending
  int64_t token = 0;          // the sampled token
  float logp = 0.0f;          // its log-probability under softmax(x), before top-p
};

// x (V) and e = exp(x) (V) are the row's scratch buffers
Nucleus nucleus_row(const float* logits, int64_t V, float T, double top_p, double u, std::vector<float>& x,
                    std::vector<float>& e) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(logits + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, m8);
  float lmax = *std::max_element(lanes, lanes + 8);
  for (; i < V; ++i) lmax = std::max(lmax, logits[i]);
  const float m = lmax / T;  // = max(logits / T): division by T > 0 keeps the order
  // x, e (0 where x < -87, as float32's exp underflows there), their sum, and the mass histogram: one copy per
  // lane, so that the adds of neighbouring tokens (often in one bin) do not wait on each other
  std::vector<double> mass(8 * (NBINS + 1), 0.0);  // bin NBINS: too far below to matter
  const __m256 t8 = _mm256_set1_ps(T), top = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f);
  const __m256 scale = _mm256_set1_ps(-float(BINS_PER_UNIT)), last = _mm256_set1_ps(float(NBINS));
  __m256d s4a = _mm256_setzero_pd(), s4b = _mm256_setzero_pd();
  alignas(32) int32_t bins[8];
  alignas(32) float ev8[8];
  for (i = 0; i + 8 <= V; i += 8) {
    const __m256 l8 = _mm256_loadu_ps(logits + i);
    const __m256 xv = _mm256_sub_ps(T == 1.0f ? l8 : _mm256_div_ps(l8, t8), top);  // (logits / 1 = logits)
    const __m256 ev = _mm256_and_ps(exp8(_mm256_max_ps(xv, lo)), _mm256_cmp_ps(xv, lo, _CMP_GE_OQ));
    _mm256_storeu_ps(x.data() + i, xv);
    _mm256_storeu_ps(e.data() + i, ev);
    _mm256_store_ps(ev8, ev);
    s4a = _mm256_add_pd(s4a, _mm256_cvtps_pd(_mm256_castps256_ps128(ev)));
    s4b = _mm256_add_pd(s4b, _mm256_cvtps_pd(_mm256_extractf128_ps(ev, 1)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(bins), _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(xv, scale), last)));
    for (int l = 0; l < 8; ++l) mass[l * (NBINS + 1) + bins[l]] += ev8[l];
  }
  double sums[8];
  _mm256_storeu_pd(sums, s4a);
  _mm256_storeu_pd(sums + 4, s4b);
  double s = 0.0;
  for (double v : sums) s += v;
  for (; i < V; ++i) {
    x[i] = logits[i] / T - m;
    e[i] = x[i] >= -87.0f ? std::exp(x[i]) : 0.0f;
    s += e[i];
    mass[int(std::min(-x[i] * BINS_PER_UNIT, float(NBINS)))] += e[i];
  }
  // bin b: x in (-(b + 1) / 16, -b / 16]. The nucleus ends in bin b* (the mass reaches top_p there): tokens
  // with x > hi (above bin b* - 1) are kept for certain, those with x <= low (below bin b* + 1) are out, and the
  // bins between are sorted (the bins' sums run in another order than the walk below). Where the histogram's
  // mass falls short, every possible token is sorted.
  double cum = 0.0;
  int b_end = -1;
  for (int b = 0; b < NBINS && b_end < 0; ++b) {
    for (int l = 0; l < 8; ++l) cum += mass[l * (NBINS + 1) + b];
    if (cum >= top_p * s) b_end = b;
  }
  const float inf = std::numeric_limits<float>::infinity();
  float hi = b_end < 0 ? inf : -float(std::max(b_end - 1, 0)) / BINS_PER_UNIT;
  float low = b_end < 0 ? -inf : -float(b_end + 2) / BINS_PER_UNIT;
  double certain = 0.0;  // the mass (times s) of the tokens kept for certain
  std::vector<std::pair<float, int64_t>> edge;  // (x, id) of the tokens between
  {
    const __m256 hi8 = _mm256_set1_ps(hi), low8 = _mm256_set1_ps(low);
    __m256d c4a = _mm256_setzero_pd(), c4b = _mm256_setzero_pd();
    for (i = 0; i + 8 <= V; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x.data() + i);
      const __m256 above = _mm256_cmp_ps(xv, hi8, _CMP_GT_OQ);
      const __m256 ev = _mm256_and_ps(_mm256_loadu_ps(e.data() + i), above);
      c4a = _mm256_add_pd(c4a, _mm256_cvtps_pd(_mm256_castps256_ps128(ev)));
      c4b = _mm256_add_pd(c4b, _mm256_cvtps_pd(_mm256_extractf128_ps(ev, 1)));
      int between = _mm256_movemask_ps(_mm256_andnot_ps(above, _mm256_cmp_ps(xv, low8, _CMP_GT_OQ)));
      for (; between; between &= between - 1) {
        const int l = __builtin_ctz(between);
        edge.emplace_back(x[i + l], i + l);
      }
    }
    _mm256_storeu_pd(sums, c4a);
    _mm256_storeu_pd(sums + 4, c4b);
    for (double v : sums) certain += v;
    for (; i < V; ++i) {
      if (x[i] > hi) certain += e[i];
      else if (x[i] > low) edge.emplace_back(x[i], i);
    }
  }
  // a wide edge (a flat distribution: thousands of tokens within 3/16 of each other) narrowed the same way
  // before it is sorted, by histograms of 64 bins over its range
  while (edge.size() > 256 && b_end >= 0 && hi > low) {
    const float width = (hi - low) / 64;
    if (!(width > 0)) break;
    std::vector<double> sub(65, 0.0);
    for (const auto& [xj, j] : edge) sub[std::min(int((hi - xj) / width), 64)] += e[j];
    double c = certain;
    int k_end = -1;
    for (int k = 0; k <= 64 && k_end < 0; ++k) {
      c += sub[k];
      if (c >= top_p * s) k_end = k;
    }
    if (k_end < 0) break;
    const float new_hi = hi - std::max(k_end - 1, 0) * width, new_low = hi - (k_end + 2) * width;
    if (!(new_hi < hi || new_low > low)) break;  // no narrower (equal values)
    std::vector<std::pair<float, int64_t>> rest;
    for (const auto& pr : edge) {
      if (pr.first > new_hi) certain += e[pr.second];
      else if (pr.first > new_low) rest.push_back(pr);
    }
    edge.swap(rest);
    hi = new_hi;
    low = new_low;
  }
  std::sort(edge.begin(), edge.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  // the last token kept, (x, id): a token is kept iff it comes no later in the order (x desc, id asc)
  double before = certain / s;
  float x_end = hi;
  int64_t id_end = -1;  // with x_end = hi: only x > hi
  for (const auto& [xj, j] : edge) {
    if (before >= top_p) break;
    before += float(double(e[j]) / s);
    x_end = xj;
    id_end = j;
  }
  Nucleus out;
  double kept = 0.0;
  const __m256 end8 = _mm256_set1_ps(x_end);
  for (i = 0; i < V; i += 8) {
    int in = 0;
    if (i + 8 <= V) {
      const __m256 xv = _mm256_loadu_ps(x.data() + i);
      in = _mm256_movemask_ps(_mm256_cmp_ps(xv, end8, _CMP_GE_OQ));
    } else {
      for (int l = 0; i + l < V; ++l) in |= (x[i + l] >= x_end) << l;
    }
    for (; in; in &= in - 1) {
      const int64_t j = i + __builtin_ctz(in);
      if (x[j] == x_end && j > id_end) continue;
      const float pj = float(double(e[j]) / s);
      out.p.push_back(pj);
      out.id.push_back(j);
      kept += pj;
    }
  }
  // renormalised; the token at u in id order
  double total = 0.0;
  for (float& pj : out.p) {
    pj = float(pj / kept);
    total += pj;
  }
  const double at = u * total;
  double c = 0.0;
  out.token = -1;
  for (size_t k = 0; k < out.p.size(); ++k) {
    if (out.p[k] > 0) out.token = out.id[k];  // (u within rounding of 1: the last possible token)
    c += out.p[k];
    if (c > at) break;
  }
  out.logp = float(double(x[out.token]) - std::log(s));
  return out;
}

std::vector<at::Tensor> nucleus(const at::Tensor& logits, double temperature, double top_p, const at::Tensor& u) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0,
              "nucleus: contiguous float32 CPU logits (N, V)");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.dim() == 1 && u.size(0) == logits.size(0) && u.is_contiguous() &&
                  u.device().is_cpu(),
              "nucleus: float64 CPU uniforms (N,)");
  TORCH_CHECK(temperature > 0 && top_p > 0 && top_p < 1, "nucleus: temperature > 0 and 0 < top_p < 1");
  const int64_t N = logits.size(0), V = logits.size(1);
  std::vector<Nucleus> rows(N);
  const float* x = logits.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(V), e(V);
    for (int64_t r = begin; r < end; ++r) rows[r] = nucleus_row(x + r * V, V, float(temperature), top_p, uu[r], xs, e);
  });
  size_t K = 1;
  for (const auto& r : rows) K = std::max(K, r.p.size());
  at::Tensor probs = at::zeros({N, int64_t(K)}, logits.options());
  at::Tensor ids = at::empty({N, int64_t(K)}, logits.options().dtype(at::kLong));
  at::Tensor token = at::empty({N}, ids.options()), logp = at::empty({N}, logits.options());
  float* pp = probs.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<char> held(V);
  for (int64_t r = 0; r < N; ++r) {
    const auto& row = rows[r];
    std::copy(row.p.begin(), row.p.end(), pp + r * K);
    std::copy(row.id.begin(), row.id.end(), ip + r * K);
    if (row.p.size() < K) {  // the other columns: probability 0 on the lowest ids the row does not hold
      std::fill(held.begin(), held.end(), 0);
      for (int64_t j : row.id) held[j] = 1;
      int64_t j = 0;
      for (size_t k = row.p.size(); k < K; ++k) {
        while (held[j]) ++j;
        ip[r * K + k] = j++;
      }
    }
    token.data_ptr<int64_t>()[r] = row.token;
    logp.data_ptr<float>()[r] = row.logp;
  }
  return {probs, ids, token, logp};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparkrl_native, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &sparkrl_native::rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &sparkrl_native::rope);
  m.def("nucleus(Tensor logits, float temperature, float top_p, Tensor u) -> Tensor[]", &nucleus);
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, int span, ScalarType out_dtype) -> Tensor", &sparkrl_native::attention);
}
