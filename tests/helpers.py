"""What several test modules share, as plain functions and classes; the fixtures in conftest.py are built from
them. Tiny random models and the paths of test data; a tiny policy's exact response probabilities and the
chi-square test of sampled responses against them; a stand-in reward and a run config for training runs; a
synthetic cost model and a scripted budget; SPARK's update in float64; a check that a saved plot was drawn."""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from sparkrl.config import RunConfig, build
from sparkrl.engine.budget import AR, Budget, CostModel
from sparkrl.engine.sampling import target_probs
from sparkrl.model.transformer import ModelArgs, Transformer
from sparkrl.train.rewards import Score

# --- tiny random models and test data --------------------------------------------------------------------

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

FAMILIES = {
    "llama": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=False),
    "llama-tied-bias": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=True, attention_bias=True),
    "llama3-rope": dict(
        model_type="llama",
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(model_type="qwen2", rope_theta=1e6, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", rope_theta=1e6, tie_word_embeddings=True, head_dim=32),
}


def hf_model(family: str, seed: int = 0, **overrides):
    """A transformers model of `family` with random weights (bias and norms randomised too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**TINY, **FAMILIES[family], **overrides}
    cfg = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def ours_from_hf(hf) -> Transformer:
    args = ModelArgs.from_hf(hf.config.to_dict())
    m = Transformer(args)
    state = dict(hf.state_dict())
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    m.load_state_dict(state, strict=not args.tie_word_embeddings)
    return m.eval()


def default_tokenizer_dir() -> Path:
    """The default model's folder (its tokenizer), or $SPARKRL_TOKENIZER where that package is not installed (a GPU
    machine: scripts/device_check.sh)."""
    if os.environ.get("SPARKRL_TOKENIZER"):
        return Path(os.environ["SPARKRL_TOKENIZER"])
    from sparkrl.model.weights import resolve_model_path

    return resolve_model_path("default")


def shared_file(rel: str) -> Path:
    p = SHARED_DATA / rel
    if not p.exists():
        pytest.skip(f"{p} not present (../shared/data is only beside the repo in development and CI)")
    return p


# --- sampling exactness: a tiny policy, its exact response probabilities, the chi-square test -------------

V, EOS = 6, 5  # the tiny policy's vocabulary; EOS ends a response

SEEDS = (0, 1)  # the seeds each exactness case runs over, each with the samples the one seed had; seed 0 is the
# case as it ran before it had seeds (the same policy, drafter and uniforms)
ALPHA = 1e-3 / len(SEEDS)  # the p-value under which one chi-square check fails: over all SEEDS, a case keeps
# the false-alarm rate its one-seed version had at 1e-3


def small_policy(seed=0):
    """A tiny random policy over V tokens with peaked, context-dependent distributions."""
    m = ours_from_hf(
        hf_model(
            "llama",
            seed=seed,
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)
    return m


def exact_sequences(policy, prompt, L, temperature, top_p):
    """Probability of every response to `prompt` (length L, or shorter when it ends with EOS): the reference,
    one policy forward per token of each response."""
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        if EOS in seq:
            seq = seq[: seq.index(EOS) + 1]
        if seq in out:
            continue
        pr = 1.0
        for i in range(len(seq)):
            with torch.no_grad():
                logits = policy.logits(policy(torch.tensor([prompt + list(seq[:i])])).hidden)[0, -1]
            pr *= float(target_probs(logits[None], temperature, top_p)[0, seq[i]])
        out[seq] = pr
    return out


def sequence_probs(policy, prompt, L, temperature, top_p):
    """`exact_sequences`, with one batched policy forward per response length instead of one per prefix."""
    after = {}  # EOS-free prefix -> target distribution of the next token
    prefixes = [()]
    for _ in range(L):
        with torch.no_grad():
            hidden = policy(torch.tensor([prompt + list(s) for s in prefixes])).hidden[:, -1]
        after.update(zip(prefixes, target_probs(policy.logits(hidden), temperature, top_p).tolist()))
        prefixes = [s + (t,) for s in prefixes for t in range(V) if t != EOS]
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        if EOS in seq:
            seq = seq[: seq.index(EOS) + 1]
        out[seq] = math.prod(after[seq[:i]][seq[i]] for i in range(len(seq)))
    return out


def chi_square_pvalue(samples, probs: dict) -> float:
    """Pearson's chi-square goodness of fit of `samples` (outcomes: token ids, response tuples) to the exact
    distribution `probs` (outcome -> probability, normalised here): the p-value of "the samples were drawn from
    `probs`". Cells whose expected count is under 5 are pooled, rarest first, into one cell of at least 5 (the
    test's chi-square approximation needs that). An outcome of probability zero (or missing from `probs`) fails
    the assertion here: no p-value can excuse it."""
    n = len(samples)
    counts = Counter(samples)
    impossible = [s for s in counts if probs.get(s, 0.0) <= 0]
    assert not impossible, f"{len(impossible)} outcomes of probability 0 sampled, e.g. {impossible[0]}"
    total = sum(probs.values())
    cells = sorted((p / total * n, counts[s]) for s, p in probs.items() if p > 0)  # (expected, observed)
    pool_e = pool_o = 0.0
    k = 0
    while k < len(cells) and (cells[k][0] < 5 or 0 < pool_e < 5):
        pool_e, pool_o, k = pool_e + cells[k][0], pool_o + cells[k][1], k + 1
    expected = [e for e, _ in cells[k:]] + ([pool_e] if pool_e else [])
    observed = [o for _, o in cells[k:]] + ([pool_o] if pool_e else [])
    assert len(expected) >= 2, f"nothing to test: {len(cells)} possible outcomes, {n} samples"
    return float(chisquare(observed, expected).pvalue)


# --- training runs ---------------------------------------------------------------------------------------


class ParityGrader:
    """A stand-in reward that random tiny models do earn: the parity of the response's length."""

    def score(self, text, answer):
        return Score(float(len(text) % 2), 0.0)

    def close(self):
        pass


