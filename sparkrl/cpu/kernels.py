"""Linear layers with their inference kernels on a CPU: `CpuLinear` is the model's `Linear` (same parameters
and state-dict names; `cpu.accelerate` swaps it in) whose no-grad forwards run

* the compiled product of `sparkrl.cpu.native` where `native` is set (--cpu-kernels auto):
  each output's sum in one fixed order whatever the number of rows, which is what keeps speculative rollouts
  token-identical to autoregressive ones;
* or, as explicit alternatives that give that up: a prepacked oneDNN weight (`pack`; --cpu-kernels packed: a
  bfloat16 `F.linear` would reorder its weight into oneDNN's blocked layout on every call), or a weight-major
  product (`weight_major_linear`; --cpu-kernels weight-major: `F.linear(x, W)` as `(W @ x^T)^T`, the weight
  streamed once in its own row order, split into one block per thread);
* else `F.linear`, which training forwards (gradients on) always run: the reference.

A prepacked, fused or repacked copy of a weight is remade the first time the weight has changed since (its
version counter), so a refreshed rollout copy or an optimizer step is never served stale. Layers that read
the same input (q/k/v, gate/up) run as one product over their weights concatenated (`linears`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparkrl.cpu import native
from sparkrl.model.transformer import Linear, dense

HALF = (torch.bfloat16, torch.float16)
PACK_ROWS_HINT = {torch.float32: 16}  # oneDNN's batch-size hint when it reorders a weight (else 1): in float32
# the layout made for 16 rows runs 8-64-row products 1.0-1.3x faster than the one made for 1 row
PACKED_WEIGHT_MAJOR_ROWS = 4  # a packed float32 layer runs weight-major products up to this many rows, where they
# match or beat oneDNN's prepacked ones (1.3-1.45x at one row) and lose from 8 rows
# (docs/experiments/weight-major-products.md); a packed half-precision layer never does (prepacked is faster at
# every size)
WEIGHT_MAJOR_ROWS = 128  # weight-major products for 1..128 rows; past that they do not pay (0.89x for a 512-token
# prefill), so prefills, large trees and training-sized forwards stay on F.linear
WEIGHT_MAJOR_PARTS: int | None = None  # blocks per weight-major product; None: torch's thread count
FUSE_LINEARS = True  # `linears` as one product; False (a bench knob) runs the layers one by one


class CpuLinear(Linear):
    """The model's `Linear` whose no-grad forwards run one of the kernels above, as `cpu.accelerate` sets it."""

    packed = False  # prepacked oneDNN weights (`pack`)
    weight_major = False  # weight-major products (`use_weight_major`)
    native = False  # the compiled product of `sparkrl.cpu.native` (`use_native`)
    int8 = False  # 8-bit weights and activations (`native.int8_linear`; `accelerate.use_int8`)
    _pack = None  # (prepacked weight, the weight's (tensor id, version) it was made from)
    _fused = None  # `linears`' concatenation of this layer's weight with others' (on the first layer)
    _pairs = None  # (`native.pack_pairs` of the weight the compiled product last took, that weight, its version)
    _q = None  # ((int8 weight, scales) of the weight the 8-bit product last took, that weight, its version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        x = dense(x)
        product = self.product(x)
        if product is not None:
            return product(x, w, self.bias)
        if torch.is_grad_enabled() or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)
        if self.packed and x.device.type == "cpu":
            key = (id(w), w._version)
            if self._pack is None or self._pack[1] != key:
                self._pack = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT.get(w.dtype, 1)), key)
            return torch.ops.mkldnn._linear_pointwise(x, self._pack[0], self.bias, "none", [], "")
        return F.linear(x, w, self.bias)

    def sibling(self, weight: torch.Tensor) -> "CpuLinear":
        out = super().sibling(weight)
        out.__class__ = CpuLinear
        out.weight_major, out.native = self.weight_major, self.native
        return pack(out, self.packed)

    def product(self, x: torch.Tensor):
        """The weight-streaming product that serves `forward(x)`, called as f(x, weight, bias): the compiled
        one (`native.linear`, where `native` is set and it takes x) or a weight-major one; None where a
        prepacked or plain `F.linear` serves, and always while gradients are recorded."""
        if torch.is_grad_enabled() or x.dtype != self.weight.dtype:
            return None
        if self.int8 and native.serves(x, self.weight):
            return self._int8
        if self.native and native.serves(x, self.weight):
            return self._compiled
        return weight_major_linear if self.serves_weight_major(x) else None

    def _compiled(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`native.linear`; a bfloat16 weight on a CPU with bfloat16 dot products repacked into pairs first
        (`native.pack_pairs`), kept and remade the first time the weight has changed (as `_pack`). w: this
        layer's weight or, from `linears`, its concatenation with others'."""
        return native.linear(x, w, bias, pairs=self.pairs(w))

    def _int8(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`native.int8_linear` on w quantized (`quantized`); w: this layer's weight or, from `linears`, its
        concatenation with others'."""
        return native.int8_linear(x, *self.quantized(w), bias)

    def quantized(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w as `native.quantize_rows` makes it (int8 values, one float32 scale per output), kept and remade the
        first time w has changed (its version counter: an optimizer step or a refresh requantizes it)."""
        q = self._q
        if q is None or q[1] is not w or q[2] != w._version:
            self._q = q = (native.quantize_rows(w.detach()), w, w._version)
        return q[0]

    def pairs(self, w: torch.Tensor) -> torch.Tensor | None:
        """`native.pack_pairs(w)` for a bfloat16 w on a CPU with bfloat16 dot products (else None), kept and remade
        the first time w has changed (its version counter)."""
        if w.dtype != torch.bfloat16 or not native.bf16_dot():
            return None
        p = self._pairs  # the weight itself is kept, not its id: a freed concatenation's id can come back
        if p is None or p[1] is not w or p[2] != w._version:
            self._pairs = p = (native.pack_pairs(w), w, w._version)
        return p[0]

    def serves_weight_major(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` is a weight-major product: 1 to `WEIGHT_MAJOR_ROWS` rows, or to
        `PACKED_WEIGHT_MAJOR_ROWS` where a packed float32 layer's prepacked product serves the larger ones."""
        if not self.weight_major or torch.is_grad_enabled() or x.dtype != self.weight.dtype:
            return False
        most = WEIGHT_MAJOR_ROWS if not self.packed else PACKED_WEIGHT_MAJOR_ROWS if x.dtype == torch.float32 else 0
        return 1 <= x.numel() // x.shape[-1] <= most

    def __getstate__(self):  # copies (deepcopy, pickling) leave the prepacked and fused weights behind
        state = self.__dict__.copy()
        state.pop("_pack", None)
        state.pop("_fused", None)
        state.pop("_pairs", None)
        state.pop("_q", None)
        return state


def linears(x: torch.Tensor, *layers: CpuLinear) -> tuple[torch.Tensor, ...]:
    """`tuple(layer(x) for layer in layers)`: several `Linear`s over one input (q/k/v, gate/up). Where the
    compiled or weight-major product serves x, one product over their weights concatenated: one call streams
    them all, and at a decode step's sizes the calls' fixed costs are a large part of the time (1.07-1.13x
    for the default model's float32 decode step at one row: docs/experiments/weight-major-products.md). The
    concatenation is a copy kept on the first layer and remade whenever a weight or bias is another tensor or
    has changed in place (its version counter), so an optimizer step or a refresh is never served stale; it
    costs the layers' memory once more (279 MB for the default model in float32). The outputs are views of
    one tensor."""
    first, x = layers[0], dense(x)
    product = first.product(x)
    if len(layers) == 1 or not FUSE_LINEARS or product is None or not fusable(layers):
        return tuple(l(x) for l in layers)
    return product(x, *concatenated(layers)).split([l.out_features for l in layers], dim=-1)


def fusable(layers: tuple[CpuLinear, ...]) -> bool:
    """Whether `layers` pick one product (their kernels, dtype and bias alike), so `linears` can run them as one."""
    flags = lambda l: (l.native, l.int8, l.weight_major, l.packed, l.weight.dtype, l.bias is None)
    return all(flags(l) == flags(layers[0]) for l in layers[1:])


def concatenated(layers: tuple[CpuLinear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias (or None) of `layers` concatenated along their outputs, as `linears` runs them: kept on
    the first layer and remade whenever a weight or bias is another tensor or has changed (its version)."""
    first = layers[0]
    if len(layers) == 1:
        return first.weight, first.bias
    tensors = tuple(t for l in layers for t in (l.weight, l.bias) if t is not None)
    versions = tuple(t._version for t in tensors)
    f = first._fused
    if f is None or f[1] != versions or any(a is not b for a, b in zip(f[0], tensors)):
        w = torch.cat([l.weight.detach() for l in layers])
        b = None if first.bias is None else torch.cat([l.bias.detach() for l in layers])
        first._fused = f = (tensors, versions, w, b)
    return f[2], f[3]


def compiled(x: torch.Tensor, *layers: CpuLinear) -> list | None:
    """[weight, bias, pairs] of `layers` (concatenated where there are several) as the compiled product runs
    `linears(x, *layers)` on them, or [int8 weight, bias, scales] as the 8-bit one does; None where neither serves
    x (another kernel, gradients recorded)."""
    first = layers[0]
    product = first.product(x)
    if product not in (first._compiled, first._int8) or (len(layers) > 1 and not (FUSE_LINEARS and fusable(layers))):
        return None
    w, b = concatenated(layers)
    if product == first._int8:
        q, scales = first.quantized(w)
        return [q, b, scales]
    return [w, b, first.pairs(w)]


def weight_major_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, parts: int | None = None
) -> torch.Tensor:
    """`F.linear(x, w, bias)` as `(w @ x^T)^T` (see the module doc): x (..., in) -> (..., out), row-major.
    The weight's output rows are split into `parts` blocks (default: `WEIGHT_MAJOR_PARTS`, else torch's
    thread count; one block where they do not divide evenly), one batched product. One row in one block
    (a single thread) is `F.linear`: both are matrix-vector products, and `F.linear` is up to 4% faster."""
    out, inp = w.shape
    x2 = x.reshape(-1, inp)
    rows = x2.shape[0]
    parts = parts or WEIGHT_MAJOR_PARTS or torch.get_num_threads()
    if out % parts or not w.is_contiguous():
        parts = 1
    if rows == 0 or (rows == 1 and parts == 1):  # one row in one block: F.linear's matrix-vector product
        return F.linear(x, w, bias)
    blocks = w.view(parts, out // parts, inp) if parts > 1 else w.unsqueeze(0)
    y = torch.bmm(blocks, x2.t().expand(parts, inp, rows))  # (parts, out / parts, rows)
    y = y.permute(2, 0, 1).reshape(rows, out).contiguous()  # row-major: a copy, except at one row
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], out)


def packable(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether this torch can prepack weights of `dtype` on `device` at all."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (*HALF, torch.float32)
        and torch.backends.mkldnn.is_available()
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        and (dtype != torch.float16 or torch.ops.mkldnn._is_mkldnn_fp16_supported())
    )


def pack(module: nn.Module, on: bool = True) -> nn.Module:
    """Use (on) or stop using prepacked weights in every `Linear` of `module` whose weight can be packed."""
    for m in module.modules():
        if isinstance(m, CpuLinear):
            m.packed = on and packable(m.weight.dtype, m.weight.device)
            m._pack = None
    return module


def is_packed(module: nn.Module) -> bool:
    return any(isinstance(m, CpuLinear) and m.packed for m in module.modules())
