"""Drafter training: pretraining before GRPO and online training after every rollout.

Each drafter kind brings its loss (`drafter.loss`); this module holds the EAGLE3-style one and the
training loops (DFlash-style: `drafters/dflash.block_loss`).

EAGLE3-style objective (paper appendix A, FastGRPO): 2 * SmoothL1(feature) + 0.1 * softCE(target distribution).
Drafter position i reads token i+1 and the policy's fused features at i, and predicts token i+2; its
pre-norm output is regressed on the policy's final normed hidden state at i+1, and its distribution
(over the draft vocabulary) is pulled towards the policy's distribution at i+1 by soft cross-entropy.

Features come from a policy forward over whole sequences (prompt + response): in pretraining a
no-grad forward, online the forward that the GRPO policy update runs anyway (`DraftTrainer.observe`
is called with its detached taps before the policy's optimizer step, so the drafter learns the
rollout policy's features with no extra policy forward).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

FEATURE_WEIGHT, CE_WEIGHT = 2.0, 0.1


def unrolled_mask(n: int, steps: int, device) -> torch.Tensor:
    """(1, 1, steps*n, steps*n) attention among `steps` segments of n positions: segment 1 is causal;
    position j of segment s (a depth s-1 tree node drafted from position j) sees segment 1 up to j
    (the committed prefix) and position j of segments 2..s (its ancestors and itself)."""
    j = torch.arange(n, device=device)
    seg = torch.arange(steps, device=device)
    qs, qj = seg.repeat_interleave(n), j.repeat(steps)  # segment and position of every row
    prefix = (qs[None, :] == 0) & (qj[None, :] <= qj[:, None])
    chain = (qs[None, :] > 0) & (qs[None, :] <= qs[:, None]) & (qj[None, :] == qj[:, None])
    return (prefix | chain)[None, None]


def unrolled(drafter, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list:
    """Drafter outputs of segments 1..steps (see `draft_loss`), each (a, z) over n = T - 1 positions.

    tokens (B, T) padded on the right by `steps` extra positions; feats (B, n, d) policy features."""
    B, n = feats.shape[:2]
    j = torch.arange(n, device=tokens.device)
    seg_tokens, seg_feats, seg_depth, outs = [], [], [], []
    for s in range(1, steps + 1):
        seg_tokens.append(tokens[:, s:s + n])
        seg_feats.append(feats if s == 1 else outs[-1][0])
        seg_depth.append(j + s - 1)
        step = drafter(torch.cat(seg_tokens, 1), torch.cat(seg_feats, 1),
                       depth=torch.cat(seg_depth).expand(B, -1), mask=unrolled_mask(n, s, tokens.device))
        outs.append((step.a[:, -n:], step.z[:, -n:]))
    return outs


def draft_loss(drafter, tokens: torch.Tensor, taps: dict[int, torch.Tensor], hidden: torch.Tensor,
               target_logits: torch.Tensor, mask: torch.Tensor, steps: int = 3) -> tuple[torch.Tensor, dict]:
    """tokens (B, T); taps: policy layer outputs (B, T, d); hidden (B, T, d) policy final normed
    hidden; target_logits (B, T, V) policy logits; mask (B, T): position t is trained to predict
    token t + 2 from token t + 1 (targets at t + 1).

    Training-time test (EAGLE-3): besides the teacher-forced step, `steps - 1` unrolled steps feed
    the drafter its own previous output as the feature, as at tree depth >= 2 (segment s, position j:
    token j + s, feature = segment s-1's output at j, targets at j + s, RoPE position j + s - 1).
    Returns (loss averaged over steps and trained positions, stats; top1_s per segment).
    """
    B, T = tokens.shape
    n = T - 1
    K = max(1, min(steps, n))
    pad = lambda t: torch.cat([t, t[:, -1:].expand(-1, K, *t.shape[2:])], 1)
    target = torch.softmax(target_logits.float(), -1)[..., drafter.vocab_ids]  # (B, T, Vd), once
    toks_p, hid_p, p_p, m_p = pad(tokens), pad(hidden.detach()), pad(target), pad(mask)
    feats = drafter.features({i: t[:, :-1] for i, t in taps.items()})  # (B, n, d) features at 0..n-1
    j = torch.arange(n, device=tokens.device)
    total, stats = 0.0, {}
    for s, (a, z) in enumerate(unrolled(drafter, toks_p, feats, K), start=1):
        m = (m_p[:, s - 1:s - 1 + n] & (j + s <= T - 1)).to(hidden.dtype)  # (B, n)
        cnt = m.sum().clamp(min=1)
        feat = F.smooth_l1_loss(a, hid_p[:, s:s + n], reduction="none").mean(-1)  # (B, n)
        p = p_p[:, s:s + n]  # (B, n, Vd) the policy's distribution on the draft vocabulary
        ce = -(p * torch.log_softmax(z, -1)).sum(-1)
        total = total + ((FEATURE_WEIGHT * feat + CE_WEIGHT * ce) * m).sum() / cnt
        with torch.no_grad():
            top1 = float(((z.argmax(-1) == p.argmax(-1)).float() * m).sum() / cnt)
            stats[f"top1_{s}"] = top1
            if s == 1:
                stats.update(feat=float((feat.detach() * m).sum() / cnt), ce=float((ce.detach() * m).sum() / cnt),
                             top1=top1, positions=float(cnt))
    return total / K, stats


class DraftTrainer:
    """The drafter's optimizer and its online updates (one AdamW step per rollout)."""

    def __init__(self, drafter, lr: float = 1e-4, max_grad_norm: float = 1.0, projection=None,
                 projection_lr: float = 1e-4, learn_projection: bool = True):
        """projection: SPARK's `spark.Projection` (saved with the drafter; learned in its own parameter
        group from the gradient the rollout accumulated, unless learn_projection is False)."""
        self.drafter = drafter
        self.projection = projection
        groups = [{"params": list(drafter.parameters())}]
        if projection is not None and learn_projection:
            groups.append({"params": [projection.A], "lr": projection_lr})
        self.opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.seconds = 0.0
        self._stats: list[dict] = []

    def observe(self, tokens, taps, hidden, logits, mask, weight: float) -> None:
        """Accumulate the gradient of one micro-batch (weight: its share of the batch's positions)."""
        t0 = time.perf_counter()
        with torch.enable_grad():
            loss, st = self.drafter.loss(tokens, {i: t.detach() for i, t in taps.items()}, hidden.detach(),
                                         logits.detach(), mask)
            (loss * weight).backward()
        self._stats.append(st)
        self.seconds += time.perf_counter() - t0

    def step(self, grad_A: torch.Tensor | None = None) -> dict:
        """Apply the accumulated gradient (and SPARK's A gradient from the rollout, if any); returns
        averaged stats and the time spent since the last step."""
        t0 = time.perf_counter()
        if grad_A is not None and self.projection is not None:
            self.projection.A.grad = grad_A.to(self.projection.A)
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.seconds += time.perf_counter() - t0
        n = sum(s["positions"] for s in self._stats) or 1.0
        out = {f"draft_{k}": sum(s[k] * s["positions"] for s in self._stats) / n for k in ("feat", "ce", "top1")}
        out["draft_train_s"] = self.seconds
        self._stats, self.seconds = [], 0.0
        return out

    def state_dict(self) -> dict:
        ck = self.drafter.checkpoint()
        if self.projection is not None:
            ck["spark"] = self.projection.checkpoint()
        return {"drafter": ck, "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"]["state"])
        if self.projection is not None:
            self.projection.load(state["drafter"]["spark"], "the checkpoint")
        self.opt.load_state_dict(state["optimizer"])