def run_config(model_dir, out, **kw):
    """A 2-step GRPO run's config on the tiny model, `kw` overriding the flat (CLI-named) settings."""
    flat = dict(
        model=str(model_dir),
        out=str(out),
        steps=2,
        group_size=3,
        prompts_per_step=2,
        max_new_tokens=6,
        default_size=20,
        lr=1e-3,
        micro_batch=4,
    )
    return build(RunConfig, {**flat, **kw})


# --- the speculation budget ------------------------------------------------------------------------------

ROWS = (1, 2, 4, 8)


def full_depth(by_nodes: dict, depth: int) -> dict:
    """{node count: v} (0: autoregressive) -> {(nodes, depth): v}, each tree at its full depth min(n, depth)."""
    return {(n, min(n, depth)) if n else AR: v for n, v in by_nodes.items()}


def synthetic():
    """Seconds per round by node count (0 = autoregressive) at 1, 2, 4, 8 rows for a depth-3 shape:
    verification + drafting (0.1, 0.1, 0.2, 0.3 s); acceptance-independent (no per-level cost)."""
    verify = {
        0: [1.0, 1.1, 1.3, 2.0],
        1: [1.1, 1.3, 1.8, 3.0],
        2: [1.2, 1.5, 2.3, 4.0],
        4: [1.3, 1.9, 3.0, 6.0],
        6: [1.5, 2.5, 4.5, 9.0],
    }
    draft = [0.1, 0.1, 0.2, 0.3]
    rounds = {n: [v + (d if n else 0.0) for v, d in zip(vs, draft)] for n, vs in verify.items()}
    return CostModel(ROWS, full_depth(rounds, 3), full_depth({n: [0.0] * 4 for n in verify}, 3), [0.0] * 4)


class Alternating(Budget):
    """Tree and autoregressive rounds in turn."""

    calls = 0

    def choose(self, B):
        self.calls += 1
        return (self.shape.nodes, self.shape.depth) if self.calls % 2 else AR


# --- SPARK's update in float64 ---------------------------------------------------------------------------


def random_round(n, owners, g, V, D, peaked=3.0):
    """n feedback contexts over a vocabulary of V and features of D: batch row, h, z, target p (sums to <= 1,
    as on a reduced vocabulary), w."""
    row = torch.randint(0, len(owners), (n,), generator=g)
    h = torch.randn(n, D, generator=g)
    z = torch.randn(n, V, generator=g) * peaked
    p = torch.softmax(torch.randn(n, V, generator=g) * peaked, -1) * 0.97
    w = torch.rand(n, generator=g) + 0.5
    return row, h, z, p, w


def reference(rounds, owners_of_rows, A, k, eta, T, n_owners):
    """Eq. (5) in float64 with dense B (n_owners, V, r), one context at a time; also sum (w/W) G^A."""
    V = rounds[0][2].shape[1]
    A = A.double()
    B = torch.zeros(n_owners, V, A.shape[1], dtype=torch.float64)
    gA = torch.zeros_like(A)
    updates = 0
    for row, h, z, p, w in rounds:
        h, z, p, w = h.double(), z.double(), p.double(), w.double()
        own = owners_of_rows[row]
        W = {int(o): float(w[own == o].sum()) for o in own.unique()}
        step = torch.zeros_like(B)
        for c in range(len(row)):
            g = int(own[c])
            u = A.T @ h[c]
            q = torch.softmax((z[c] + B[g] @ u) / T, -1)
            S = set(p[c].topk(k).indices.tolist()) | set(q.topk(k).indices.tolist())
            delta = torch.zeros(V, dtype=torch.float64)
            for v in S:
                delta[v] = q[v] - p[c, v]
            tail = (1 - sum(float(q[v]) for v in S)) - (1 - sum(float(p[c, v]) for v in S))
            for v in S:
                delta[v] -= tail
            lam = float(w[c]) / W[g]
            step[g] -= eta * lam * torch.outer(delta, u)
            gA += lam * torch.outer(h[c], B[g].T @ delta)
        updates += len(W)
        B = B + step
    return B, gA / updates


