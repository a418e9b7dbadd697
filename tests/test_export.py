"""Export of a policy as a Hugging Face folder: transformers loads it and computes our logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import FAMILIES, hf_model, ours_from_hf
from safetensors import safe_open
from safetensors.torch import save_file

from sparkrl.errors import UserError
from sparkrl.model.export import MARKER, export_model
from sparkrl.model.weights import load_model


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _source_folder(hf, path):
    """A model folder as weights.resolve_model_path returns one: config.json + model.safetensors."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(path / "model.safetensors"))
    return path


def _perturb(model, seed=1):
    """Move every parameter, so matching logits prove the export holds our weights, not the source's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.05)
    return model


def _load_hf(path, **kw):
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"transformers did not load the export cleanly: {bad}"
    return hf.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_loads_export_with_our_logits(family, tmp_path):
    hf = hf_model(family)
    source = _source_folder(hf, tmp_path / "source")
    ours = _perturb(ours_from_hf(hf))
    out = export_model(ours, source, tmp_path / "export")

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not FAMILIES[family]["tie_word_embeddings"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float32" and cfg["architectures"]
    loaded = _load_hf(out, dtype=torch.float32)
    x = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        want = ours.logits(ours(x).hidden)
        got = loaded(x).logits
        before = hf(x).logits
    assert _rel_err(got, want) < 1e-4
    assert _rel_err(before, want) > 1e-2  # the perturbation is visible: the export is not the source
    assert sorted(os.listdir(tmp_path)) == ["export", "source"]  # no temporary folder left behind


def test_bfloat16_export_is_bit_exact_and_says_so(tmp_path):
    hf = hf_model("qwen3")
    source = _source_folder(hf, tmp_path / "source")
    ours = _perturb(ours_from_hf(hf)).to(torch.bfloat16)
    out = export_model(ours, source, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _load_hf(out, dtype="auto")
    theirs = loaded.state_dict()
    for k, v in ours.state_dict().items():
        assert theirs[k].dtype == torch.bfloat16 and torch.equal(theirs[k], v), k


def test_tokenizer_files_travel_and_exports_replace_only_exports(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    policy = load_model(str(tiny_model_dir), with_tokenizer=False).model
    out = export_model(policy, tiny_model_dir, tmp_path / "export")
    names = set(os.listdir(out))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        MARKER,
    } <= names
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (tiny_model_dir / "generation_config.json").read_text()
    )
    tok, ref = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(tiny_model_dir))
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert tok("2 + 3 = 5")["input_ids"] == ref("2 + 3 = 5")["input_ids"]
    assert load_model(str(out)).eos_ids == load_model(str(tiny_model_dir)).eos_ids

    # A second export replaces the first.
    _perturb(policy, seed=2)
    export_model(policy, tiny_model_dir, out)
    again = load_model(str(out), with_tokenizer=False).model
    for k, v in policy.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert sorted(os.listdir(tmp_path)) == ["export"]

    # Anything that is not (only) an export is left alone.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("keep me")
    with pytest.raises(UserError, match="not a sparkrl export.*thesis.tex"):
        export_model(policy, tiny_model_dir, other)
    assert os.listdir(other) == ["thesis.tex"]
    (out / "results.csv").write_text("keep me too")
    with pytest.raises(UserError, match="did not write.*results.csv"):
        export_model(policy, tiny_model_dir, out)
    assert (out / "results.csv").read_text() == "keep me too"
    with pytest.raises(UserError, match="is the source model folder"):
        export_model(policy, tiny_model_dir, tiny_model_dir)
    (tmp_path / "empty").mkdir()
    export_model(policy, tiny_model_dir, tmp_path / "empty")  # an empty folder is fine
    assert MARKER in os.listdir(tmp_path / "empty")


def test_export_refuses_a_policy_of_another_config(tiny_model_dir, tmp_path):
    ours = ours_from_hf(hf_model("qwen2"))
    with pytest.raises(UserError, match="does not match"):
        export_model(ours, tiny_model_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


@pytest.mark.slow
def test_default_model_export_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    lm = load_model("default")
    out = export_model(lm.model, lm.path, tmp_path / "export")
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name three prime numbers."}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt)["input_ids"]
    assert ids == lm.tokenizer(prompt)["input_ids"]
    hf = _load_hf(out, dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert _rel_err(hf(x).logits, lm.model.logits(lm.model(x).hidden)) < 1e-4


def test_weights_known_to_be_a_checkpoints_are_linked_not_written_twice(tiny_model_dir, tmp_path):
    """A training run's last checkpoint holds the exported weights: the export hard-links that file (one copy on
    disk) when its tensors match, and writes its own when they do not (another dtype, another file format)."""
    from safetensors.torch import save_file

    policy = load_model(str(tiny_model_dir), with_tokenizer=False).model
    ck = tmp_path / "policy.safetensors"
    save_file({k: v.contiguous() for k, v in policy.weights().items()}, str(ck), metadata={"format": "pt"})
    out = export_model(policy, tiny_model_dir, tmp_path / "linked", same_as=ck)
    assert (out / "model.safetensors").stat().st_ino == ck.stat().st_ino
    again = load_model(str(out), with_tokenizer=False).model
    assert all(torch.equal(again.state_dict()[k], v) for k, v in policy.state_dict().items())
    out = export_model(policy, tiny_model_dir, tmp_path / "bf16", dtype=torch.bfloat16, same_as=ck)
    assert (out / "model.safetensors").stat().st_ino != ck.stat().st_ino
    save_file({k: v.contiguous() for k, v in policy.weights().items()}, str(ck))  # no "format": "pt"
    out = export_model(policy, tiny_model_dir, tmp_path / "other", same_as=ck)
    assert (out / "model.safetensors").stat().st_ino != ck.stat().st_ino