# --- pretraining ------------------------------------------------------------------------------

CHAT_PROMPTS = [
    "Explain how a rainbow forms.", "Write a short poem about the sea.", "What are three tips for studying well?",
    "Describe your ideal weekend.", "How does a bicycle stay upright?", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "Summarize the plot of a fairy tale you like.", "What is photosynthesis?",
    "How do I write a polite email to a teacher?", "List some fun facts about octopuses.",
    "Explain what a computer program is to a child.", "What should I pack for a camping trip?",
    "How do vaccines work?", "Tell me a short story about a brave mouse.", "What is the difference between weather and climate?",
]


def _corpus_from_file(path: str, tokenizer, max_tokens: int) -> list[list[int]]:
    import json
    from pathlib import Path

    from sparkrl.errors import UserError

    p = Path(path)
    if not p.exists():
        raise UserError(f"--corpus {p} does not exist")
    docs = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        text = json.loads(line).get("text", "") if p.suffix == ".jsonl" else line
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 4:
            docs.append(ids)
    if not docs:
        raise UserError(f"--corpus {p} has no usable text (.txt: one document per line; .jsonl: a 'text' field)")
    return docs


def draft_vocabulary(counts, size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """`size` token ids: `always` (EOS), then the most frequent in `counts`, then (for a corpus with
    fewer distinct tokens) the lowest unused ids; sorted."""
    vocab = list(dict.fromkeys(always))
    vocab += [t for t, _ in counts.most_common() if t not in vocab][: max(0, size - len(vocab))]
    if len(vocab) < size:
        used = set(vocab)
        vocab += [t for t in range(vocab_size) if t not in used][: size - len(vocab)]
    return torch.tensor(sorted(vocab))


def pretrain(cfg) -> dict:
    """`sparkrl pretrain-draft`: make a corpus with the policy, pick the draft vocabulary, train."""
    import json
    import random
    import sys
    from collections import Counter
    from pathlib import Path

    from tqdm import tqdm

    from sparkrl.checkpoint import atomic_save
    from sparkrl.config import to_dict
    from sparkrl.data import INSTRUCTION, chat_prompt_ids, load_problems
    from sparkrl.drafters import KINDS
    from sparkrl.rollout import generate, response_generators
    from sparkrl.weights import load_model

    out = Path(cfg.out)
    problems = load_problems(cfg.data.data, cfg.data.default_size, cfg.seed).problems
    lm = load_model(cfg.model.model, cfg.model.device, cfg.model.dtype)
    policy, tok = lm.model, lm.tokenizer
    extra = _corpus_from_file(cfg.corpus, tok, cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens) if cfg.corpus else []
    rng = random.Random(cfg.seed)
    n_math = cfg.prompts - cfg.prompts // 4
    texts = [f"{p.question}\n\n{INSTRUCTION}" for p in rng.sample(problems, min(n_math, len(problems)))]
    texts += [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(cfg.prompts - len(texts))]
    prompts = [chat_prompt_ids(tok, t)[: cfg.data.max_prompt_tokens] for t in texts]
    seqs = []
    bar = tqdm(total=len(prompts), desc="corpus", unit="prompt", file=sys.stderr)
    for i in range(0, len(prompts), 64):
        chunk = prompts[i:i + 64]
        r = generate(policy, chunk, cfg.sampling, lm.eos_ids, response_generators(cfg.seed, len(chunk), 1, offset=i))
        seqs += [p + t for p, t in zip(chunk, r.tokens)]
        bar.update(len(chunk))
    bar.close()
    seqs += extra
    counts = Counter(t for s in seqs for t in s)
    V = policy.args.vocab_size
    vocab_ids = draft_vocabulary(counts, cfg.draft_vocab, V, lm.eos_ids) if 0 < cfg.draft_vocab < V else None
    torch.manual_seed(cfg.seed)
    w = policy.lm_head.weight
    settings = {"block_size": cfg.block_size} if cfg.draft == "dflash" else {}
    drafter = KINDS[cfg.draft](policy.args, vocab_ids=vocab_ids, **settings).to(device=w.device, dtype=w.dtype)
    drafter.bind(policy)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"config": to_dict(cfg), "corpus_sequences": len(seqs),
                                                 "corpus_tokens": sum(map(len, seqs))}, indent=2))
    log = open(out / "pretrain.jsonl", "w")
    taps = tuple(drafter.feature_layers)
    steps = cfg.epochs * ((len(seqs) + cfg.micro_batch - 1) // cfg.micro_batch)
    bar = tqdm(total=steps, desc="pretrain-draft", unit="step", file=sys.stderr)
    order = list(range(len(seqs)))
    for epoch in range(cfg.epochs):
        rng.shuffle(order)
        for i in range(0, len(order), cfg.micro_batch):
            mb = [seqs[j] for j in order[i:i + cfg.micro_batch]]
            L = max(map(len, mb))
            toks = torch.zeros(len(mb), L, dtype=torch.long)
            mask = torch.zeros(len(mb), L, dtype=torch.bool)
            for j, s in enumerate(mb):
                toks[j, :len(s)] = torch.tensor(s)
                mask[j, :len(s) - 2] = True  # position t needs tokens t+1 and t+2
            toks, mask = toks.to(w.device), mask.to(w.device)
            with torch.no_grad():
                o = policy(toks, taps=taps)
                logits = policy.logits(o.hidden)
            loss, st = drafter.loss(toks, o.taps, o.hidden, logits, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            log.write(json.dumps({"epoch": epoch, "loss": loss.item(), **st}) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{st['top1']:.2f}")
    bar.close()
    log.close()
    atomic_save(drafter.checkpoint(), out / "drafter.pt")
    return {"out": str(out), "sequences": len(seqs), "tokens": sum(map(len, seqs)),
            "draft_vocab": int(drafter.vocab_ids.numel()), "last_top1": st["top1"]}
