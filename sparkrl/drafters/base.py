"""What every drafter shares: the policy's embedding and (reduced) output head, the fused policy
features, the `DraftStep` and `DraftState` records, and checkpoints checked against the policy they
serve.

A drafter kind owns its model, its proposals (`propose(cache, state, shape, nodes, temperature, u,
correct) -> drafters.tree.Proposal`) and its loss (`loss(tokens, taps, hidden, target_logits, mask,
generator, held_out)`; held_out: the held-out scores' form of it).
The engine also needs `bind(policy)`, `features(taps)`, `feature_layers`, `prefill(...)`,
`forward(tokens, feats, cache, tree_mask=, depth=, head=) -> DraftStep` (its catch-up over committed
positions; head=False: without the logits), `root_logits` (whether a round drafts from the logits at
the root, computed by the catch-up at the last position only), `new_cache(batch, capacity)`,
`logits(h)` and `vocab_ids`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from sparkrl.drafters.eagle3_format import is_eagle3_folder, read_eagle3
from sparkrl.engine.seams import DraftModel
from sparkrl.errors import UserError
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import Linear, ModelArgs, dense
from sparkrl.model.weights import save_tensors


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle, high policy layers (EAGLE-3 uses 2, L/2, L-3)."""
    top = num_layers - 1
    return (min(2, top), num_layers // 2, max(num_layers - 3, 0))


class SharedHeadDrafter(nn.Module, DraftModel):
    """Base of the drafters: `stack` (a `model.Stack`), `fc` (fused policy features -> d), the draft
    vocabulary `vocab_ids`, and the policy's embedding and head, shared (not trained here)."""

    kind = ""
    root_logits = True  # a round's first draft level comes from the logits at the root (trees, chains)

    def __init__(
        self,
        policy_args: ModelArgs,
        feature_layers: tuple[int, ...] | None = None,
        vocab_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        d = policy_args.hidden_size
        self.policy_args = policy_args
        self.feature_layers = tuple(feature_layers or default_feature_layers(policy_args.num_layers))
        self.fc = Linear(len(self.feature_layers) * d, d, bias=False)
        ids = torch.arange(policy_args.vocab_size) if vocab_ids is None else vocab_ids.long().clone()  # own memory
        self.register_buffer("vocab_ids", ids)  # (Vd,) draft vocabulary -> policy token ids
        self._shared = ()  # (policy embedding,): a tuple, so it is not a submodule of the drafter
        self._head = None

    def bind(self, policy) -> "SharedHeadDrafter":
        """Share the policy's embedding and (reduced) output head; call after every policy update."""
        self._shared = (policy.model.embed_tokens,)
        # (Vd, d) rows of the policy's head, run as the policy's head runs; a tuple, so it is not a submodule
        self._head = (policy.lm_head.sibling(policy.lm_head.weight.detach()[self.vocab_ids].contiguous()),)
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._shared[0](tokens)

    def features(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """Policy hidden states of the feature layers -> (B, T, d) fused feature."""
        return self.fc(torch.cat([taps[i] for i in self.feature_layers], dim=-1))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        if h.dtype != head.weight.dtype:  # e.g. a bfloat16-autocast forward against float32 master weights
            return F.linear(dense(h), head.weight.to(h.dtype)).float()
        return head(h).float()

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        w = self.fc.weight
        return self.stack.new_cache(batch, capacity, w.device, w.dtype)

    # --- checkpoints ----------------------------------------------------------------------------

    def signature(self) -> dict:
        a = self.policy_args
        return {"arch": a.arch, "hidden_size": a.hidden_size, "vocab_size": a.vocab_size, "num_layers": a.num_layers}

    def settings(self) -> dict:
        """Constructor settings saved with the checkpoint (besides the policy and the vocabulary)."""
        return {}

    def checkpoint(self) -> dict:
        return {
            "kind": self.kind,
            "policy": self.signature(),
            "feature_layers": list(self.feature_layers),
            "settings": self.settings(),
            "state": {k: v for k, v in self.state_dict().items()},
        }


def target_probs(target_logits: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The policy's probabilities (float32) of the draft vocabulary: softmax over the whole vocabulary,
    only the draft vocabulary's entries materialised."""
    lse = torch.logsumexp(target_logits.float(), -1, keepdim=True)
    return torch.exp(target_logits[..., vocab_ids].float() - lse)


def expected_length(acceptance: list[float]) -> float:
    """Expected tokens per round of one drafted path whose depth d is accepted with probability acceptance[d - 1]
    (independently, as an estimate): 1 + a_1 + a_1 a_2 + ... (the 1: the policy's token). With a tree level's
    best children's acceptance along the path, an EAGLE3-style tree's estimate (`pretrain.evaluate`)."""
    total, alive = 1.0, 1.0
    for a in acceptance:
        alive *= a
        total += alive
    return total


def policy_fingerprint(policy) -> list[float]:
    """Statistics of the policy's embedding (float64): tell two checkpoints of one architecture apart,
    equal within bfloat16 rounding for the same weights in another dtype (`same_policy`)."""
    w = policy.model.embed_tokens.weight.detach()[:1024].double()
    return [float(w.abs().mean()), float(w.mean()), float(w.std()), float(w[:, 0].abs().mean())]


def same_policy(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-2 * max(abs(x), abs(y)) + 1e-6 for x, y in zip(a, b))


def save_safetensors(
    ck: dict, path: Path, dtype: torch.dtype = torch.bfloat16, fingerprint: list[float] | None = None
) -> None:
    """A drafter checkpoint as a weights-only safetensors file (floating tensors in `dtype`; what the
    policy shares, its embedding and head, is not stored), its description and the policy's
    `policy_fingerprint` in the metadata. Atomic."""
    meta = {k: ck[k] for k in ("kind", "policy", "feature_layers", "settings")}
    if fingerprint is not None:
        meta["fingerprint"] = fingerprint
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in ck["state"].items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    save_tensors(tensors, tmp, metadata={"sparkrl_drafter": json.dumps(meta)})
    tmp.chmod(0o644)  # readable like any other file of a package
    tmp.replace(path)


def _read_safetensors(p: Path, tensors: bool = True) -> dict:
    try:
        f = safe_open(str(p), framework="pt")
    except Exception as e:
        raise UserError(
            f"--draft-checkpoint {p} is not a readable safetensors file ({str(e).splitlines()[0]}); "
            "make one with `sparkrl pretrain-draft`"
        ) from None
    with f:
        meta = (f.metadata() or {}).get("sparkrl_drafter")
        if meta is None:
            raise UserError(
                f"--draft-checkpoint {p} is a safetensors file without sparkrl's drafter metadata; "
                "make one with `sparkrl pretrain-draft`"
            )
        return {**json.loads(meta), "state": {k: f.get_tensor(k) for k in f.keys()} if tensors else {}}


def read_description(path: Path) -> dict:
    """The metadata of a drafter safetensors file (kind, policy, fingerprint, ...), without its tensors."""
    return _read_safetensors(path, tensors=False)


def read_checkpoint(path: str | Path | dict) -> dict:
    """The drafter entry of a file (a `pretrain-draft` drafter.pt or drafter.safetensors, or a GRPO
    checkpoint's state file: `train.checkpoint.drafter_source` finds it in a run's folder), or of a dict."""
    if isinstance(path, dict):
        ck = path
    elif Path(path).suffix == ".safetensors" and Path(path).is_file():
        ck = _read_safetensors(Path(path))
    elif is_eagle3_folder(Path(path)):  # a published EAGLE-3 checkpoint (vLLM's or speculators' format)
        ck = read_eagle3(Path(path))
    else:
        p = Path(path)
        if not p.exists():
            raise UserError(f"--draft-checkpoint {p} does not exist")
        if p.is_dir() and (p / "drafter.pt").is_file():  # a `pretrain-draft` drafter folder (OUT/KIND)
            p = p / "drafter.pt"
        if p.is_dir():
            raise UserError(
                f"--draft-checkpoint {p} is a folder with no drafter; pass a drafter.pt, a run's "
                "checkpoints/step-N folder, or a run folder"
            )
        try:  # mmap: of a GRPO checkpoint only the drafter's tensors are read
            ck = torch.load(p, map_location="cpu", weights_only=False, mmap=True)
        except Exception as e:
            raise UserError(
                f"--draft-checkpoint {p} is not a readable checkpoint ({type(e).__name__}); "
                "make one with `sparkrl pretrain-draft`"
            ) from None
    if isinstance(ck, dict) and "kind" not in ck and isinstance(ck.get("draft"), dict):
        ck = ck["draft"].get("drafter")  # a training checkpoint: its drafter
    if not isinstance(ck, dict) or not {"kind", "state", "policy", "feature_layers"} <= set(ck):
        raise UserError(f"{path} is not a sparkrl drafter checkpoint; make one with `sparkrl pretrain-draft`")
    return ck
