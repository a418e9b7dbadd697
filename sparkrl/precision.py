"""Rollouts in the rollout dtype, training with the master weights (DESIGN "Precision").

The policy's master weights (--dtype; float32 on a CPU) are what the optimizer steps. Rollouts run on
a copy in the rollout dtype (`RolloutCopy`, refreshed in place after every update, no reallocation);
so does the drafter. `--rollout-dtype auto` picks bfloat16 on CUDA, and on a CPU when a start-up
measurement of this policy's decode steps, each dtype on the kernels its copy gets, says bfloat16 is
faster there (cached per kind of CPU, model and thread count, like the cost model), float32 otherwise.
A half-precision copy on a CPU runs its linear layers on prepacked oneDNN weights (`kernels.Linear`)
where a one-off measurement finds them faster (`packing_pays`; --cpu-kernels), its other linear layers
as weight-major products where a one-off measurement of its decode step finds those faster
(`weight_major_pays`), and its attention in float32 over a float32 KV cache where a one-off
measurement finds that faster (`float32_attention_pays`: torch's bfloat16 attention for one new token
was 4-9x slower here). Any copy's products run on the compiled kernel (`sparkrl.native`) where a one-off
measurement finds that faster (`native_pays`): in float32 those of a few rows; in bfloat16 all of them, the
weights widened to float32 as they stream, which is what makes bfloat16 rollouts pay on a CPU without
bfloat16 arithmetic (torch's bfloat16 products there ran 5-9x slower than float32 ones from 32 rows up);
apart from that, its norms, RoPE and cached attention run as one compiled call each where that is measured faster
(`compiled_ops_pay`).
Exactness is relative to the rollout model; the gap to the master weights is
measured every step (`mismatch`) and can be corrected with truncated importance sampling
(`grpo.grpo_loss`, --tis-cap).
"""

from __future__ import annotations

import contextlib
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
    copy runs it under --cpu-kernels auto (`RolloutCopy`: prepacked weights, weight-major products and
    float32 attention where they pay): the geometric mean over 1, 8 and 64 rows. Measured once and cached.
    (Timing float32 on plain `F.linear` against the faster bfloat16 kernels chose bfloat16 here, which
    was then no faster than float32 rollouts: BENCHMARKS.md "Cached attention in float32".)"""
    dev = policy.lm_head.weight.device
    path = measurement_path("dtype", str(dev), policy.args.__dict__, {"rows": DTYPE_ROWS, "kernels": "auto",
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


def _seconds(layer: Linear, x: torch.Tensor, reps: int) -> float:
    return _call_seconds(lambda: layer(x), reps)


def packing_pays(dtype: torch.dtype, device: torch.device | str = "cpu", policy: Transformer | None = None) -> bool:
    """Whether prepacked weights make a decode-sized product (1 and 16 rows, 1024 x 2048) faster than
    plain `F.linear` in `dtype` on this machine: measured once (interleaved, medians) and cached.
    float32 is measured on `policy`'s own forwards instead (`float32_packing_pays`; False without one)."""
    if not packable(dtype, device):
        return False
    if dtype == torch.float32:
        return policy is not None and float32_packing_pays(policy)
    path = measurement_path("packing", str(dtype), str(torch.device(device)))
    if path.exists():
        return json.loads(path.read_text())["pays"]
    print(f"sparkrl: timing prepacked {str(dtype).removeprefix('torch.')} weights on this machine (once; cached)",
          file=sys.stderr, flush=True)
    g = torch.Generator().manual_seed(0)
    plain = Linear(1024, 2048, bias=False).to(dtype).requires_grad_(False)
    packed = pack(Linear(1024, 2048, bias=False).to(dtype).requires_grad_(False))
    times = {"plain": [], "packed": []}
    for _ in range(5):  # interleaved: drift hits both alike
        for rows in (1, 16):
            x = torch.randn(rows, 1024, generator=g).to(dtype)
            for name, layer in (("plain", plain), ("packed", packed)):
                times[name].append(_seconds(layer, x, 20))
    ratio = statistics.median(times["plain"]) / statistics.median(times["packed"])
    pays = ratio > 1.05
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pays": pays, "speedup": ratio, "seconds": times}))
    return pays


PACKING_SIZES = ((8, 1), (32, 1), (1, 17))  # (rows, new tokens) of the forwards `float32_packing_pays` times


