"""The policy pass of draft pretraining, and each sequence's result kept on disk for the next read.

A micro-batch of corpus sequences becomes what `DraftTrainer` learns from: the padded tokens, the
policy's taps (the drafter's input features) and final hidden states, the logits made from them (the
targets) and the trainable mask. With a `FeatureStore` the taps and hidden states of every sequence
are written once, unpadded and in the policy pass's dtype, and read back instead of running the
policy again: by later epochs and by every held-out score (the policy pass is about half of a
pretraining step). Only the LM head runs again, so nothing the size of the vocabulary is stored.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from sparkrl.errors import UserError
from sparkrl.model.transformer import pad_right
from sparkrl.train.checkpoint import atomic_save

SHAPE_STEP = 64


def positions(seqs, device, answers_only: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, trainable mask) of sequences with `.ids` and `.start` (`corpus.Seq`): right-padded to a
    multiple of SHAPE_STEP; the mask runs from the last prompt position on (every position with
    answers_only False), never over padding, and stops 2 before the end (t needs t+1 and t+2)."""
    toks, lens = pad_right([s.ids for s in seqs], device)
    # lengths padded to a multiple of SHAPE_STEP: a few shapes recur, so oneDNN's kernels for them are
    # made once (a new shape every batch makes steps ~2x slower)
    toks = F.pad(toks, (0, -toks.shape[1] % SHAPE_STEP))
    t = torch.arange(toks.shape[1], device=device)
    first = torch.tensor([max(s.start - 1, 0) if answers_only else 0 for s in seqs], device=device)
    return toks, (t >= first[:, None]) & (t < (lens - 2)[:, None])


def policy_pass(policy, seqs, taps, answers_only: bool = True, store: FeatureStore | None = None):
    """(tokens, {layer: taps}, final hidden states, float32 logits, trainable mask) of a micro-batch, no
    grad. With a store, every sequence's taps and hidden states come from it (computed and written
    first where missing), zero over padding, so a batch is the same whichever of its sequences were
    read and whichever were computed."""
    toks, mask = positions(seqs, policy.lm_head.weight.device, answers_only)
    with torch.no_grad():
        if store is None:
            o = policy(toks, taps=taps)
            return toks, o.taps, o.hidden, policy.logits(o.hidden), mask
        rows = store.rows(policy, seqs, toks, taps)
        T = toks.shape[1]

        def stack(parts):
            return torch.stack([F.pad(p, (0, 0, 0, T - p.shape[0])) for p in parts])

        hidden = stack([r["hidden"] for r in rows])
        return toks, {i: stack([r["taps"][i] for r in rows]) for i in taps}, hidden, policy.logits(hidden), mask


class FeatureStore:
    """One file per sequence in `folder`, named by a hash of its tokens, the feature layers and `tag`
    (what else decides the features: the policy and its dtype and kernels), so a file is only read
    for the same work; written atomically, so a run killed at any point resumes with the files it made."""

    def __init__(self, folder: Path, tag: str):
        self.folder, self.tag = Path(folder), tag
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, ids: list[int], taps) -> Path:
        key = json.dumps([ids, sorted(taps), self.tag])
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"

    def rows(self, policy, seqs, toks: torch.Tensor, taps) -> list[dict]:
        """{'taps': {layer: (n, d)}, 'hidden': (n, d)} of each sequence (n its length); runs the policy on
        the whole batch `toks` when any is missing and writes the missing ones."""
        paths = [self.path(s.ids, taps) for s in seqs]
        fresh = {}
        if not all(p.exists() for p in paths):
            o = policy(toks, taps=taps)
            for b, (s, p) in enumerate(zip(seqs, paths)):
                if not p.exists():
                    n = len(s.ids)
                    fresh[p] = {"taps": {i: o.taps[i][b, :n].clone() for i in taps}, "hidden": o.hidden[b, :n].clone()}
                    atomic_save(fresh[p], p)
        return [fresh[p] if p in fresh else torch.load(p, map_location=toks.device) for p in paths]

    def check_space(self, tokens: int, width: int, dtype: torch.dtype) -> None:
        """Refuses, before any training, a store of `tokens` x `width` values of `dtype` that would not fit
        on the disk (what the folder already holds counts as written; 10% and 1 GB margin)."""
        need = tokens * width * torch.finfo(dtype).bits // 8 - sum(p.stat().st_size for p in self.folder.glob("*.pt"))
        free = shutil.disk_usage(self.folder).free
        if need * 1.1 + 2**30 > free:
            raise UserError(
                f"the policy features of {tokens:,} tokens need about {need / 2**30:.1f} GB more in "
                f"{self.folder}, which has {free / 2**30:.1f} GB free: free some space, or pass "
                "--no-feature-cache (the policy pass then runs again every epoch)"
            )
