"""`sparkrl pretrain-draft`: a drafter trained before GRPO on the policy's own distributions.

The corpus (made once, in `--out/corpus/`, reused on resume): worked solutions of the --data problems
as the assistant turn after the GRPO prompt, responses the policy samples (rollout settings, rollout
dtype) to math problems and chat prompts, and an optional local text corpus. A share of the problems
is held out by a hash of the question (`data.held_out`) and never enters it; held-out sequences are
scored every --eval-every steps. The draft vocabulary is the corpus's most frequent tokens.

Training runs the policy once per micro-batch (no grad, rollout dtype) for its features and target
distributions (`features.policy_pass`; kept on disk and read back by later epochs and held-out scores)
and steps the drafter with the same `DraftTrainer` as online training, under a warm-up + cosine
learning-rate schedule. Micro-batches group sequences of similar length. `state.pt` (drafter,
optimizer, step, training seconds, which each record carries too) is written atomically every
--checkpoint-every steps; `--resume` continues exactly where it was written (the batch plan is a
function of the seed).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from sparkrl.config import PretrainConfig, to_dict
from sparkrl.drafters import KINDS, find_checkpoint, load_drafter
from sparkrl.drafters.base import expected_length, policy_fingerprint, save_safetensors
from sparkrl.drafters.eagle3 import relayout
from sparkrl.engine.rollout import generate, response_generators
from sparkrl.errors import UserError
from sparkrl.machine import set_threads
from sparkrl.model.weights import load_model
from sparkrl.train.checkpoint import atomic_save
from sparkrl.train.data import INSTRUCTION, Problem, chat_prompt_ids, held_out, load_problems
from sparkrl.train.draft_train import DraftTrainer
from sparkrl.train.features import FeatureStore, policy_pass
from sparkrl.train.precision import RolloutCopy, rollout_copy, rollout_dtype

CHAT_PROMPTS = [
    "Explain how a rainbow forms.",
    "Write a short poem about the sea.",
    "What are three tips for studying well?",
    "Describe your ideal weekend.",
    "How does a bicycle stay upright?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of a fairy tale you like.",
    "What is photosynthesis?",
    "How do I write a polite email to a teacher?",
    "List some fun facts about octopuses.",
    "Explain what a computer program is to a child.",
    "What should I pack for a camping trip?",
    "How do vaccines work?",
    "Tell me a short story about a brave mouse.",
    "What is the difference between weather and climate?",
]
CHUNK = 64  # prompts per generation call (and per resumable corpus file)
EVAL_SEED = 1 << 20  # response generators of held-out prompts start here


class Seq(NamedTuple):
    """A corpus sequence: token ids, and where its answer starts (0 for plain text). Held-out scores
    count the positions from the last prompt token on, the ones a rollout drafts from (as online
    training's `trainer.response_batch`); training uses them too with --train-positions response."""

    ids: list[int]
    start: int


def _corpus_from_file(path: str, tokenizer, max_tokens: int) -> list[Seq]:
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
            docs.append(Seq(ids, 0))
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


def prompt_text(p: Problem) -> str:
    return f"{p.question}\n\n{INSTRUCTION}"


def solution_ids(tok, p: Problem, eos: int, max_tokens: int) -> Seq:
    """The GRPO prompt of a problem, its worked solution as the answer, EOS (what the policy would write)."""
    prompt = chat_prompt_ids(tok, prompt_text(p))
    return Seq((prompt + tok(p.solution, add_special_tokens=False)["input_ids"] + [eos])[:max_tokens], len(prompt))


def kernel_tags(rollout: RolloutCopy) -> list[str]:
    """What of the CPU layer ran a rollout copy, in words (part of the corpus and feature caches' keys)."""
    k = rollout.kernels
    return (
        (["packed"] if k.get("packed") else [])
        + (["float32 attention"] if k.get("attention") == str(torch.float32) else [])
        + (["native"] if "native" in k else [])
        + (["compiled ops"] if "ops" in k else [])
    )


def _generated(
    rollout: RolloutCopy,
    tok,
    prompts: list[list[int]],
    cfg: PretrainConfig,
    eos_ids,
    folder: Path,
    name: str,
    offset: int,
) -> list[Seq]:
    """Responses of the policy (its rollout copy) to `prompts`, CHUNK prompts per file in `folder`, named by a
    hash of what made them: a restarted or resumed run reuses the files of the same prompts and settings."""
    policy = rollout.model
    seqs = []
    bar = tqdm(total=len(prompts), desc=f"corpus ({name})", unit="prompt", file=sys.stderr)
    for i in range(0, len(prompts), CHUNK):
        chunk = prompts[i : i + CHUNK]
        key = json.dumps(
            [chunk, to_dict(cfg.sampling), cfg.seed, offset + i, cfg.model.model, str(policy.lm_head.weight.dtype)]
            + kernel_tags(rollout)
        )
        # ^ a file is reused only for the same work
        path = folder / f"{name}-{i // CHUNK:05d}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
        if not path.exists():
            r = generate(
                policy,
                chunk,
                cfg.sampling,
                eos_ids,
                response_generators(cfg.seed, len(chunk), 1, offset=offset + i),
                sampler=rollout.sampler,
            )
            atomic_save([p + t for p, t in zip(chunk, r.tokens)], path)
        seqs += [Seq(ids, len(p)) for ids, p in zip(torch.load(path), chunk)]
        bar.update(len(chunk))
    bar.close()
    return seqs


def load_corpus_problems(cfg: PretrainConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems of every --data spec (comma-separated)."""
    problems = [
        p
        for spec in cfg.data.data.split(",")
        if spec.strip()
        for p in load_problems(spec.strip(), cfg.data.default_size, cfg.seed).problems
    ]
    train = [p for p in problems if not held_out(p, cfg.holdout)]
    test = [p for p in problems if held_out(p, cfg.holdout)]
    if cfg.prompts == 0 and not cfg.corpus and not (cfg.solutions and any(p.solution for p in train)):
        raise UserError(
            "the corpus would be empty: pass --prompts N (the policy answers N prompts), --corpus FILE, or "
            "--data with worked solutions (GSM8K, MATH with a 'solution' field)"
        )
    return train, test


def build_corpus(
    cfg: PretrainConfig, rollout: RolloutCopy, tok, eos_ids, problems: tuple[list[Problem], list[Problem]]
) -> tuple[list[Seq], list[Seq], dict]:
    """(train sequences, held-out sequences, tokens per source) from (train, held-out) problems
    (`load_corpus_problems`)."""
    folder = Path(cfg.out) / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    train_p, test_p = problems
    limit = cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens
    eos = tok.eos_token_id if tok.eos_token_id is not None else eos_ids[0]
    rng = random.Random(cfg.seed)
    sources = {}
    train, test = [], []
    if cfg.solutions:
        sols = [p for p in train_p if p.solution]
        if 0 < cfg.max_solutions < len(sols):
            sols = random.Random(cfg.seed + 1).sample(sols, cfg.max_solutions)
        train += [solution_ids(tok, p, eos, limit) for p in sols]
        sols = [p for p in test_p if p.solution]
        test += [solution_ids(tok, p, eos, limit) for p in rng.sample(sols, min(cfg.eval_sequences // 2, len(sols)))]
        sources["solutions"] = sum(len(s.ids) for s in train)
    n_chat = min(cfg.prompts // 4, 4 * len(CHAT_PROMPTS))  # a quarter, each chat prompt answered at most 4 times
    texts = [prompt_text(p) for p in rng.sample(train_p, min(cfg.prompts - n_chat, len(train_p)))]
    texts += [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(cfg.prompts - len(texts))]
    prompts = [chat_prompt_ids(tok, t)[: cfg.data.max_prompt_tokens] for t in texts]
    gen = _generated(rollout, tok, prompts, cfg, eos_ids, folder, "train", 0)
    sources["policy responses"] = sum(len(s.ids) for s in gen)
    train += gen
    k = cfg.eval_sequences - len(test)
    held = [
        chat_prompt_ids(tok, prompt_text(p))[: cfg.data.max_prompt_tokens]
        for p in rng.sample(test_p, min(k, len(test_p)))
    ]
    test += _generated(rollout, tok, held, cfg, eos_ids, folder, "heldout", EVAL_SEED)
    if cfg.corpus:
        extra = _corpus_from_file(cfg.corpus, tok, limit)
        sources["--corpus"] = sum(len(s.ids) for s in extra)
        train += extra
    return train, test, sources


def batch_plan(lengths: list[int], micro_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Micro-batches of one epoch: shuffled, grouped by length within windows of 32 micro-batches (less
    padding), in shuffled order. A function of (seed, epoch), so a resumed run replays it."""
    rng = random.Random(seed * 1009 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = 32 * micro_batch
    batches = []
    for i in range(0, len(order), window):
        w = sorted(order[i : i + window], key=lambda j: lengths[j])
        batches += [w[k : k + micro_batch] for k in range(0, len(w), micro_batch)]
    rng.shuffle(batches)
    return batches


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to floor * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(
    trainer: DraftTrainer, policy, seqs: list[Seq], micro_batch: int, store: FeatureStore | None = None
) -> dict:
    """Held-out statistics averaged over positions: per-depth top-1 agreement and acceptance, the
    expected acceptance length of a drafted chain (`drafters.base.expected_length`) and, for drafters
    that draft trees, of a tree's path (its levels' best children; what tree rounds accept)."""
    taps = tuple(trainer.drafter.feature_layers)
    g = torch.Generator(device=policy.lm_head.weight.device).manual_seed(0)  # the same blocks every time
    sums, n = Counter(), 0.0
    for i in range(0, len(seqs), micro_batch):
        with _autocast(policy):
            st = trainer.evaluate(*policy_pass(policy, seqs[i : i + micro_batch], taps, store=store), generator=g)
        w = st["positions"]
        sums.update({k: v * w for k, v in st.items() if k != "positions"})
        n += w
    out = {k: v / max(n, 1.0) for k, v in sums.items()}
    trees = {"tree_expected_length": expected_length(per_depth(out, "tree"))} if "tree_1" in out else {}
    return {**out, "positions": n, "expected_length": expected_length(per_depth(out, "acc")), **trees}


def per_depth(stats: dict, name: str) -> list[float]:
    """A figure the drafter losses report per depth (`name`_1, `name`_2, ...: acc, the acceptance probability of a
    drafted token; tree, of a tree level's best children) as a list, depth 1 first."""
    out = []
    while f"{name}_{len(out) + 1}" in stats:
        out.append(stats[f"{name}_{len(out) + 1}"])
    return out


def _autocast(policy):
    """Drafter training in the policy pass's dtype: bfloat16 autocast over float32 master weights."""
    w = policy.lm_head.weight
    return torch.autocast(w.device.type, dtype=torch.bfloat16, enabled=w.dtype == torch.bfloat16)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [r for r in records if r.get("heldout")]
    if not ev:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for kind in dict.fromkeys(r["kind"] for r in ev):
        rs = [r for r in ev if r["kind"] == kind]
        x = [r["tokens"] / 1e6 for r in rs]
        ax[0].plot(x, [r["expected_length"] for r in rs], marker="o", label=f"{kind}, a sampled chain")
        if "tree_expected_length" in rs[0]:
            ax[0].plot(x, [r["tree_expected_length"] for r in rs], marker="s", ls="--", label=f"{kind}, a tree's path")
        for d in range(1, 4):
            ax[1].plot(x, [r[f"acc_{d}"] for r in rs], marker="o", ms=3, label=f"{kind}, depth {d}")
    ax[0].set(
        xlabel="pretraining tokens (millions)",
        ylabel="expected acceptance length",
        title="held-out text: expected acceptance length (estimate)",
    )
    ax[1].set(
        xlabel="pretraining tokens (millions)",
        ylabel="acceptance probability",
        ylim=(0, 1),
        title="held-out, per depth / block position",
    )
    ax[0].legend(fontsize=8)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _check_resume(cfg: PretrainConfig, out: Path) -> dict | None:
    """The state to resume from (None for a fresh run); refuses to overwrite or to resume with other settings."""
    state = out / "state.pt"
    if not cfg.resume:
        if state.exists():
            raise UserError(f"{out} already holds a pretraining run; pass --resume to continue it, or another --out")
        return None
    if not state.exists():
        raise UserError(f"--resume: {out} has no state.pt to continue from; run without --resume first")
    saved = json.loads((out / "config.json").read_text())["config"]
    now = to_dict(cfg)
    free = {"resume", "eval_every", "checkpoint_every", "draft_layout"}  # a resumed drafter keeps its saved layout
    diff = [k for k in now if k not in free and k != "model" and now[k] != saved.get(k)]
    diff += [f"model.{k}" for k in now["model"] if k != "threads" and now["model"][k] != saved["model"].get(k)]
    if diff:
        raise UserError(
            f"--resume with other settings than the run in {out} ({', '.join(diff)}); "
            "pass the same settings or another --out"
        )
    return torch.load(state, map_location="cpu", weights_only=False)


def drafter_trainers(
    cfg: PretrainConfig, master, vocab_ids: torch.Tensor | None, inits: dict
) -> dict[str, DraftTrainer]:
    """A `DraftTrainer` per --draft kind, of a fresh drafter (seeded, on `vocab_ids`) or the kind's --init one."""
    w = master.lm_head.weight
    trainers = {}
    for kind in cfg.kinds():
        torch.manual_seed(cfg.seed)
        settings = {"block_size": cfg.block_size} if kind == "dflash" else {}
        if cfg.draft_layers:
            settings["num_layers"] = cfg.draft_layers
        if kind == "eagle3":
            settings["layout"] = "fused" if cfg.draft_layout == "fused" else "eagle3"
        # --init: continued pretraining, from the checkpoint's weights and draft vocabulary
        drafter = inits[kind] if kind in inits else KINDS[kind](master.args, vocab_ids=vocab_ids, **settings)
        if kind == "eagle3" and cfg.feature_loss >= 0:  # else a fresh drafter's 2, an --init drafter's own
            drafter.feature_weight = cfg.feature_loss
        if kind == "dflash" and cfg.anchors > 0:  # else a fresh drafter's 8, an --init drafter's own
            drafter.anchors = cfg.anchors
        trainers[kind] = DraftTrainer(drafter.to(device=w.device, dtype=w.dtype).bind(master), lr=cfg.lr)
    return trainers


def check_layout(cfg: PretrainConfig, inits: dict) -> None:
    """--draft-layout against the --init drafter's: fused to eagle3 is carried over (`relayout_init`), not back."""
    d = inits.get("eagle3")
    if d is not None and cfg.draft_layout == "fused" and d.layout != "fused":
        raise UserError(
            f"--draft-layout fused with --init {cfg.init}, a drafter in EAGLE-3's layout: a drafter is "
            "carried from the fused layout into EAGLE-3's, not back; leave --draft-layout out"
        )


def relayout_init(cfg: PretrainConfig, drafter, policy, train: list[Seq], n: int = 8):
    """An --init drafter, carried into EAGLE-3's layout when --draft-layout eagle3 asks it of a fused one
    (`drafters.eagle3.relayout`, its scales from the policy's pass over the first `n` training sequences)."""
    if drafter.kind != "eagle3" or cfg.draft_layout != "eagle3" or drafter.layout == "eagle3":
        return drafter
    drafter = drafter.to(policy.lm_head.weight.device).bind(policy)
    toks, taps, _, _, mask = policy_pass(policy, train[:n], tuple(drafter.feature_layers), answers_only=False)
    with torch.no_grad():
        m = mask[:, :-1]  # position t: token t + 1 and the feature at t
        feats = drafter.features({i: t[:, :-1].float() for i, t in taps.items()})
        emb = drafter.embed(toks[:, 1:]).float()
    tqdm.write(
        f"sparkrl: --init {cfg.init} carried from the fused layout into EAGLE-3's (scales from {int(m.sum())} "
        f"positions); this run's training goes on from there",
        file=sys.stderr,
    )
    return relayout(drafter.float(), emb[m], feats[m])


def feature_store(cfg: PretrainConfig, rollout: RolloutCopy) -> FeatureStore | None:
    """--feature-cache: where the policy passes of sequences read more than once are kept (held-out ones always),
    keyed on what computes them."""
    if not cfg.feature_cache:
        return None
    tag = [
        cfg.model.model,
        str(rollout.model.lm_head.weight.dtype),
        bool(rollout.kernels.get("packed")),
        cfg.model.cpu_kernels,
    ]
    tag += [t for t in kernel_tags(rollout) if t != "packed"]
    return FeatureStore(Path(cfg.out) / "features", json.dumps(tag))


class Pretraining:
    """A pretraining run in progress: the drafters' trainers, the policy pass that feeds them (`policy`: the
    rollout copy), the held-out sequences, and where it stands (steps, tokens read, training seconds, the
    records of pretrain.jsonl), resumed from `resume` (state.pt) when given."""

    def __init__(
        self,
        cfg: PretrainConfig,
        trainers: dict[str, DraftTrainer],
        policy,
        test: list[Seq],
        store: FeatureStore | None,
        fingerprint: list[float],
        resume: dict | None,
    ):
        self.cfg, self.out, self.trainers, self.policy = cfg, Path(cfg.out), trainers, policy
        self.test, self.store, self.fingerprint = test, store, fingerprint
        self.step, self.tokens, self.seconds, self.records = 0, 0, 0.0, []
        if resume is not None:
            for kind, t in trainers.items():
                t.load_state_dict(resume["trainers"][kind])
            self.step, self.tokens, self.seconds = resume["step"], resume["tokens"], resume.get("seconds", 0.0)
            torch.set_rng_state(resume["rng"])  # the DFlash loss draws its anchors from it
            log = self.out / "pretrain.jsonl"
            records = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
            self.records = [r for r in records if r["step"] <= self.step]  # what came after the checkpoint is redone

    def save_state(self) -> None:
        atomic_save(
            {
                "trainers": {k: t.state_dict() for k, t in self.trainers.items()},
                "step": self.step,
                "tokens": self.tokens,
                "seconds": self.seconds,
                "rng": torch.get_rng_state(),
            },
            self.out / "state.pt",
        )
        (self.out / "pretrain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def score(self) -> None:
        """Held-out scores of every drafter (records and a line each), its snapshot, the plot."""
        for kind, t in self.trainers.items():
            if self.test:
                r = {
                    "heldout": True,
                    "kind": kind,
                    "step": self.step,
                    "tokens": self.tokens,
                    **evaluate(t, self.policy, self.test, self.cfg.micro_batch, self.store),
                }
                self.records.append(r)
                tree = f", trees {r['tree_expected_length']:.2f}" if "tree_expected_length" in r else ""
                tqdm.write(
                    f"{kind} held-out at step {self.step} ({self.tokens / 1e6:.2f}M tokens): expected length "
                    f"{r['expected_length']:.2f}{tree}, top-1 {r['top1_1']:.2f}",
                    file=sys.stderr,
                )
            save_safetensors(
                t.drafter.checkpoint(),
                self.out / kind / "snapshots" / f"step-{self.step:06d}.safetensors",
                fingerprint=self.fingerprint,
            )
        plot(self.records, self.out / "pretrain.png")

    def train(self, plans: list[list[list[int]]], seqs: list[Seq], taps: tuple, store: FeatureStore | None) -> None:
        """Every micro-batch of `plans` (indices into `seqs`) from the run's step on, with held-out scores and
        state saves on their schedules; Ctrl-C saves the state and stops with one line."""
        cfg, total = self.cfg, sum(map(len, plans))
        if self.step == 0:
            self.score()
        bar = tqdm(total=total, initial=self.step, desc=f"pretrain-draft ({cfg.draft})", unit="step", file=sys.stderr)
        try:
            for k, mb in enumerate(b for plan in plans for b in plan):
                if k < self.step:
                    continue
                self.train_step([seqs[j] for j in mb], taps, total, store)
                bar.update(1)
                bar.set_postfix(
                    tokens=f"{self.tokens / 1e6:.2f}M",
                    **{
                        f"top1_{kind}": f"{r['top1']:.2f}"
                        for kind, r in zip(self.trainers, self.records[-len(self.trainers) :])
                    },
                )
                if self.step % cfg.eval_every == 0 or self.step == total:
                    self.score()
                if self.step % cfg.checkpoint_every == 0 or self.step == total:
                    self.save_state()
        except KeyboardInterrupt:
            self.save_state()
            bar.close()
            raise UserError(f"interrupted at step {self.step}; continue with the same command and --resume") from None
        bar.close()

    def train_step(self, batch: list[Seq], taps: tuple, total: int, store: FeatureStore | None) -> None:
        """One micro-batch: one policy pass, every drafter's step on it (learning rate by `lr_at`), a record each."""
        t0 = time.perf_counter()
        inputs = policy_pass(self.policy, batch, taps, self.cfg.train_positions == "response", store)
        self.tokens += sum(len(s.ids) for s in batch)
        stats = {}
        for kind, t in self.trainers.items():
            for g in t.opt.param_groups:
                g["lr"] = lr_at(self.step, total, self.cfg.lr, self.cfg.warmup)
            with _autocast(self.policy):
                stats[kind] = t.observe(*inputs)
            t.step()
        self.seconds += time.perf_counter() - t0
        for kind, t in self.trainers.items():
            self.records.append(
                {
                    "kind": kind,
                    "step": self.step + 1,
                    "tokens": self.tokens,
                    "seconds": round(self.seconds, 2),
                    "lr": t.opt.param_groups[0]["lr"],
                    **stats[kind],
                }
            )
        self.step += 1

    def finish(self, seqs: list[Seq], steps: int) -> dict:
        """Each drafter written (OUT/KIND/drafter.pt and .safetensors); returns the run's summary."""
        summary = {
            "out": str(self.out),
            "sequences": len(seqs),
            "tokens": sum(len(s.ids) for s in seqs),
            "steps": steps,
            "draft_vocab": int(next(iter(self.trainers.values())).drafter.vocab_ids.numel()),
            "drafters": {},
        }
        for kind, t in self.trainers.items():
            atomic_save(t.drafter.checkpoint(), self.out / kind / "drafter.pt")
            save_safetensors(
                t.drafter.checkpoint(), self.out / kind / "drafter.safetensors", fingerprint=self.fingerprint
            )
            last = next((r for r in reversed(self.records) if r.get("heldout") and r["kind"] == kind), {})
            summary["drafters"][kind] = {
                "path": str(self.out / kind / "drafter.safetensors"),
                "heldout_expected_length": last.get("expected_length"),
                "heldout_top1": last.get("top1_1"),
                "heldout_tree_expected_length": last.get("tree_expected_length"),
            }
        return summary


def pretrain(cfg: PretrainConfig) -> dict:
    """Make (or reuse) the corpus, pick the draft vocabulary, train every --draft kind on the same policy
    passes with held-out scores; returns a summary."""
    out = Path(cfg.out)
    resume = _check_resume(cfg, out)
    problems = load_corpus_problems(cfg)  # bad --data or an empty corpus fails before the model loads
    set_threads(cfg.model.threads)
    lm = load_model(cfg.model.model, cfg.model.device, cfg.model.dtype)
    master, tok = lm.model, lm.tokenizer
    dt = rollout_dtype(cfg.model.rollout_dtype, master)
    rollout = rollout_copy(master, dt, cfg.model.cpu_kernels, cfg.model.rollout_head == "float32")
    policy = rollout.model  # what gives the drafters their features and targets
    inits = (
        {
            kind: load_drafter(find_checkpoint(cfg.init, kind, master, "--init"), master.args, kind)
            for kind in cfg.kinds()
        }
        if cfg.init
        else {}
    )  # a wrong --init fails before the corpus is made
    check_layout(cfg, inits)
    train, test, sources = build_corpus(cfg, rollout, tok, lm.eos_ids, problems)
    if resume is None:  # --draft-layout eagle3 carries a fused --init drafter over
        inits = {kind: relayout_init(cfg, d, policy, train) for kind, d in inits.items()}
    else:  # the drafters as saved (their layout, a carried one's included); `Pretraining` loads their state
        inits = {kind: load_drafter(resume["trainers"][kind]["drafter"], master.args, kind) for kind in cfg.kinds()}
    counts = Counter(t for s in train for t in s.ids)
    V = master.args.vocab_size
    vocab_ids = draft_vocabulary(counts, cfg.draft_vocab, V, lm.eos_ids) if 0 < cfg.draft_vocab < V else None
    fingerprint = policy_fingerprint(master)
    trainers = drafter_trainers(cfg, master, vocab_ids, inits)
    taps = tuple(sorted({i for t in trainers.values() for i in t.drafter.feature_layers}))  # one pass serves them all
    plans = [batch_plan([len(s.ids) for s in train], cfg.micro_batch, cfg.seed, e) for e in range(cfg.epochs)]
    store = feature_store(cfg, rollout)
    train_store = store if cfg.epochs > 1 else None  # training sequences are read again only in later epochs
    if train_store is not None:
        train_store.check_space(
            sum(len(s.ids) for s in train), (len(taps) + 1) * master.args.hidden_size, policy.lm_head.weight.dtype
        )
    if resume is None:
        (out / "config.json").write_text(
            json.dumps(
                {
                    "config": to_dict(cfg),
                    "corpus_sequences": len(train),
                    "corpus_tokens": sum(len(s.ids) for s in train),
                    "sources": sources,
                    "heldout_sequences": len(test),
                    "policy_dtype": str(policy.lm_head.weight.dtype),
                },
                indent=2,
            )
        )
    run = Pretraining(cfg, trainers, policy, test, store, fingerprint, resume)
    run.train(plans, train, taps, train_store)
    return run.finish(train, sum(map(len, plans)))
