"""Linear layers on prepacked oneDNN weights: the CPU's fast path for half-precision inference.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HALF = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) with an optional prepacked weight for
    inference (`pack`)."""

    packed = False  # set per instance by `pack`
    _pack = None  # (prepacked weight, the weight's (tensor id, version) it was made from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.packed and not torch.is_grad_enabled() and x.dtype == w.dtype and x.device.type == "cpu":
            key = (id(w), w._version)
            if self._pack is None or self._pack[1] != key:
                self._pack = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1), key)
            return torch.ops.mkldnn._linear_pointwise(x, self._pack[0], self.bias, "none", [], "")
        return F.linear(x, w, self.bias)

    def __getstate__(self):  # copies (deepcopy, pickling) leave the prepacked weight behind
        state = self.__dict__.copy()
        state.pop("_pack", None)
        return state


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
