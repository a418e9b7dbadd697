"""Shared fixtures: a private cost cache, a tiny random Llama, a tiny model folder. The plain helpers that test
modules import (models, exact probabilities, the chi-square test...) are in helpers.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import default_tokenizer_dir, hf_model, ours_from_hf


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


@pytest.fixture
def tiny_llama():
    return ours_from_hf(hf_model("llama"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama as a Hugging Face folder, with SmolLM2's tokenizer (vocab 49152)."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("tiny-model")
    hf = hf_model(
        "llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, tie_word_embeddings=True
    )
    cfg = hf.config.to_dict()
    (out / "config.json").write_text(json.dumps(cfg))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"))
    src = default_tokenizer_dir()
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(src / f, out / f)
    return out
