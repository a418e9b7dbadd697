"""The corpus `sparkrl pretrain-draft` trains drafters on (made once, in `--out/corpus/`, reused on resume): worked
solutions of the --data problems as the assistant turn after the GRPO prompt, responses the policy samples (rollout
settings, rollout dtype) to math problems and chat prompts, and an optional local text corpus. A share of the
problems is held out by a hash of the question (`data.held_out`) and never enters it; the held-out sequences are
made from them.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from sparkrl.config import PretrainConfig, to_dict
from sparkrl.engine.autoregressive import response_generators
from sparkrl.errors import UserError
from sparkrl.train.checkpoint import atomic_save
from sparkrl.train.data import INSTRUCTION, Problem, chat_prompt_ids, held_out, load_problems
from sparkrl.train.generation import Generation

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


def prompt_text(p: Problem) -> str:
    return f"{p.question}\n\n{INSTRUCTION}"


def solution_ids(tok, p: Problem, eos: int, max_tokens: int) -> Seq:
    """The GRPO prompt of a problem, its worked solution as the answer, EOS (what the policy would write)."""
    prompt = chat_prompt_ids(tok, prompt_text(p))
    return Seq((prompt + tok(p.solution, add_special_tokens=False)["input_ids"] + [eos])[:max_tokens], len(prompt))


def _generated(
    gen: Generation, tok, prompts: list[list[int]], cfg: PretrainConfig, eos_ids, folder: Path, name: str, offset: int
) -> list[Seq]:
    """Responses of the policy (`gen`: its inference copy) to `prompts`, CHUNK prompts per file in `folder`, named
    by a hash of what made them: a restarted or resumed run reuses the files of the same prompts and settings."""
    policy = gen.policy.model
    seqs = []
    bar = tqdm(total=len(prompts), desc=f"corpus ({name})", unit="prompt", file=sys.stderr)
    for i in range(0, len(prompts), CHUNK):
        chunk = prompts[i : i + CHUNK]
        key = json.dumps(
            [chunk, to_dict(cfg.sampling), cfg.seed, offset + i, cfg.model.model, str(policy.lm_head.weight.dtype)]
            + gen.policy.kernels.tags()
        )
        # ^ a file is reused only for the same work
        path = folder / f"{name}-{i // CHUNK:05d}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
        if not path.exists():
            r = gen.generate(
                chunk, cfg.sampling, eos_ids, response_generators(cfg.seed, len(chunk), 1, offset=offset + i)
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
    cfg: PretrainConfig, gen: Generation, tok, eos_ids, problems: tuple[list[Problem], list[Problem]]
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
    responses = _generated(gen, tok, prompts, cfg, eos_ids, folder, "train", 0)
    sources["policy responses"] = sum(len(s.ids) for s in responses)
    train += responses
    k = cfg.eval_sequences - len(test)
    held = [
        chat_prompt_ids(tok, prompt_text(p))[: cfg.data.max_prompt_tokens]
        for p in rng.sample(test_p, min(k, len(test_p)))
    ]
    test += _generated(gen, tok, held, cfg, eos_ids, folder, "heldout", EVAL_SEED)
    if cfg.corpus:
        extra = _corpus_from_file(cfg.corpus, tok, limit)
        sources["--corpus"] = sum(len(s.ids) for s in extra)
        train += extra
    return train, test, sources
