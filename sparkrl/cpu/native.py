"""Compiled CPU kernels for no-grad forwards whose result for a row never depends on its batch.

* `linear`: y = x W^T + b, each output's sum in one fixed order whatever the number of rows
  (`csrc/small_linear.cpp`: float32, or a bfloat16 weight widened as it streams; `csrc/bf16_pairs.cpp`:
  AVX512-BF16 dot products on a weight repacked into pairs).
* `rms_norm`, `rope`: one call each, rounding bfloat16 intermediates where torch's ops do (`csrc/decode_ops.cpp`).
* `attention`: cached attention reading each key/value head once for all its query rows, the softmax's sums
  over the positions a row sees in cache order.
* `decode_layer`: a decoder layer's cached forward (norms, products, RoPE, cache write, attention, residuals,
  MLP) in one call of the kernels above, the same bits as the layer's modules give on them.
* `quantize_rows`, `int8_linear`: 8-bit weights (one scale per output row) and activations (one per row, quantized
  as they come in), exact int32 sums (`csrc/int8_linear.cpp`: AVX2's u8 x s8 products); not yet a rollout dtype.
* `nucleus`: the softmax, top-p nucleus, token and log-probability of a row of logits in one call.

Why: speculative rollouts of point-mass drafts commit exactly the tokens autoregressive sampling gives with the
same seed only if a position's logits are the same bits in a one-token decode step and in a many-token verify
forward. BLAS and oneDNN choose their blocking (the order of a dot product's adds) by the number of rows, torch's
attention by the span; these kernels fix one order per output, and turn a decode step's ~1,300 small ops into a
few calls.

Built once per machine by torch's C++ extension loader (gcc, AVX2 and FMA; about 20 s, cached) when first
wanted. Where the CPU lacks AVX2 or FMA, or no compiler works, `available()` is False (one line says why) and
torch's kernels serve: rollouts stay exact in distribution but are not token-identical to AR ones.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in ("small_linear.cpp", "decode_ops.cpp", "bf16_pairs.cpp", "decode_layer.cpp", "int8_linear.cpp")
]
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: torch's thread pool (at::parallel_for)


def cpu_supported() -> bool:
    """Whether this CPU runs the AVX2 + FMA code (torch's own detection: AVX2 or better)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def available() -> bool:
    """Whether the compiled kernels can run here: built (or loaded from torch's cache) on first call."""
    if not cpu_supported():
        print(
            f"sparkrl: the compiled kernels need AVX2 and FMA (this CPU: "
            f"{torch.backends.cpu.get_cpu_capability()}); using torch's kernels",
            file=sys.stderr,
            flush=True,
        )
        return False
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the `ninja` package's binary, beside this interpreter in a venv
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        print(
            "sparkrl: loading the compiled kernels (built on first use: about 20 s once per machine)",
            file=sys.stderr,
            flush=True,
        )
        load(
            "sparkrl_native",
            [str(p) for p in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: the other kernels serve
        print(
            f"sparkrl: the compiled kernels are not available ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); using torch's kernels",
            file=sys.stderr,
            flush=True,
        )
        return False


def digest() -> str:
    """A hash of the kernels' sources and flags: cached timings of other kernels are not reused."""
    files = [*SOURCES, CSRC / "kernels.h"]
    return hashlib.sha1(b"".join(p.read_bytes() for p in files) + " ".join(FLAGS).encode()).hexdigest()[:12]


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear(x, w)` takes this product: CPU tensors of one dtype (float32 or bfloat16), w contiguous,
    any number of rows."""
    return x.device.type == "cpu" and x.dtype == w.dtype and w.dtype in DTYPES and w.is_contiguous()


def serves_elementwise(x: torch.Tensor) -> bool:
    """Whether `rms_norm` and `rope` take x: a float32 or bfloat16 CPU tensor, no gradient recorded."""
    return x.dtype in DTYPES and x.device.type == "cpu" and not torch.is_grad_enabled()


@functools.cache
def bf16_dot() -> bool:
    """Whether bfloat16 products run on the CPU's bfloat16 dot products (AVX512-BF16; `csrc/bf16_pairs.cpp`),
    on weights repacked into pairs (`pack_pairs`), instead of widening them to float32."""
    return available() and bool(torch.ops.sparkrl_native.has_bf16_dot())


def pack_pairs(w: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight (out, in) repacked for `linear(..., pairs=)`; None where that product cannot take it
    (no `bf16_dot`, another dtype, an odd input size)."""
    if not bf16_dot() or w.dtype != torch.bfloat16 or w.shape[1] % 2:
        return None
    return torch.ops.sparkrl_native.pack_pairs(w.detach().contiguous())


def linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, pairs: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for a product `serves` takes: x (..., in), w (out, in) (`available()` must
    be True); pairs: w as `pack_pairs` made it (bfloat16 on the CPU's dot products)."""
    out, inp = w.shape
    x2 = x.reshape(-1, inp)
    if pairs is not None:
        y = torch.ops.sparkrl_native.pairs_linear(x2.contiguous(), pairs, out, bias)
    else:
        y = torch.ops.sparkrl_native.small_linear(x2.contiguous(), w, bias)
    return y.view(*x.shape[:-1], out)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`model.RMSNorm`'s inference forward in one call (`csrc/decode_ops.cpp`): float32 or bfloat16 CPU x
    (..., D) and w (D,) of x's dtype; the sums in float32, bfloat16 rounded as the module rounds it."""
    return torch.ops.sparkrl_native.rms_norm(x.contiguous(), w, eps)


def serves_attention(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attention` takes q (B, H, T, D) over the cache buffer k: float32 or bfloat16 CPU tensors of one
    dtype, no gradient recorded, D a multiple of 8 (any number of new tokens)."""
    return (
        q.dtype in DTYPES
        and k.dtype == q.dtype
        and q.device.type == "cpu"
        and not torch.is_grad_enabled()
        and q.shape[3] % 8 == 0
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, span: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=mask, enable_gqa=True)` in one
    call (`csrc/decode_ops.cpp`), as (B, T, H, D) in out_dtype (bfloat16 for bfloat16 inputs): q (B, H, T, D) with
    unit stride along D, k and v a `KVCache`'s buffers (B, H_kv, capacity, D), mask (B, 1, T, span) bool (True:
    may attend). Scores, softmax and sums in float32; a query with nothing to attend to gets zeros."""
    if span and mask.stride(-1) != 1:
        mask = mask.contiguous()
    return torch.ops.sparkrl_native.attention(q, k, v, mask, span, out_dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`model.apply_rope` in one call (`csrc/decode_ops.cpp`): x (B, H, T, D) of any strides with unit stride
    along D, cos and sin (B, 1, T, D), all float32 or all bfloat16 on the CPU; the result contiguous."""
    return torch.ops.sparkrl_native.rope(x, cos.contiguous(), sin.contiguous())


def nucleus(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor):
    """`sampling.sample_nucleus` in one call (`csrc/decode_ops.cpp`): float32 CPU logits (N, V), temperature > 0,
    0 < top_p < 1, float64 uniforms u (N,) -> (probs (N, K), ids (N, K), token (N,), logp (N,)); each row's
    nucleus in id order, then ids of probability 0 it does not hold. A histogram of the softmax's mass replaces
    a sort of the vocabulary: only the tokens near the nucleus's edge are sorted."""
    return tuple(
        torch.ops.sparkrl_native.nucleus(logits.contiguous(), temperature, top_p, u.to(torch.float64).contiguous())
    )


def decode_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    span: int,
    weights: list,
    heads: int,
    kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """`DecoderLayer.forward` with a cache, on the kernels above, in one call (`csrc/decode_layer.cpp`): x (B, T, d);
    cos, sin (B, 1, T, D) in x's dtype; k_cache, v_cache one layer's `KVCache` buffers (written at `rows`, as
    `KVCache.write`); mask (B, 1, T, span) and span as `attention` takes them; weights as
    `CpuDecoderLayer.compiled_weights` lists them. Returns the layer's output (B, T, d)."""
    return torch.ops.sparkrl_native.decode_layer(
        x, cos.contiguous(), sin.contiguous(), k_cache, v_cache, rows, mask, span, weights, heads, kv_heads, eps
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit quantization of each row of a float32 or bfloat16 CPU x (M, K) (`csrc/int8_linear.cpp`):
    (q int8 (M, Kp), scale float32 (M,)) with x ~ q * scale, scale = max |x| / 127, q rounded to nearest even in
    [-127, 127]; Kp = K rounded up to a multiple of 32, zero-padded. A weight quantized this way feeds `int8_linear`."""
    q, s = torch.ops.sparkrl_native.quantize_rows(x.contiguous())
    return q, s


def int8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) float32 or bfloat16 times a weight quantized by `quantize_rows` (wq (N, Kp), ws (N,)): x's rows are
    quantized the same way, the products summed exactly in int32, then scaled (float32) and rounded to x's dtype;
    bias (N,) in x's dtype. A row's output never depends on the other rows."""
    out = torch.ops.sparkrl_native.int8_linear(x.reshape(-1, x.shape[-1]).contiguous(), wq, ws, bias)
    return out.view(*x.shape[:-1], wq.shape[0])
