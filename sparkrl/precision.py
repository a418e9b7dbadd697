"""Rollouts in the rollout dtype, training with the master weights (DESIGN "Precision").

The policy's master weights (--dtype; float32 on a CPU) are what the optimizer steps. Rollouts run on
a copy in the rollout dtype (`RolloutCopy`, refreshed in place after every update, no reallocation);
so does the drafter. `--rollout-dtype auto` picks bfloat16 on CUDA, and on a CPU when a start-up
measurement of this policy's decode steps says bfloat16 is faster there (cached per kind of CPU, model
and thread count), float32 otherwise.

On a CPU, `--cpu-kernels auto` runs a copy's no-grad forwards on the compiled kernels (`sparkrl.native`):
products, norms, RoPE, cached attention and sampling, each computing a row the same way whatever else the
forward carries, so that speculative rollouts of point-mass drafts commit the very tokens autoregressive
sampling gives (the README's pairing promise). A half-precision copy attends in float32 over a float32 KV
cache where a one-off measurement finds that faster (`float32_attention_pays`). `packed` (oneDNN's
prepacked weights), `weight-major` and `plain` (torch's kernels, the reference the tests compare with) are
explicit alternatives; their products and attention change their order of adds with the batch, so they
keep exactness in distribution but not token identity with AR.
Exactness is relative to the rollout model; the gap to the master weights is
measured every step (`mismatch`) and can be corrected with truncated importance sampling
(`grpo.grpo_loss`, --tis-cap).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from sparkrl import native
from sparkrl.kernels import HALF, Linear, pack, packable
from sparkrl.model import Attention, RMSNorm, Transformer
from sparkrl.machine import measurement_path
from sparkrl.sharding import full

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _step_seconds(model: Transformer, rows: int = 8, context: int = 128, reps: int = 5, tokens: int = 1,
                  head: bool = True) -> list[float]:
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
    path = measurement_path("dtype", str(dev), policy.args.__dict__, {"rows": DTYPE_ROWS, "kernels": "exact",
                                                                       "native": native.digest()})
    if path.exists():
        return json.loads(path.read_text())["speedup"]
    models = {dt: rollout_copy(policy, DTYPES[dt], separate=True).model
              for dt in DTYPES}  # (their own measurements first, cached: they print what they time)
    print("sparkrl: timing float32 against bfloat16 decode steps on this machine (once; cached)", file=sys.stderr,
          flush=True)
    times = {dt: {rows: [] for rows in DTYPE_ROWS} for dt in DTYPES}
    for _ in range(2):  # interleaved: drift hits both alike
        for rows in DTYPE_ROWS:
            for dt, m in models.items():
                times[dt][rows] += _step_seconds(m, rows=rows)
    by_rows = {rows: statistics.median(times["float32"][rows]) / statistics.median(times["bfloat16"][rows])
               for rows in DTYPE_ROWS}
    speedup = statistics.geometric_mean(by_rows.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"speedup": speedup, "by_rows": by_rows, "seconds": times}))
    return speedup


def rollout_dtype(choice: str, policy: Transformer) -> torch.dtype:
    """The dtype rollouts run in for --rollout-dtype `choice` (auto: measured, see the module doc)."""
    if choice != "auto":
        return DTYPES[choice]
    w = policy.lm_head.weight
    if w.dtype != torch.float32:  # master weights already in a half type: sample in it
        return w.dtype
    if w.device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if bf16_speedup(policy) > 1.05 else torch.float32


def _call_seconds(f, reps: int) -> float:
    """Mean seconds of `reps` calls of f() after one untimed call."""
    with torch.no_grad():
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
    return (time.perf_counter() - t) / reps


def native_choice(choice: str) -> bool:
    """Whether --cpu-kernels `choice` runs the compiled kernels: under auto (where they can be built)."""
    return choice == "auto"


def use_native(module: torch.nn.Module, on: bool = True, ops: bool | None = None) -> torch.nn.Module:
    """Run `module`'s no-grad CPU forwards on the compiled kernels (where they are available; never off a CPU,
    where they are not even built) or on torch's:
    every `Linear`'s products (on; their `native` flag), and every `RMSNorm` and `Attention`'s RoPE and cached
    attention (ops, the same as on unless given; their `native` flags), and with those a `Transformer`'s
    sampling (`Transformer.compiled_ops`)."""
    cpu = next(module.parameters()).device.type == "cpu"  # elsewhere nothing is built: torch's kernels serve
    on = bool(on) and cpu and native.available()
    ops = (on if ops is None else bool(ops)) and cpu and native.available()
    for m in module.modules():
        if isinstance(m, Linear):
            m.native = on
            if not on:
                m._pairs = None  # the compiled product's repacked weight
        elif isinstance(m, (RMSNorm, Attention)):
            m.native = ops
    return module


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
    return _call_seconds(lambda: F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask,
                                                                enable_gqa=True).to(q.dtype), reps)


def float32_attention_pays(dtype: torch.dtype, args) -> bool:
    """Whether a `dtype` (half-precision) model's cached attention runs faster in float32 on a float32 KV
    cache (queries cast up, outputs cast back; `Attention.attn_dtype`) than in `dtype` on this CPU, by 5% overall:
    decode steps of 1, 8 and 64 rows and a 17-token forward of 8 rows beside a 192-token context, with
    `args`' heads (medians of interleaved calls). On this project's AVX512-BF16 CPU torch's bfloat16
    attention for one new token was 4-9x slower than float32's (BENCHMARKS.md "Cached attention in
    float32"). Measured once per machine, dtype and head shape, and cached."""
    shape = {"heads": args.num_heads, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim}
    path = measurement_path("attention", str(dtype), shape, {"sizes": ATTENTION_SIZES, "context": ATTENTION_CONTEXT})
    if path.exists():
        return json.loads(path.read_text())["pays"]
    print(f"sparkrl: timing {str(dtype).removeprefix('torch.')} against float32 attention on this machine "
          "(once; cached)", file=sys.stderr, flush=True)
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


