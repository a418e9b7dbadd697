"""A compiled product for a few rows (`csrc/small_linear.cpp`): y = x W^T + b with the weight streamed
from memory once and the partial sums in float32 AVX2 registers; x and W both float32 or both bfloat16.

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

The kernel is compiled once per machine with torch's C++ extension loader (gcc, AVX2 and FMA; about
15 s, cached under torch's extensions folder) the first time it is wanted; where the CPU lacks AVX2
or FMA, or no compiler works, `available()` is False (with one line saying why) and the layers keep
their other kernels. Whether it pays is measured per machine, model and dtype (`precision.native_pays`).
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

SOURCE = Path(__file__).parent / "csrc" / "small_linear.cpp"
MIN_ROWS, MAX_ROWS = 2, 32  # the float32 products it takes: a one-row one (a matrix-vector product) ran no faster
# than the BLAS kernels' in a whole decode step here (0.95x, 1.00x), and past 32 rows oneDNN's prepacked ones were faster
HALF_ROWS = 128  # bfloat16 products of up to this many rows run the kernel; larger ones widen both operands for a
# float32 BLAS product (at 512 rows 0.8-1.0x the kernel's time here, at 128 rows 1.1-2.3x)
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: torch's thread pool (at::parallel_for)


def cpu_supported() -> bool:
    """Whether this CPU runs the AVX2 + FMA code (torch's own detection: AVX2 or better)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def available() -> bool:
    """Whether the compiled product can run here: built (or loaded from torch's cache) on first call."""
    if not cpu_supported():
        print(f"sparkrl: the compiled few-row product needs AVX2 and FMA (this CPU: "
              f"{torch.backends.cpu.get_cpu_capability()}); using the BLAS kernels", file=sys.stderr, flush=True)
        return False
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the `ninja` package's binary, beside this interpreter in a venv
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        print("sparkrl: loading the compiled few-row product (compiled on first use: about 15 s once per machine)",
              file=sys.stderr, flush=True)
        load("sparkrl_native", [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: the other kernels serve
        print(f"sparkrl: the compiled few-row product is not available ({type(e).__name__}: "
              f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); using the BLAS kernels",
              file=sys.stderr, flush=True)
        return False


def digest() -> str:
    """A hash of the kernel's source and flags: cached timings of another kernel are not reused."""
    return hashlib.sha1(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear(x, w)` takes this product: CPU tensors of one dtype, w contiguous; float32 with
    `MIN_ROWS` to `MAX_ROWS` rows, or bfloat16 with any."""
    if x.device.type != "cpu" or x.dtype != w.dtype or not w.is_contiguous():
        return False
    rows = x.numel() // x.shape[-1]
    if w.dtype == torch.float32:
        return MIN_ROWS <= rows <= MAX_ROWS
    return w.dtype == torch.bfloat16 and rows >= 1


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for a product `serves` takes: x (..., in), w (out, in) (`available()` must
    be True). bfloat16 past `HALF_ROWS` rows: a float32 product of the widened operands, rounded back."""
    out, inp = w.shape
    x2 = x.reshape(-1, inp)
    if w.dtype != torch.float32 and x2.shape[0] > HALF_ROWS:
        return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    y = torch.ops.sparkrl_native.small_linear(x2.contiguous(), w, bias)
    return y.view(*x.shape[:-1], out)
