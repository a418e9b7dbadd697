"""Compiled CPU kernels for inference forwards: a product for a few rows (`csrc/small_linear.cpp`): y =
x W^T + b with the weight streamed from memory once and the partial sums in float32 AVX2 registers, x
and W both float32 or both bfloat16; and a decode step's RMSNorm, RoPE and cached attention, each in one
call (`csrc/decode_ops.cpp`).

At the sizes of decode steps, tree verification and the acceptance walk (1 to 32 rows), a model's
weights come from memory and the BLAS calls pay for packing and blocking made for large products:
on this project's 2-core AMD CPU (AVX2, no AVX512) it made the default model's float32 decode step
1.10x / 1.23x / 1.16x faster at 2 / 8 / 16 rows than prepacked oneDNN products (the float32 default
before) and a one-row 17-token verify forward 1.12x (BENCHMARKS.md "A compiled float32 product for a
few rows"). A whole decode step gained nothing at one row, so one-row float32 products stay on the BLAS
kernels (`MIN_ROWS`); past 32 rows oneDNN's prepacked products are faster again.

A bfloat16 weight is widened to float32 as it is loaded: half the bytes of a float32 weight from memory,
float32 arithmetic. On a CPU without bfloat16 dot products that is what bfloat16 rollouts can gain
(torch's own bfloat16 products there ran 5-9x slower than float32 ones from 32 rows up; BENCHMARKS.md
"bfloat16 weights on a CPU without bfloat16 arithmetic"), so it takes every bfloat16 product: up to
`HALF_ROWS` rows on the kernel, larger ones (prefills) as a float32 BLAS product of the widened operands.
On a CPU with bfloat16 dot products (AVX512-BF16) bfloat16 products run on those instead
(`csrc/bf16_pairs.cpp`, `bf16_dot`): the weight repacked once into pairs of inputs (`pack_pairs`, kept by
the layer until the weight changes), one instruction yielding 16 outputs; there torch's products past
`HALF_ROWS` rows. Against oneDNN's prepacked products on this project's AVX512-BF16 CPU it made the default
model's bfloat16 AR sampler 1.42x faster at one response (BENCHMARKS.md "bfloat16 dot products on
repacked weights").

At one row most of a decode step's time is not the weights but dispatching some 1,300 small tensor
ops, and a norm (5-8 of them) and RoPE (7) are some 30 of a layer's 60: `rms_norm` and `rope` do each in
one call, rounding a bfloat16 intermediate wherever the tensor ops do (BENCHMARKS.md "The compiled
RMSNorm and RoPE"). `attention` reads the KV cache once per key/value head for all its query rows (SDPA's
CPU kernel is made for long blocks, and torch's bfloat16 one was 4-9x slower for one new token); with fewer
heads than keep the threads equally busy (one sequence: 3 heads on 2 threads) it splits their positions into
parts merged after (1.1-1.3x per call at one sequence, 5 new tokens, 350-1,500 positions; BENCHMARKS.md).

After the LM head, `nucleus` samples a row in one call: the softmax, the top-p nucleus, the token in id
order and its log-probability. torch's ops find the nucleus with a top-256 preselection, then top-4096, then a
full sort; this model's nucleus at T 1 is often wider than 256 tokens, and the kernel finds it from one pass
(a histogram of the softmax's mass) and sorts only the tokens near its edge: 3.8x faster at one row, 4.2-4.7x
at 8-64 (bench/decode_ops.py). It runs where the norms, RoPE and attention do (`Transformer.compiled_ops`).

The kernels are compiled once per machine with torch's C++ extension loader (gcc, AVX2 and FMA; about
15 s, cached under torch's extensions folder) the first time it is wanted; where the CPU lacks AVX2
or FMA, or no compiler works, `available()` is False (with one line saying why) and the layers keep
torch's. Whether they pay is measured per machine, model and dtype: the products (`precision.native_pays`)
apart from the norms, RoPE and attention (`precision.compiled_ops_pay`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("small_linear.cpp", "decode_ops.cpp", "bf16_pairs.cpp")]
MIN_ROWS, MAX_ROWS = 2, 32  # the float32 products it takes: a one-row one (a matrix-vector product) ran no faster
# than the BLAS kernels' in a whole decode step here (0.95x, 1.00x), and past 32 rows oneDNN's prepacked ones were faster
HALF_ROWS = 512  # bfloat16 products of up to this many rows run the kernel (verify forwards of 8-16 trees, most
# prefills); larger ones widen both operands for a float32 BLAS product. Against that product, in scratch timings
# here, the kernel took 0.45-1.2x its time at 128 rows and 0.8-1.25x at 512 (the LM head faster, the 1536 x 576
# layers slower); one 8 x 17-row verify forward ran 0.74x of float32 with the product past 128 rows
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take
OPS_TOKENS = 256  # the most positions `rms_norm` and `rope` take (one thread, where torch's ops are threaded):
# per call, against torch's ops here, 1.1-7x faster from 1 to 136 positions, about even at 256 (a bfloat16 norm
# 1.07x, RoPE 0.89x), slower at 512 (RoPE 0.80x) (bench/decode_ops.py)
ATTN_TOKENS = 17  # the most new tokens per sequence `attention` takes: decode steps and verify forwards of up to
# 16-node trees. Per call against torch's SDPA here (one layer of the default model over 256 cached positions,
# bench/decode_ops.py): float32 2.3-2.6x at 1 new token, 1.6x at 4, 1.26x at 8, 1.06x at 17; bfloat16 (torch's
# bfloat16 SDPA) 11-18x at 1, 1.03x at 17
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: torch's thread pool (at::parallel_for)


def cpu_supported() -> bool:
    """Whether this CPU runs the AVX2 + FMA code (torch's own detection: AVX2 or better)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def available() -> bool:
    """Whether the compiled kernels can run here: built (or loaded from torch's cache) on first call."""
    if not cpu_supported():
        print(f"sparkrl: the compiled kernels need AVX2 and FMA (this CPU: "
              f"{torch.backends.cpu.get_cpu_capability()}); using torch's kernels", file=sys.stderr, flush=True)
        return False
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the `ninja` package's binary, beside this interpreter in a venv
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        print("sparkrl: loading the compiled kernels (built on first use: about 20 s once per machine)",
              file=sys.stderr, flush=True)
        load("sparkrl_native", [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False)
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: the other kernels serve
        print(f"sparkrl: the compiled kernels are not available ({type(e).__name__}: "
              f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); using torch's kernels",
              file=sys.stderr, flush=True)
        return False


def digest() -> str:
    """A hash of the kernels' sources and flags: cached timings of other kernels are not reused."""
    return hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()).hexdigest()[:12]


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear(x, w)` takes this product: CPU tensors of one dtype, w contiguous; float32 with
    `MIN_ROWS` to `MAX_ROWS` rows, or bfloat16 with any."""
    if x.device.type != "cpu" or x.dtype != w.dtype or not w.is_contiguous():
        return False
    rows = x.numel() // x.shape[-1]
    if w.dtype == torch.float32:
        return MIN_ROWS <= rows <= MAX_ROWS
    return w.dtype == torch.bfloat16 and rows >= 1


def serves_elementwise(x: torch.Tensor, tokens: int) -> bool:
    """Whether `rms_norm` and `rope` take x, of `tokens` positions (rows x new tokens): a float32 or bfloat16
    CPU tensor, no gradient recorded, at most `OPS_TOKENS` positions."""
    return x.dtype in DTYPES and x.device.type == "cpu" and not torch.is_grad_enabled() and tokens <= OPS_TOKENS


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


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           pairs: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for a product `serves` takes: x (..., in), w (out, in) (`available()` must
    be True); pairs: w as `pack_pairs` made it (bfloat16 on the CPU's dot products). bfloat16 past
    `HALF_ROWS` rows: torch's own product where the CPU has bfloat16 dot products, else a float32
    product of the widened operands, rounded back."""
    out, inp = w.shape
    x2 = x.reshape(-1, inp)
    if w.dtype != torch.float32 and x2.shape[0] > HALF_ROWS:
        if pairs is not None:
            return F.linear(x, w, bias)
        return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
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
    dtype, no gradient recorded, at most `ATTN_TOKENS` new tokens, D a multiple of 8."""
    return (q.dtype in DTYPES and k.dtype == q.dtype and q.device.type == "cpu" and not torch.is_grad_enabled()
            and q.shape[2] <= ATTN_TOKENS and q.shape[3] % 8 == 0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, span: int,
              out_dtype: torch.dtype) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=mask, enable_gqa=True)` in one
    call (`csrc/decode_ops.cpp`), transposed to (B, T, H, D) in out_dtype (float32 or bfloat16; bfloat16 for
    bfloat16 inputs): q (B, H, T, D) with unit stride along D, k and v a `KVCache`'s buffers (B, H_kv, capacity,
    D), mask (B, 1, T, span) bool (True: may attend). Scores, softmax and sums in float32; a query with nothing
    to attend to gets zeros."""
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
    nucleus in id order, then ids of probability 0 it does not hold. One pass for the softmax and a histogram of
    its mass instead of sorting the vocabulary; only the tokens near the nucleus's edge are sorted."""
    return tuple(torch.ops.sparkrl_native.nucleus(logits.contiguous(), temperature, top_p,
                                                  u.to(torch.float64).contiguous()))