@contextlib.contextmanager
def kernels_restored(model: torch.nn.Module):
    """A timing that switches `model`'s kernels (`pack`, `use_weight_major`, `use_native`) leaves every
    `Linear` as it found it: its flags, and its prepacked weight unless the timing changed its packing
    (then it is made again on the next forward); fused weights only where weight-major products serve;
    and every `RMSNorm`'s and `Attention`'s flag. The compiled kernels are off meanwhile unless the timing
    turns them on: torch's kernels are timed as such."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    was = [(m.packed, m.weight_major, m.native) for m in layers]
    norms = [(m, m.native) for m in model.modules() if isinstance(m, (RMSNorm, Attention))]
    use_native(model, False)
    try:
        yield model
    finally:
        for m, (packed, weight_major, compiled) in zip(layers, was):
            if m.packed != packed:
                m._pack = None
            if not weight_major:
                m._fused = None
            m.packed, m.weight_major, m.native = packed, weight_major, compiled
        for m, compiled in norms:
            m.native = compiled


def float32_packing_pays(policy: Transformer) -> bool:
    """Whether this policy's float32 forwards of more than `kernels.PACKED_WEIGHT_MAJOR_ROWS` rows (decode
    steps of 8 and 32 rows, a 17-token verify forward of one row) run faster on prepacked oneDNN weights
    than on the faster of plain `F.linear` and weight-major products, by 5% overall (medians of 6
    interleaved forwards each). The policy itself is timed if it is float32, else a float32 copy.
    Measured once per machine and model, and cached."""
    path = measurement_path("packing", str(torch.float32), str(policy.lm_head.weight.device), policy.args.__dict__,
                            {"sizes": PACKING_SIZES})
    if path.exists():
        return json.loads(path.read_text())["pays"]
    print("sparkrl: timing prepacked float32 weights on this machine (once; cached)", file=sys.stderr, flush=True)
    model = policy if policy.lm_head.weight.dtype == torch.float32 else copy.deepcopy(policy).float()
    systems = ("plain", "weight_major", "packed")  # packed: weight-major up to PACKED_WEIGHT_MAJOR_ROWS rows
    times = {name: {str(size): [] for size in PACKING_SIZES} for name in systems}
    with kernels_restored(model):
        for _ in range(2):  # interleaved: drift hits all alike
            for rows, tokens in PACKING_SIZES:
                for name in systems:
                    use_weight_major(pack(model, name == "packed"), name != "plain")
                    times[name][str((rows, tokens))] += _step_seconds(model, rows=rows, tokens=tokens, reps=3)
    total = {name: sum(statistics.median(t) for t in by_size.values()) for name, by_size in times.items()}
    ratio = min(total["plain"], total["weight_major"]) / total["packed"]
    pays = ratio > 1.05
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pays": pays, "speedup": ratio, "seconds": times}))
    return pays


def weight_major_pays(policy: Transformer) -> bool:
    """Whether this policy's decode step (1, 2, 8 and 64 rows) runs faster with every linear layer as a
    weight-major product (`kernels.weight_major_linear`) than with `F.linear` on this machine: faster
    overall by 5% and not slower at any row count by 3% (medians of 12 interleaved steps each).
    A packed float32 policy is timed at 1, 2 and 4 rows, the sizes weight-major products take from its
    prepacked ones (`kernels.PACKED_WEIGHT_MAJOR_ROWS`), and faster overall suffices: at 2-4 rows the two
    are level on this project's CPU, so a floor per row count flipped the choice on noise (off at one row
    too, where weight-major products are 1.3-1.45x faster). Measured once per machine, model,
    dtype and packing, and cached; never on a GPU, whose BLAS reads either operand order alike. A
    half-precision copy on prepacked weights (`pack`) keeps those."""
    w = policy.lm_head.weight
    if w.device.type != "cpu":
        return False
    packed = policy.lm_head.packed
    if packed and w.dtype != torch.float32:
        return False
    rows = (1, 2, 4) if packed else (1, 2, 8, 64)
    path = measurement_path("weight-major", str(w.dtype), policy.args.__dict__,
                            {"rows": rows,
                             "form": "a block per thread; one row on one thread: F.linear; q/k/v, gate/up fused"},
                            *([{"packed": True}] if packed else []))
    if path.exists():
        return json.loads(path.read_text())["pays"]
    print("sparkrl: timing weight-major products on this machine (once; cached)", file=sys.stderr, flush=True)
    times = {r: {"plain": [], "weight_major": []} for r in rows}
    with kernels_restored(policy):
        for _ in range(3):  # interleaved: drift hits both alike
            for r in rows:
                for name in ("plain", "weight_major"):
                    use_weight_major(policy, name == "weight_major")
                    times[r][name] += _step_seconds(policy, rows=r, reps=4)
    med = {r: {k: statistics.median(v) for k, v in t.items()} for r, t in times.items()}
    ratio = {r: m["plain"] / m["weight_major"] for r, m in med.items()}
    overall = sum(m["plain"] for m in med.values()) / sum(m["weight_major"] for m in med.values())
    pays = overall > 1.05 and (packed or min(ratio.values()) > 0.97)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pays": pays, "speedup": overall, "by_rows": ratio, "seconds": times}))
    return pays


def _faster_by_5_percent(path, times: dict, base: str, other: str) -> bool:
    """Whether `other` is faster than `base` by 5% over the sum of its medians per size (times: system ->
    size -> seconds); the decision, the speedup and the timings cached at `path`."""
    total = {name: sum(statistics.median(t) for t in by_size.values()) for name, by_size in times.items()}
    ratio = total[base] / total[other]
    pays = ratio > 1.05
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pays": pays, "speedup": ratio, "seconds": times}))
    return pays


NATIVE_SIZES = ((1, 1), (8, 1), (32, 1), (1, 17))  # (rows, new tokens) of the forwards `native_pays` times


def native_pays(policy: Transformer) -> bool:
    """Whether this policy's products that `native.serves` (float32 ones of 2 to `native.MAX_ROWS` rows,
    every bfloat16 one) run faster on the compiled kernel than on the kernels it has (`_compiled_timing`)."""
    return _compiled_timing(policy)["pays"]


def compiled_ops_pay(policy: Transformer) -> bool:
    """Whether this policy's norms, RoPE and cached attention run faster as one compiled call each
    (`native.rms_norm`, `native.rope`, `native.attention`) than as torch's tensor ops (`_compiled_timing`).
    Sampling follows the same switch (`Transformer.compiled_ops`: the compiled nucleus, `native.nucleus`), which
    this timing leaves out: per call it ran 3.8-4.7x faster than torch's ops here (bench/decode_ops.py)."""
    return _compiled_timing(policy)["ops"]


