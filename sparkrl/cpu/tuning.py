"""What the CPU layer measures on this machine once (cached per kind of CPU, model, threads and torch): whether a
policy's rollouts run faster in bfloat16 than in float32 (`bf16_speedup`, for --rollout-dtype auto), and
whether a half-precision model's attention runs faster in float32 where torch's attention serves
(`float32_attention`, for --cpu-kernels packed and weight-major)."""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from sparkrl.cpu import native
from sparkrl.cpu.accelerate import accelerate
from sparkrl.cpu.kernels import HALF
from sparkrl.machine import measurement_path
from sparkrl.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def accelerated_copy(policy: Transformer, dtype: torch.dtype) -> Transformer:
    """A frozen copy of `policy` in `dtype` as --cpu-kernels auto runs it."""
    model = copy.deepcopy(policy).to(dtype).requires_grad_(False)
    return accelerate(model, "auto", float32_attention("auto", dtype, model.lm_head.weight.device, model.args)).model


def _step_seconds(
    model: Transformer, rows: int = 8, context: int = 128, reps: int = 5, tokens: int = 1, head: bool = True
) -> list[float]:
    """Seconds of `reps` cached forwards of `tokens` new tokens on `rows` rows beside a `context`-token
    prefix (rolled back after each), with the LM head on each row's last position (head); after one
    untimed warm-up."""
    dev = model.lm_head.weight.device
    g = torch.Generator(device=dev).manual_seed(0)
    cache = model.new_cache(rows, context + tokens + 1)
    cache.lengths += context
    tok = torch.randint(0, model.args.vocab_size, (rows, tokens), device=dev, generator=g)
    zeros = torch.zeros(rows, dtype=torch.long, device=dev)
    out = []
    with torch.no_grad():
        for _ in range(reps + 1):
            t = time.perf_counter()
            hidden = model(tok, cache).hidden
            if head:
                model.logits(hidden[:, -1])
            cache.commit(n_keep=zeros)
            out.append(time.perf_counter() - t)
    return out[1:]


DTYPE_ROWS = (1, 8, 64)  # rows of the decode steps `bf16_speedup` times


def bf16_speedup(policy: Transformer) -> float:
    """float32 / bfloat16 seconds of this policy's decode step on this machine, each dtype as its rollout
    copy runs it under --cpu-kernels auto: the geometric mean over 1, 8 and 64 rows. Measured once and cached."""
    dev = policy.lm_head.weight.device
    path = measurement_path(
        "dtype", str(dev), policy.args.__dict__, {"rows": DTYPE_ROWS, "kernels": "exact", "native": native.digest()}
    )
    if path.exists():
        return json.loads(path.read_text())["speedup"]
    models = {dt: accelerated_copy(policy, DTYPES[dt]) for dt in DTYPES}
    print(
        "sparkrl: timing float32 against bfloat16 decode steps on this machine (once; cached)",
        file=sys.stderr,
        flush=True,
    )
    times = {dt: {rows: [] for rows in DTYPE_ROWS} for dt in DTYPES}
    for _ in range(2):  # interleaved: drift hits both alike
        for rows in DTYPE_ROWS:
            for dt, m in models.items():
                times[dt][rows] += _step_seconds(m, rows=rows)
    by_rows = {
        rows: statistics.median(times["float32"][rows]) / statistics.median(times["bfloat16"][rows])
        for rows in DTYPE_ROWS
    }
    speedup = statistics.geometric_mean(by_rows.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"speedup": speedup, "by_rows": by_rows, "seconds": times}))
    return speedup


def _call_seconds(f, reps: int) -> float:
    """Mean seconds of `reps` calls of f() after one untimed call."""
    with torch.no_grad():
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
    return (time.perf_counter() - t) / reps


def _faster_by_5_percent(path, times: dict, base: str, other: str) -> bool:
    """Whether `other` is faster than `base` by 5% over the sum of its medians per size (times: system ->
    size -> seconds); the decision, the speedup and the timings cached at `path`."""
    total = {name: sum(statistics.median(t) for t in by_size.values()) for name, by_size in times.items()}
    ratio = total[base] / total[other]
    pays = ratio > 1.05
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pays": pays, "speedup": ratio, "seconds": times}))
    return pays


ATTENTION_SIZES = ((1, 1), (8, 1), (64, 1), (8, 17))  # (rows, new tokens) of the cached attentions timed
ATTENTION_CONTEXT = 192  # cached positions beside them


def _attention_seconds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, reps: int = 10) -> float:
    """Mean seconds of a cached attention over keys and values k, v in their dtype (the queries cast to it,
    the output back), as `Attention` runs it."""
    return _call_seconds(
        lambda: F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, enable_gqa=True).to(q.dtype), reps
    )


def float32_attention_pays(dtype: torch.dtype, args) -> bool:
    """Whether a `dtype` (half-precision) model's cached attention runs faster in float32 on a float32 KV
    cache (queries cast up, outputs cast back; `Attention.attn_dtype`) than in `dtype` on this CPU, by 5% overall:
    decode steps of 1, 8 and 64 rows and a 17-token forward of 8 rows beside a 192-token context, with
    `args`' heads (medians of interleaved calls). On the AVX512-BF16 CPU of docs/experiments/cached-attention.md
    torch's bfloat16 attention for one new token is 4-9x slower than float32's. Measured once per machine, dtype
    and head shape, and cached."""
    shape = {"heads": args.num_heads, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim}
    path = measurement_path("attention", str(dtype), shape, {"sizes": ATTENTION_SIZES, "context": ATTENTION_CONTEXT})
    if path.exists():
        return json.loads(path.read_text())["pays"]
    print(
        f"sparkrl: timing {str(dtype).removeprefix('torch.')} against float32 attention on this machine (once; cached)",
        file=sys.stderr,
        flush=True,
    )
    g = torch.Generator().manual_seed(0)
    times = {name: {str(size): [] for size in ATTENTION_SIZES} for name in ("half", "float32")}
    for _ in range(3):  # interleaved: drift hits both alike
        for rows, tokens in ATTENTION_SIZES:
            S = ATTENTION_CONTEXT + tokens
            q = torch.randn(rows, args.num_heads, tokens, args.head_dim, generator=g).to(dtype)
            kv = torch.randn(2, rows, args.num_kv_heads, S, args.head_dim, generator=g)
            mask = torch.ones(rows, 1, tokens, S, dtype=torch.bool).tril(ATTENTION_CONTEXT)
            for name, k, v in (("half", *kv.to(dtype)), ("float32", *kv)):
                times[name][str((rows, tokens))].append(_attention_seconds(q, k, v, mask))
    return _faster_by_5_percent(path, times, "half", "float32")


def float32_attention(choice: str, dtype: torch.dtype, device: torch.device | str, args=None) -> bool:
    """Whether a model in `dtype` on `device` under --cpu-kernels `choice` attends in float32: for a policy (its
    `args`; a drafter follows its policy) in half precision on a CPU where torch's attention serves (packed,
    weight-major, or auto without the compiled kernels), as `float32_attention_pays` measures; off under plain,
    the reference, and where the compiled attention serves (it reads a half-precision cache as it streams)."""
    if choice == "plain" or torch.device(device).type != "cpu" or (choice == "auto" and native.available()):
        return False
    return args is not None and dtype in HALF and float32_attention_pays(dtype, args)