# --- plots -----------------------------------------------------------------------------------------------


def assert_drawn(png: Path, min_height=200, min_width=400):
    """The PNG reads back as an image of at least these pixels with something drawn on it: more than one colour,
    and not a white page."""
    from matplotlib.image import imread

    image = imread(png)  # (H, W, 3 or 4) floats in [0, 1]
    assert image.ndim == 3 and image.shape[0] >= min_height and image.shape[1] >= min_width, image.shape
    rgb = image[..., :3].reshape(-1, 3)
    assert len(torch.from_numpy(rgb).unique(dim=0)) > 1 and float(rgb.min()) < 0.5, "a blank image"


# --- vLLM-CPU on a tiny policy ------------------------------------------------------------------------------

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}  # in this process (tests reach its runner), one GiB of KV cache
PROMPT = [1, 3, 2, 0]


def tiny_vllm_pair(root: Path, kind: str = "eagle3"):
    """The exactness tests' tiny policy (6 tokens, peaked) as a Hugging Face folder vLLM-CPU runs (head_dim 64: its
    attention wants 32 or more) and a trained drafter of `kind` (EAGLE3-style, or DFlash-style with blocks of 4)
    exported beside it: (policy folder, drafter folder, the policy as sparkrl runs it, the drafter)."""
    from sparkrl.drafters.vllm_export import export_draft

    hf = hf_model(
        "llama",
        vocab_size=V,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=0,
        pad_token_id=0,
    )
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)  # peaked distributions, as the exactness tests' small_policy
    hf.save_pretrained(root / "policy")
    policy = ours_from_hf(hf)
    drafter = trained_drafter(policy) if kind == "eagle3" else trained_block_drafter(policy)
    export_draft(drafter, policy, hf.config.to_dict(), root / "draft", dtype=torch.float32)
    return root / "policy", root / "draft", policy, drafter


def trained_drafter(policy, steps: int = 150):
    """An EAGLE3-style drafter trained for a few seconds on the policy's own samples, so that vLLM accepts some of
    its drafts (and the tests reach the acceptance path, not only the rejections)."""
    from sparkrl.drafters.eagle3 import Eagle3Drafter, draft_loss

    torch.manual_seed(0)
    drafter = Eagle3Drafter(policy.args, feature_layers=(0, 1)).bind(policy)
    toks = own_samples(policy)
    with torch.no_grad():
        out = policy(toks, taps=drafter.feature_layers)
        logits = policy.logits(out.hidden)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = draft_loss(drafter, toks, out.taps, out.hidden, logits, torch.ones_like(toks, dtype=torch.bool))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.requires_grad_(False)


def exportable_pair(cls, feature_layers, **kw):
    """A 4-layer float64 Llama policy and a `cls` drafter on half its vocabulary, every weight moved away from its
    initial value (norms too): (the Hugging Face model, the policy, the draft vocabulary, the drafter)."""
    hf = hf_model("llama", num_hidden_layers=4)
    policy = ours_from_hf(hf).double()
    V = policy.args.vocab_size
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(0))[: V // 2].sort().values
    torch.manual_seed(1)
    d = cls(policy.args, feature_layers, vocab, **kw).double().bind(policy)
    for p in d.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    return hf, policy, vocab, d


def own_samples(policy, n: int = 32, length: int = 24) -> torch.Tensor:
    """(n, PROMPT + length) the policy's own responses to PROMPT (temperature 1, top-p 0.95), EOS-padded."""
    from sparkrl.config import SamplingConfig
    from sparkrl.engine.autoregressive import generate

    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    out = generate(policy, [PROMPT], SamplingConfig(1.0, 0.95, length), (), gens, group_size=n).tokens
    return torch.tensor([PROMPT + list(r) + [EOS] * (length - len(r)) for r in out])


def trained_block_drafter(policy, steps: int = 150):
    """A DFlash-style drafter (DFlash's layout, blocks of 4) trained for a few seconds on the policy's own samples."""
    from sparkrl.drafters.dflash import DFlashDrafter, block_loss

    torch.manual_seed(0)
    drafter = DFlashDrafter(policy.args, feature_layers=(0, 1), block_size=4, num_layers=2).bind(policy)
    toks = own_samples(policy)
    with torch.no_grad():
        out = policy(toks, taps=drafter.feature_layers)
        logits = policy.logits(out.hidden)
    mask = torch.ones_like(toks, dtype=torch.bool)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss, _ = block_loss(drafter, toks, out.taps, logits, mask, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.requires_grad_(False)


def response_probs(policy, temperature: float, top_p: float, length: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every response of `length` tokens to PROMPT (EOS not ending it)."""
    probs = {(): 1.0}
    for _ in range(length):
        seqs = list(probs)
        with torch.no_grad():
            p = target_probs(
                policy.logits(policy(torch.tensor([PROMPT + list(s) for s in seqs])).hidden[:, -1]), temperature, top_p
            )
        probs = {s + (t,): probs[s] * float(p[i, t]) for i, s in enumerate(seqs) for t in range(V)}
    return probs