def _compiled_timing(policy: Transformer) -> dict:
    """Times this policy's forwards (decode steps of 1, 8 and 32 rows, a 17-token verify forward of one row;
    medians of 6 interleaved forwards each) on torch's kernels, with the compiled norms, RoPE and cached
    attention ("ops"), and with those and the compiled products too. The ops pay where they make the forwards 3%
    faster, as the geometric mean over the sizes: they save a per-forward cost (dispatching tensor ops), so
    every size counts alike, and they run the same arithmetic in fewer calls, so the bar is lower than the
    products'. The products pay ("pays") where they make the forwards 5% faster again, over the sum of the
    times (against torch's norms and RoPE where those did not pay). Kept apart because they pay apart: on
    a CPU with AVX512 the products ran 0.7-0.8x of oneDNN's while the norms and RoPE made a one-row step
    1.1x faster. Nothing pays off a CPU, for other dtypes, or where the kernels cannot be built. Measured
    once per machine, model, dtype and kernels, and cached."""
    w = policy.lm_head.weight
    if w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu":
        return {"pays": False, "ops": False}
    path = measurement_path("native", str(w.dtype), policy.args.__dict__,
                            {"sizes": NATIVE_SIZES, "packed": policy.lm_head.packed,
                             "weight_major": policy.lm_head.weight_major, "rows": (native.MIN_ROWS, native.MAX_ROWS),
                             "half_rows": native.HALF_ROWS, "source": native.digest(), "ops_tokens": native.OPS_TOKENS,
                             "decisions": ["pays: 5% over the sum", "ops: 3% geometric mean"]})
    if path.exists():
        return json.loads(path.read_text())
    if not native.available():
        return {"pays": False, "ops": False}
    print(f"sparkrl: timing the compiled kernels in {str(w.dtype).removeprefix('torch.')} on this machine "
          "(once; cached)", file=sys.stderr, flush=True)
    systems = {"torch": (False, False), "ops": (False, True), "all": (True, True)}  # (products, ops)
    times = {name: {str(size): [] for size in NATIVE_SIZES} for name in systems}
    with kernels_restored(policy):
        for _ in range(2):  # interleaved: drift hits all three alike
            for rows, tokens in NATIVE_SIZES:
                for name, (products, ops) in systems.items():
                    use_native(policy, products, ops)
                    times[name][str((rows, tokens))] += _step_seconds(policy, rows=rows, tokens=tokens, reps=3)
    med = {name: {size: statistics.median(t) for size, t in by_size.items()} for name, by_size in times.items()}
    ops_speedup = statistics.geometric_mean([med["torch"][k] / med["ops"][k] for k in med["torch"]])
    ops = ops_speedup > 1.03
    total = {name: sum(by_size.values()) for name, by_size in med.items()}
    base = "ops" if ops else "torch"
    result = {"pays": total[base] / total["all"] > 1.05, "ops": ops, "speedup": total[base] / total["all"],
              "ops_speedup": ops_speedup, "seconds": times}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def use_native(module: torch.nn.Module, on: bool = True, ops: bool | None = None) -> torch.nn.Module:
    """Run `module`'s no-grad CPU forwards on the compiled kernels where they serve (where they are
    available) or on torch's: every `Linear`'s products that `native.serves` (on; their `native` flag), and
    every `RMSNorm` and `Attention`'s RoPE and cached attention (ops, the same as on unless given; their `native`
    flags), and with those a `Transformer`'s sampling (`Transformer.compiled_ops`)."""
    on = bool(on) and native.available()
    ops = (on if ops is None else bool(ops)) and native.available()
    for m in module.modules():
        if isinstance(m, Linear):
            m.native = on
            if not on:
                m._pairs = None  # the compiled product's repacked weight
        elif isinstance(m, (RMSNorm, Attention)):
            m.native = ops
    return module


