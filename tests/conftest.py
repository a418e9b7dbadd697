"""Shared fixtures: tiny random models of each family (ours and transformers'), a tiny model folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from sparkrl.model.transformer import ModelArgs, Transformer

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)

FAMILIES = {
    "llama": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=False),
    "llama-tied-bias": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=True, attention_bias=True),
    "llama3-rope": dict(model_type="llama", rope_theta=500000.0, tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", rope_theta=1e6, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", rope_theta=1e6, tie_word_embeddings=True, head_dim=32),
}


@pytest.fixture(scope="session", autouse=True)
def private_cost_cache(tmp_path_factory):
    """The whole run's `SPARKRL_CACHE` is a temporary folder whose `models` is the user's: converted models
    are shared, but the one-off timings of this machine (`machine.measurement_path`: packing, dtype,
    weight-major, the budget's rounds) are measured afresh and thrown away. Timed on a CPU busy with
    the tests (or under one thread), they must not become the decisions the user's own runs read."""
    from sparkrl.machine import cache_dir

    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("sparkrl-cache")
    (root / "models").symlink_to(models, target_is_directory=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("SPARKRL_CACHE", str(root))
    yield root
    patch.undo()


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


@pytest.fixture
def tiny_llama():
    return ours_from_hf(hf_model("llama"))


def default_tokenizer_dir() -> Path:
    """The default model's folder (its tokenizer), or $SPARKRL_TOKENIZER where that package is not installed (a GPU
    machine: scripts/device_check.sh)."""
    if os.environ.get("SPARKRL_TOKENIZER"):
        return Path(os.environ["SPARKRL_TOKENIZER"])
    from sparkrl.model.weights import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama as a Hugging Face folder, with SmolLM2's tokenizer (vocab 49152)."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("tiny-model")
    hf = hf_model("llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  tie_word_embeddings=True)
    cfg = hf.config.to_dict()
    (out / "config.json").write_text(json.dumps(cfg))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"))
    src = default_tokenizer_dir()
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(src / f, out / f)
    return out


def shared_file(rel: str) -> Path:
    p = SHARED_DATA / rel
    if not p.exists():
        pytest.skip(f"{p} not present (../shared/data is only beside the repo in development and CI)")
    return p
