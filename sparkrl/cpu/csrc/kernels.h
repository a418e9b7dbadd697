// The compiled kernels one C++ file calls in another (sparkrl/cpu/native.py documents each): the products (float,
// bfloat16 pairs, 8-bit), the norm, RoPE and cached attention that `decode_layer` (decode_layer.cpp) composes into one decoder layer.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace sparkrl_native {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor pairs_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& ws,
                       const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     int64_t span, c10::ScalarType out_dtype);

}  // namespace sparkrl_native