def native_choice(choice: str) -> bool | None:
    """`RolloutCopy`'s native for --cpu-kernels `choice`: measured (None) under auto, else off (plain,
    packed and weight-major name the BLAS kernels they run)."""
    return None if choice == "auto" else False


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


def float32_attention_choice(choice: str) -> bool | None:
    """`RolloutCopy`'s attention32 for --cpu-kernels `choice`: measured (None), except under plain, the
    reference, which attends in the rollout dtype."""
    return False if choice == "plain" else None


def use_float32_attention(module: torch.nn.Module, on: bool = True) -> torch.nn.Module:
    """Run every `Attention` of `module` in float32 with a float32 KV cache (on: queries, keys and values
    cast up, outputs cast back), or in its inputs' dtype; caches made before keep their dtype."""
    for m in module.modules():
        if isinstance(m, Attention):
            m.attn_dtype = torch.float32 if on else None
    return module


def weight_major_choice(choice: str) -> bool | None:
    """`RolloutCopy`'s weight_major for --cpu-kernels `choice`: measured on the copy (None) under auto;
    on under weight-major; off under plain (`F.linear` everywhere, the reference) and packed."""
    return None if choice == "auto" else choice == "weight-major"


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
    """--cpu-kernels `choice` for a rollout copy of `policy` in `dtype`: packed; plain or weight-major
    (unpacked); or auto (packed where it can be and a measurement on this machine finds it faster; in
    float32, of this policy)."""
    device = policy.lm_head.weight.device
    if choice in ("plain", "weight-major"):
        return False
    if choice == "packed":
        return packable(dtype, device)
    return packing_pays(dtype, device, policy)


def rollout_copy(module: torch.nn.Module, dtype: torch.dtype, cpu_kernels: str = "auto", head_float32: bool = False,
                 separate: bool = False) -> "RolloutCopy":
    """`module`'s `RolloutCopy` in `dtype` as --cpu-kernels `cpu_kernels` runs it: prepacked weights,
    weight-major products, the compiled kernels (`sparkrl.native`) and float32 attention each on,
    off, or measured (auto)."""
    return RolloutCopy(module, dtype, separate=separate, packed=use_packed(cpu_kernels, dtype, module),
                       head_float32=head_float32, weight_major=weight_major_choice(cpu_kernels),
                       attention32=float32_attention_choice(cpu_kernels), native=native_choice(cpu_kernels),
                       ops=native_choice(cpu_kernels))


class RolloutCopy:
    """`module` (a policy or a drafter) as the rollout runs it: the module itself when the dtypes agree
    (unless `separate`), else a copy in `dtype` that `refresh()` overwrites in place from the master
    weights. separate: always a copy, made before the master is sharded (`sharding.FullyShard`), whose
    refresh gathers each sharded parameter in turn (every rank calls it)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, separate: bool = False, packed: bool = False,
                 head_float32: bool = False, weight_major: bool | None = None, attention32: bool | None = None,
                 native: bool | None = False, ops: bool | None = False):
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
        if weight_major is None:  # measured on a policy's decode step (a drafter follows its policy)
            weight_major = isinstance(self.model, Transformer) and weight_major_pays(self.model)
        use_weight_major(self.model, weight_major)
        if native is None:  # measured on a policy's forwards (a drafter follows its policy)
            native = isinstance(self.model, Transformer) and native_pays(self.model)
        if ops is None:
            ops = isinstance(self.model, Transformer) and compiled_ops_pay(self.model)
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
