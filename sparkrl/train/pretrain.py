"""`sparkrl pretrain-draft`: a drafter trained before GRPO on the policy's own distributions.

The corpus (`corpus`: made once, in `--out/corpus/`, reused on resume) holds worked solutions, the policy's
responses and an optional local text corpus; a share of the problems is held out (`data.held_out`) and never enters it;
held-out sequences are scored every --eval-every steps. The draft vocabulary is the corpus's most frequent tokens.

Training runs the policy once per micro-batch (no grad, rollout dtype) for its features and target
distributions (`features.policy_pass`; kept on disk and read back by later epochs and held-out scores)
and steps the drafter with the same `DraftTrainer` as online training, under a warm-up + cosine
learning-rate schedule. Micro-batches group sequences of similar length. `state.pt` (drafter,
optimizer, step, training seconds, which each record carries too) is written atomically every
--checkpoint-every steps; `--resume` continues exactly where it was written (the batch plan is a
function of the seed).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from sparkrl.config import DraftConfig, PretrainConfig, to_dict
from sparkrl.drafters import KINDS, find_checkpoint, load_drafter
from sparkrl.drafters.base import expected_length, policy_fingerprint, save_safetensors
from sparkrl.drafters.dflash import relayout as relayout_dflash
from sparkrl.drafters.eagle3 import relayout
from sparkrl.errors import UserError
from sparkrl.machine import set_threads
from sparkrl.model.weights import load_model
from sparkrl.train.checkpoint import atomic_save
from sparkrl.train.corpus import Seq, build_corpus, load_corpus_problems
from sparkrl.train.corpus import prompt_text as prompt_text  # where `commands.trl_rollout` reads it
from sparkrl.train.draft_train import DraftTrainer
from sparkrl.train.features import FeatureStore, policy_pass
from sparkrl.train.generation import Generation, RolloutPlan, build_generation


def draft_vocabulary(counts, size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """`size` token ids: `always` (EOS), then the most frequent in `counts`, then (for a corpus with
    fewer distinct tokens) the lowest unused ids; sorted."""
    vocab = list(dict.fromkeys(always))
    vocab += [t for t, _ in counts.most_common() if t not in vocab][: max(0, size - len(vocab))]
    if len(vocab) < size:
        used = set(vocab)
        vocab += [t for t in range(vocab_size) if t not in used][: size - len(vocab)]
    return torch.tensor(sorted(vocab))


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
        if kind == "dflash":
            settings["layout"] = "stacked" if cfg.draft_layout == "stacked" else "dflash"
        # --init: continued pretraining, from the checkpoint's weights and draft vocabulary
        drafter = inits[kind] if kind in inits else KINDS[kind](master.args, vocab_ids=vocab_ids, **settings)
        if kind == "eagle3" and cfg.feature_loss >= 0:  # else a fresh drafter's 2, an --init drafter's own
            drafter.feature_weight = cfg.feature_loss
        if kind == "dflash" and cfg.anchors > 0:  # else a fresh drafter's 8, an --init drafter's own
            drafter.anchors = cfg.anchors
        trainers[kind] = DraftTrainer(drafter.to(device=w.device, dtype=w.dtype).bind(master), lr=cfg.lr)
    return trainers


def check_layout(cfg: PretrainConfig, inits: dict) -> None:
    """--draft-layout against the --init drafter's: fused to eagle3 and stacked to dflash are carried over
    (`relayout_init`), not back."""
    for kind, old, new in (("eagle3", "fused", "EAGLE-3's"), ("dflash", "stacked", "DFlash's")):
        d = inits.get(kind)
        if d is not None and cfg.draft_layout == old and d.layout != old:
            raise UserError(
                f"--draft-layout {old} with --init {cfg.init}, a drafter in {new} layout: a drafter is "
                f"carried from the {old} layout into {new}, not back; leave --draft-layout out"
            )


def relayout_init(cfg: PretrainConfig, drafter, policy, train: list[Seq], n: int = 8):
    """An --init drafter, carried into EAGLE-3's layout when --draft-layout eagle3 asks it of a fused one
    (`drafters.eagle3.relayout`, its scales from the policy's pass over the first `n` training sequences), or into
    DFlash's when --draft-layout dflash asks it of a stacked one (`drafters.dflash.relayout`)."""
    if drafter.kind == "dflash" and cfg.draft_layout == "dflash" and drafter.layout == "stacked":
        tqdm.write(
            f"sparkrl: --init {cfg.init} carried from the stacked layout into DFlash's (its layers' weights kept, "
            "the key and query norms and the context norm new); this run's training goes on from there",
            file=sys.stderr,
        )
        return relayout_dflash(drafter)
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


def feature_store(cfg: PretrainConfig, gen: Generation) -> FeatureStore | None:
    """--feature-cache: where the policy passes of sequences read more than once are kept (held-out ones always),
    keyed on what computes them."""
    if not cfg.feature_cache:
        return None
    tag = [
        cfg.model.model,
        str(gen.policy.model.lm_head.weight.dtype),
        gen.policy.kernels.packed,
        cfg.model.cpu_kernels,
    ]
    tag += [t for t in gen.policy.kernels.tags() if t != "packed"]
    return FeatureStore(Path(cfg.out) / "features", json.dumps(tag))


class Pretraining:
    """A pretraining run in progress: the drafters' trainers, the policy pass that feeds them (`policy`: the
    inference copy), the held-out sequences, and where it stands (steps, tokens read, training seconds, the
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
    m = cfg.model
    plan = RolloutPlan.settle(master, m.rollout_dtype, m.cpu_kernels, DraftConfig(), m.rollout_head == "float32")
    gen = build_generation(plan, DraftConfig(), master, cfg.sampling.temperature, cfg.seed, trains=False)
    policy = gen.policy.model  # what writes the corpus and gives the drafters their features and targets
    inits = (
        {
            kind: load_drafter(find_checkpoint(cfg.init, kind, master, "--init"), master.args, kind)
            for kind in cfg.kinds()
        }
        if cfg.init
        else {}
    )  # a wrong --init fails before the corpus is made
    check_layout(cfg, inits)
    train, test, sources = build_corpus(cfg, gen, tok, lm.eos_ids, problems)
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
    store = feature_store(cfg, gen)
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
