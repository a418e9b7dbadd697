"""Linear layers with two inference fast paths on a CPU: prepacked oneDNN weights (half precision) and
weight-major products (decode-sized products whose weights come from memory).

A bfloat16 `F.linear` on a CPU hands oneDNN a plain row-major weight, which it reorders into its
blocked layout on every call; at decode sizes (a few rows) that reorder costs more than the product.
Measured on this project's CPU (BENCHMARKS.md "Prepacked bfloat16 weights"): 1.5-2.3x per call for the
default model's projections at 1-1088 rows, the same results up to a bfloat16 rounding of the
accumulation. `Linear` is `nn.Linear` that, once `pack`ed, keeps a prepacked copy of its weight and
uses it when no gradient is recorded; the copy is remade the first time the weight has changed
since (its version counter), so a refreshed rollout copy or an optimizer step is never served
stale. Training forwards (gradients on) always run the plain `F.linear`, which stays the reference.
Whether packing pays is measured once per machine and dtype (`precision.packing_pays`, cached);
float32 is never packed (MKL's sgemm is faster unpacked: measured 0.2-1.1x).

A weight-major product computes `F.linear(x, W)` as `(W @ x^T)^T`, copied back to row-major: the same
sums, with the weight as the large left operand that the BLAS streams once in its own row order. At
decode sizes a model's weights come from memory, not the caches, and on this project's AMD CPU MKL's
sgemm reads them faster that way: the LM head (49152 x 576) 1.9-2.1x at 8 rows and 1.5-1.6x at 64,
the default model's decode step 1.4-1.8x at 2-8 rows and 1.05-1.2x at 64 (BENCHMARKS.md "Weight-major
products"). It serves 2 to `WEIGHT_MAJOR_ROWS` rows (decode steps, small verify forwards, the
acceptance walk's LM head).
The row-major copy matters: left as a transposed view, the attention and elementwise passes after it
made a 64-row step 2.6x slower. Whether it pays is measured once per machine on the policy's own
decode steps (`precision.weight_major_pays`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HALF = (torch.bfloat16, torch.float16)
WEIGHT_MAJOR_ROWS = 128  # weight-major products for 2..128 rows: at one row both forms are matrix-vector
# products (F.linear measured up to 4% faster); past 128 rows they did not pay (0.93x-1.08x at 136 rows,
# 0.89x for a 512-token prefill), so prefills, large trees and training-sized forwards stay on F.linear


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) with an optional prepacked weight for
    inference (`pack`)."""

    packed = False  # set per instance by `pack`
    weight_major = False  # set per instance by `precision.use_weight_major`
    _pack = None  # (prepacked weight, the weight's (tensor id, version) it was made from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled() or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)
        if self.packed and x.device.type == "cpu":
            key = (id(w), w._version)
            if self._pack is None or self._pack[1] != key:
                self._pack = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1), key)
            return torch.ops.mkldnn._linear_pointwise(x, self._pack[0], self.bias, "none", [], "")
        if self.weight_major and 2 <= x.numel() // x.shape[-1] <= WEIGHT_MAJOR_ROWS:
            return weight_major_linear(x, w, self.bias)
        return F.linear(x, w, self.bias)

    def __getstate__(self):  # copies (deepcopy, pickling) leave the prepacked weight behind
        state = self.__dict__.copy()
        state.pop("_pack", None)
        return state


def weight_major_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` as `(w @ x^T)^T` (see the module doc): x (..., in) -> (..., out), row-major."""
    y = torch.mm(w, x.reshape(-1, x.shape[-1]).t()).t().contiguous()  # (N, out)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], w.shape[0])


def packable(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether this torch can prepack weights of `dtype` on `device` at all."""
    return (torch.device(device).type == "cpu" and dtype in HALF and torch.backends.mkldnn.is_available()
            and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and (dtype != torch.float16 or torch.ops.mkldnn._is_mkldnn_fp16_supported()))


def pack(module: nn.Module, on: bool = True) -> nn.Module:
    """Use (on) or stop using prepacked weights in every `Linear` of `module` whose weight can be packed."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = on and packable(m.weight.dtype, m.weight.device)
            m._pack = None
    return module


def is_packed(module: nn.Module) -> bool:
    return any(isinstance(m, Linear) and m.packed for m in module.modules())
