"""`sparkrl pretrain-draft`: a drafter trained before GRPO on text the policy itself writes.

The policy answers math problems (from --data) and chat prompts at the rollout's sampling settings;
an optional local corpus is added. The draft vocabulary is the corpus's most frequent tokens (EOS
always kept). Training runs the policy once per micro-batch (no grad) for its features and target
distributions and steps the drafter with the same `DraftTrainer` as online training.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from sparkrl.checkpoint import atomic_save
from sparkrl.config import PretrainConfig, to_dict
from sparkrl.data import INSTRUCTION, chat_prompt_ids, load_problems
from sparkrl.draft_train import DraftTrainer
from sparkrl.drafters import KINDS
from sparkrl.errors import UserError
from sparkrl.machine import set_threads
from sparkrl.model import pad_right
from sparkrl.rollout import generate, response_generators
from sparkrl.weights import load_model

CHAT_PROMPTS = [
    "Explain how a rainbow forms.", "Write a short poem about the sea.", "What are three tips for studying well?",
    "Describe your ideal weekend.", "How does a bicycle stay upright?", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "Summarize the plot of a fairy tale you like.", "What is photosynthesis?",
    "How do I write a polite email to a teacher?", "List some fun facts about octopuses.",
    "Explain what a computer program is to a child.", "What should I pack for a camping trip?",
    "How do vaccines work?", "Tell me a short story about a brave mouse.", "What is the difference between weather and climate?",
]


def _corpus_from_file(path: str, tokenizer, max_tokens: int) -> list[list[int]]:
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


def pretrain(cfg: PretrainConfig) -> dict:
    """Make a corpus with the policy, pick the draft vocabulary, train; returns a summary."""
    out = Path(cfg.out)
    problems = load_problems(cfg.data.data, cfg.data.default_size, cfg.seed).problems
    set_threads(cfg.model.threads)
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
    trainer = DraftTrainer(drafter.bind(policy), lr=cfg.lr)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"config": to_dict(cfg), "corpus_sequences": len(seqs),
                                                 "corpus_tokens": sum(map(len, seqs))}, indent=2))
    taps = tuple(drafter.feature_layers)
    steps = cfg.epochs * ((len(seqs) + cfg.micro_batch - 1) // cfg.micro_batch)
    bar = tqdm(total=steps, desc="pretrain-draft", unit="step", file=sys.stderr)
    order = list(range(len(seqs)))
    with open(out / "pretrain.jsonl", "w") as log:
        for epoch in range(cfg.epochs):
            rng.shuffle(order)
            for i in range(0, len(order), cfg.micro_batch):
                mb = [seqs[j] for j in order[i:i + cfg.micro_batch]]
                toks, lens = pad_right(mb, w.device)
                mask = torch.arange(toks.shape[1], device=w.device) < (lens - 2)[:, None]  # t needs t+1 and t+2
                with torch.no_grad():
                    o = policy(toks, taps=taps)
                    logits = policy.logits(o.hidden)
                st = trainer.observe(toks, o.taps, o.hidden, logits, mask)
                trainer.step()
                log.write(json.dumps({"epoch": epoch, **st}) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{st['loss']:.3f}", top1=f"{st['top1']:.2f}")
    bar.close()
    atomic_save(drafter.checkpoint(), out / "drafter.pt")
    return {"out": str(out), "sequences": len(seqs), "tokens": sum(map(len, seqs)),
            "draft_vocab": int(drafter.vocab_ids.numel()), "last_top1": st["top1"]}