def float32_attention_wanted(model: torch.nn.Module) -> bool:
    """Measured for a policy in half precision on a CPU (`float32_attention_pays`); a drafter follows its
    policy, and a GPU's flash attention runs half precision natively."""
    w = model.lm_head.weight if isinstance(model, Transformer) else None
    return (w is not None and w.dtype in HALF and w.device.type == "cpu"
            and float32_attention_pays(w.dtype, model.args))


def float32_attention_choice(choice: str, device: torch.device | str = "cpu") -> bool | None:
    """`RolloutCopy`'s attention32 for --cpu-kernels `choice`: measured (None) where torch's attention serves
    (packed, weight-major, or auto without the compiled kernels); off under plain, the reference, and where the
    compiled attention serves (it reads a half-precision cache as it streams, at half the bytes)."""
    if choice == "plain" or torch.device(device).type != "cpu" or (choice == "auto" and native.available()):
        return False
    return None


def use_float32_attention(module: torch.nn.Module, on: bool = True) -> torch.nn.Module:
    """Run every `Attention` of `module` in float32 with a float32 KV cache (on: queries, keys and values
    cast up, outputs cast back), or in its inputs' dtype; caches made before keep their dtype."""
    for m in module.modules():
        if isinstance(m, Attention):
            m.attn_dtype = torch.float32 if on else None
    return module


def weight_major_choice(choice: str) -> bool:
    """`RolloutCopy`'s weight_major for --cpu-kernels `choice`: on under weight-major only."""
    return choice == "weight-major"


def use_weight_major(module: torch.nn.Module, on: bool = True) -> torch.nn.Module:
    """Run every `Linear` of `module` as a weight-major product (on) where it serves the product
    (`Linear.serves_weight_major`: up to 128 rows, up to 4 in a packed float32 layer, never in a packed
    half-precision one), else as before (no-gradient forwards only, like packing); off frees the fused
    weights of `kernels.linears`."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.weight_major = on
            if not m.weight_major:
                m._fused = None
    return module


def use_packed(choice: str, dtype: torch.dtype, policy: Transformer) -> bool:
    """Whether --cpu-kernels `choice` runs a rollout copy of `policy` in `dtype` on prepacked oneDNN weights:
    under packed, where this torch can pack that dtype."""
    return choice == "packed" and packable(dtype, policy.lm_head.weight.device)


def rollout_copy(module: torch.nn.Module, dtype: torch.dtype, cpu_kernels: str = "auto", head_float32: bool = False,
                 separate: bool = False) -> "RolloutCopy":
    """`module`'s `RolloutCopy` in `dtype` as --cpu-kernels `cpu_kernels` runs it (see the module doc); float32
    attention measured except under plain."""
    return RolloutCopy(module, dtype, separate=separate, packed=use_packed(cpu_kernels, dtype, module),
                       head_float32=head_float32, weight_major=weight_major_choice(cpu_kernels),
                       attention32=float32_attention_choice(cpu_kernels, next(module.parameters()).device),
                       native=native_choice(cpu_kernels),
                       ops=native_choice(cpu_kernels))


class RolloutCopy:
    """`module` (a policy or a drafter) as the rollout runs it: the module itself when the dtypes agree
    (unless `separate`), else a copy in `dtype` that `refresh()` overwrites in place from the master
    weights. separate: always a copy, made before the master is sharded (`sharding.FullyShard`), whose
    refresh gathers each sharded parameter in turn (every rank calls it)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, separate: bool = False, packed: bool = False,
                 head_float32: bool = False, weight_major: bool = False, attention32: bool | None = None,
                 native: bool = False, ops: bool | None = None):
        self.master = module
        w = next(module.parameters())
        if w.dtype == dtype and not separate:
            self.model = module
        else:
            shared = getattr(module, "_shared", ())  # a drafter's borrowed policy embedding: not copied
            memo = {id(s): s for s in shared}
            self.model = copy.deepcopy(module, memo).to(dtype).requires_grad_(False)
            self.model._shared = shared if shared else getattr(self.model, "_shared", ())
        pack(self.model, packed)  # prepacked weights serve only no-grad forwards, remade after each refresh
        use_weight_major(self.model, weight_major)
        use_native(self.model, native, ops)
        use_float32_attention(self.model, float32_attention_wanted(self.model) if attention32 is None else attention32)
        if head_float32 and dtype != torch.float32:  # a float32 copy of the master's head (refreshed below)
            self.model.head32 = (full(module.lm_head.weight).detach().float().clone(),)

    @property
    def copied(self) -> bool:
        return self.model is not self.master

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master weights (and buffers) into the rollout model, casting, without reallocating."""
        for head in getattr(self.model, "head32", ()):
            head.copy_(full(self.master.lm_head.weight))
        if not self.copied:
            return
        for dst, src in zip(self.model.parameters(), self.master.parameters()):
            dst.copy_(full(src))  # one whole parameter at a time beside the copy
        for dst, src in zip(self.model.buffers(), self.master.buffers()):
            dst.copy_(src)
