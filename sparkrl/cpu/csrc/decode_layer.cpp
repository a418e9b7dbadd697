// One decoder layer's cached forward in one call (sparkrl/cpu/native.py `decode_layer`): the ops that
// `DecoderLayer.forward` (sparkrl/model/transformer.py) runs on the compiled kernels, in the same order, on the
// same kernels and with the same tensor shapes, so every output bit and every cache entry is the same. What goes is
// Python: at one response a decode step spent some 11 of its 28 ms dispatching ~60 small ops per layer through
// the modules; here they are C++ calls (the products, norms, RoPE and attention directly, the cache write, the
// residual adds and silu * up through ATen, the very kernels torch's Python ops reach).
//
// Weights, in the order `CpuDecoderLayer.compiled_weights` lists them (absent ones undefined): input norm; q/k/v
// concatenated (weight, bias, bfloat16 pairs); q and k norms (Qwen3); output projection (weight, bias, pairs);
// post-attention norm; gate/up concatenated (weight, bias, pairs); down projection (weight, bias, pairs).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "kernels.h"

namespace {

using Weights = c10::List<c10::optional<at::Tensor>>;
enum : int64_t { LN1, QKV, QKV_B, QKV_P, Q_NORM, K_NORM, O, O_B, O_P, LN2, GATE_UP, GATE_UP_B, GATE_UP_P, DOWN,
                 DOWN_B, DOWN_P, N_WEIGHTS };  // clang-format: one list

// A profiler's record of a kernel called here, under the name its own op has (what bench/roofline.py splits the
// step by); nothing is recorded, and next to nothing spent, while no profiler runs.
#define KERNEL(name) RECORD_FUNCTION("sparkrl_native::" name, c10::ArrayRef<const c10::IValue>{})

// `native.linear`: x (..., in) times the weight at w[i] (its bias at i + 1, its pairs at i + 2) -> (..., out); an
// int8 weight (`native.int8_linear`) has its scales at i + 2
at::Tensor product(const at::Tensor& x, const Weights& w, int64_t i) {
  const at::Tensor weight = *w.get(i);
  const c10::optional<at::Tensor> bias = w.get(i + 1), pairs = w.get(i + 2);
  const int64_t out = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor y;
  if (weight.scalar_type() == at::kChar) {  // 8-bit: the scales in the pairs' place (`kernels.compiled`)
    KERNEL("int8_linear");
    y = sparkrl_native::int8_linear(x2, weight, *pairs, bias);
  } else if (pairs.has_value()) {
    KERNEL("pairs_linear");
    y = sparkrl_native::pairs_linear(x2, *pairs, out, bias);
  } else {
    KERNEL("small_linear");
    y = sparkrl_native::small_linear(x2, weight, bias);
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  KERNEL("rms_norm");
  return sparkrl_native::rms_norm(x, w, eps);
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  KERNEL("rope");
  return sparkrl_native::rope(x, cos, sin);
}

}  // namespace

namespace sparkrl_native {

// x (B, T, d); cos, sin (B, 1, T, D) contiguous in x's dtype; k, v one layer's cache buffers (B, H_kv, capacity, D);
// rows (B * H_kv * T,) the cache rows of the new tokens (`KVCache.rows`); mask (B, 1, T, span) bool.
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& mask, int64_t span,
                        const Weights& w, int64_t H, int64_t Hk, double eps) {
  TORCH_CHECK(w.size() == N_WEIGHTS, "decode_layer: ", N_WEIGHTS, " weights (CpuDecoderLayer.compiled_weights)");
  TORCH_CHECK(x.dim() == 3 && k_cache.dim() == 4, "decode_layer: x (B, T, d), caches (B, H_kv, capacity, D)");
  const int64_t B = x.size(0), T = x.size(1), D = k_cache.size(3);
  // attention: q, k, v of the normed input, split as `linears` splits them
  const at::Tensor qkv = product(norm(x.contiguous(), *w.get(LN1), eps), w, QKV);
  at::Tensor q = qkv.narrow(-1, 0, H * D).view({B, T, H, D});
  at::Tensor k = qkv.narrow(-1, H * D, Hk * D).view({B, T, Hk, D});
  const at::Tensor v = qkv.narrow(-1, (H + Hk) * D, Hk * D).view({B, T, Hk, D}).transpose(1, 2);
  if (w.get(Q_NORM).has_value()) {
    q = norm(q.contiguous(), *w.get(Q_NORM), eps);
    k = norm(k.contiguous(), *w.get(K_NORM), eps);
  }
  q = rotate(q.transpose(1, 2), cos, sin);
  k = rotate(k.transpose(1, 2), cos, sin);
  k_cache.view({-1, D}).index_copy_(0, rows, k.reshape({-1, D}));  // `KVCache.write`
  v_cache.view({-1, D}).index_copy_(0, rows, v.reshape({-1, D}));
  const at::Tensor m = span && mask.stride(-1) != 1 ? mask.contiguous() : mask;
  at::Tensor a;
  {
    KERNEL("attention");
    a = attention(q, k_cache, v_cache, m, span, q.scalar_type()).view({B, T, H * D});
  }
  const at::Tensor h = x + product(a, w, O);
  // MLP: silu(gate) * up, down, residual
  const at::Tensor gate_up = product(norm(h, *w.get(LN2), eps), w, GATE_UP);
  const int64_t F = gate_up.size(-1) / 2;
  return h + product(at::silu(gate_up.narrow(-1, 0, F)) * gate_up.narrow(-1, F, F), w, DOWN);
}

}  // namespace sparkrl_native

TORCH_LIBRARY_FRAGMENT(sparkrl_native, m) {
  m.def("decode_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, "
        "Tensor mask, int span, Tensor?[] weights, int heads, int kv_heads, float eps) -> Tensor",
        &sparkrl_native::decode_layer);
}
