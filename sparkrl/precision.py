"""Rollouts in the rollout dtype, training with the master weights (DESIGN "Precision").

The policy's master weights (--dtype; float32 on a CPU) are what the optimizer steps. Rollouts run on
a copy in the rollout dtype (`RolloutCopy`, refreshed in place after every update, no reallocation);
so does the drafter. `--rollout-dtype auto` picks bfloat16 on CUDA, and on a CPU when a start-up
measurement of this policy's decode step says bfloat16 is faster there (cached per machine, model and
thread count, like the cost model), float32 otherwise. A half-precision copy on a CPU runs its linear
layers on prepacked oneDNN weights (`kernels.Linear`) where a one-off measurement finds them faster
(`packing_pays`; --cpu-kernels). Exactness is relative to the rollout model;
the gap to the master weights is measured every step (`mismatch`) and can be corrected with
truncated importance sampling (`grpo.grpo_loss`, --tis-cap).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch

from sparkrl.kernels import Linear, pack, packable
from sparkrl.model import Transformer
from sparkrl.machine import measurement_path
from sparkrl.sharding import full

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _step_seconds(model: Transformer, rows: int = 8, context: int = 128, reps: int = 5) -> list[float]:
    dev = model.lm_head.weight.device
    g = torch.Generator(device=dev).manual_seed(0)
    cache = model.new_cache(rows, context + 2)
    cache.lengths += context
    tok = torch.randint(0, model.args.vocab_size, (rows, 1), device=dev, generator=g)
    zeros = torch.zeros(rows, dtype=torch.long, device=dev)
    out = []
    with torch.no_grad():
        for _ in range(reps + 1):
            t = time.perf_counter()
            model.logits(model(tok, cache).hidden[:, -1])
            cache.commit(n_keep=zeros)
            out.append(time.perf_counter() - t)
    return out[1:]


def bf16_speedup(policy: Transformer) -> float:
    """float32 / bfloat16 seconds of this policy's decode step (8 rows) on this machine, measured once
    and cached; bfloat16 on prepacked weights where they pay (`packing_pays`)."""
    dev = policy.lm_head.weight.device
    packed = packing_pays(torch.bfloat16, dev)
    path = measurement_path("dtype", str(dev), policy.args.__dict__, {"packed": packed})
    if path.exists():
        return json.loads(path.read_text())["speedup"]
    print("sparkrl: timing float32 against bfloat16 decode steps on this machine (once; cached)", file=sys.stderr,
          flush=True)
    models = {dt: pack(copy.deepcopy(policy).to(DTYPES[dt]), packed) for dt in DTYPES}  # float32 never packs
    times = {dt: [] for dt in DTYPES}
    for _ in range(2):  # interleaved: drift hits both alike
        for dt, m in models.items():
            times[dt] += _step_seconds(m)
    speedup = statistics.median(times["float32"]) / statistics.median(times["bfloat16"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"speedup": speedup, "seconds": times}))
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


def _seconds(layer: Linear, x: torch.Tensor, reps: int) -> float:
    with torch.no_grad():
        layer(x)
        t = time.perf_counter()
        for _ in range(reps):
            layer(x)
    return (time.perf_counter() - t) / reps


def packing_pays(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether prepacked weights make a decode-sized product (1 and 16 rows, 1024 x 2048) faster than
    plain `F.linear` in `dtype` on this machine: measured once (interleaved, medians) and cached."""
    if not packable(dtype, device):
        return False
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


def use_packed(choice: str, dtype: torch.dtype, device: torch.device | str) -> bool:
    """--cpu-kernels `choice` for a rollout model in `dtype` on `device`: packed, plain, or auto (packed
    where it can be and a measurement on this machine finds it faster)."""
    if choice == "plain":
        return False
    if choice == "packed":
        return packable(dtype, device)
    return packing_pays(dtype, device)


class RolloutCopy:
    """`module` (a policy or a drafter) as the rollout runs it: the module itself when the dtypes agree
    (unless `separate`), else a copy in `dtype` that `refresh()` overwrites in place from the master
    weights. separate: always a copy, made before the master is sharded (`sharding.FullyShard`), whose
    refresh gathers each sharded parameter in turn (every rank calls it)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, separate: bool = False, packed: bool = False,
                 head_float32: bool = False):
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
