"""EAGLE-3's checkpoint format (sparkrl.drafters.eagle3_format) against a float64 reference of what vLLM's
`llama_eagle3.py` computes from a checkpoint folder alone: an export's names, shapes, feature-layer order, d2t
map and residual are what vLLM reads, and a published-style checkpoint read into sparkrl computes what vLLM
computes from it. (tests/test_vllm.py runs vLLM itself on an export.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import exportable_pair, hf_model, ours_from_hf
from safetensors.torch import load_file

from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.vllm_export import export_draft
from sparkrl.errors import UserError


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):  # (T, H, D), neox-style halves as Llama's; angles in float32, as vLLM's cos/sin cache
    D = x.shape[-1]
    inv = (1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float()
    ang = pos[:, None].float() * inv[None]  # (T, D/2)
    cos, sin = (torch.cat([f(ang)] * 2, -1)[:, None].double() for f in (torch.cos, torch.sin))
    return x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin


def vllm_reference(folder, embed, taps, tokens):
    """vLLM's Eagle3 Llama forward over T positions of one sequence, in float64, from the export: token t at
    position t with feature fc(cat(aux layers)) at t; returns (logits over the target vocabulary, -inf outside
    the draft vocabulary; the pre-norm output fed back as the next feature)."""
    top = json.loads((folder / "config.json").read_text())
    cfg = {**top.get("transformer_layer_config", {}), **top}
    w = {
        k.replace("layers.0.", "midlayer."): v.double() if v.is_floating_point() else v
        for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    eps, H, Hk = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg["rope_parameters"]["rope_theta"] if "rope_parameters" in cfg else cfg.get("rope_theta", 10000.0)
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    aux = torch.cat([taps[k] for k in cfg["eagle_aux_hidden_state_layer_ids"]], -1)  # ascending, k after k layers
    feat = aux @ w["fc.weight"].T
    T = tokens.numel()
    e = rms(embed[tokens], w["midlayer.input_layernorm.weight"], eps)
    h = torch.cat([e, rms(feat, w["midlayer.hidden_norm.weight"], eps)], -1)
    q = (h @ w["midlayer.self_attn.q_proj.weight"].T).view(T, H, D)
    k = (h @ w["midlayer.self_attn.k_proj.weight"].T).view(T, Hk, D)
    v = (h @ w["midlayer.self_attn.v_proj.weight"].T).view(T, Hk, D)
    pos = torch.arange(T)
    q, k = rope(q, pos, theta), rope(k, pos, theta)
    k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(T, H * D) @ w["midlayer.self_attn.o_proj.weight"].T
    normed_residual = cfg.get("norm_before_residual", "speculators_model_type" in top)  # vLLM's defaults per format
    x = (rms(feat, w["midlayer.hidden_norm.weight"], eps) if normed_residual else feat) + o
    m = rms(x, w["midlayer.post_attention_layernorm.weight"], eps)
    x = (
        x
        + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
        @ w["midlayer.mlp.down_proj.weight"].T
    )
    z = rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T  # (T, draft vocab)
    full = torch.full((T, cfg["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, torch.arange(z.shape[1]) + w["d2t"]] = z
    return full, x


@pytest.mark.parametrize("feature_layers", [(0, 2, 3), (3, 0, 2), (2, 2, 1)])
def test_export_computes_in_vllms_layout_what_the_drafter_computes(feature_layers, tmp_path):
    hf, policy, vocab, d = exportable_pair(Eagle3Drafter, feature_layers)
    V = policy.args.vocab_size
    out = export_draft(d, policy, hf.config.to_dict(), tmp_path / "draft", dtype=torch.float64)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == sorted({i + 1 for i in feature_layers})
    assert cfg["draft_vocab_size"] == V // 2 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    tokens = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        o = policy(tokens, taps=tuple(range(4)))
        taps = {i + 1: t[0] for i, t in o.taps.items()}  # vLLM's k: the state after k layers
        step = d(tokens, d.features(o.taps))
        want_z, want_a = step.z[0], step.a[0]
        got, fed_back = vllm_reference(out, policy.model.embed_tokens.weight, taps, tokens[0])
    assert torch.allclose(fed_back, want_a, atol=1e-10)
    assert torch.allclose(got[:, vocab].float(), want_z, atol=1e-5, rtol=1e-5)  # logits come as float32
    assert torch.isinf(got).sum() == 12 * (V - V // 2)


def test_drafters_vllm_cannot_run_are_refused_in_one_line(tmp_path):
    hf = hf_model("llama")
    policy = ours_from_hf(hf)
    fused = Eagle3Drafter(policy.args, layout="fused").bind(policy)
    with pytest.raises(UserError, match="fused layout"):
        export_draft(fused, policy, hf.config.to_dict(), tmp_path / "x")
    qwen = ours_from_hf(hf_model("qwen3"))
    with pytest.raises(UserError, match="q/k norms"):
        export_draft(Eagle3Drafter(qwen.args).bind(qwen), qwen, {}, tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an earlier draft export"):
        export_draft(Eagle3Drafter(policy.args).bind(policy), policy, hf.config.to_dict(), tmp_path / "busy")


def test_an_export_reads_back_as_the_same_drafter(tmp_path):
    from sparkrl.drafters import load_drafter

    hf = hf_model("llama", num_hidden_layers=4)
    policy = ours_from_hf(hf).double()
    vocab = torch.arange(0, policy.args.vocab_size, 2)
    torch.manual_seed(1)
    d = Eagle3Drafter(policy.args, (0, 1, 3), vocab).double().bind(policy)
    out = export_draft(d, policy, hf.config.to_dict(), tmp_path / "draft", dtype=torch.float64)
    back = load_drafter(str(out), policy.args, "eagle3").double().bind(policy)
    assert back.own_head and back.feature_layers == (0, 1, 3) and torch.equal(back.vocab_ids, vocab)
    tokens = torch.randint(0, policy.args.vocab_size, (2, 10))
    with torch.no_grad():
        o = policy(tokens, taps=(0, 1, 3))
        a, b = d(tokens, d.features(o.taps)), back(tokens, back.features(o.taps))
    assert torch.allclose(a.z, b.z, atol=1e-6) and torch.allclose(a.a, b.a, atol=1e-10)


def test_a_published_style_checkpoint_computes_in_sparkrl_what_vllm_computes(tmp_path):
    """A `speculators`-format EAGLE-3 drafter for a Qwen3 policy, with its own layer sizes (heads, MLP width), its own
    output head over a draft vocabulary and the normed feature as residual (that format's default): sparkrl reads it
    and drafts what the float64 reference of vLLM's forward drafts, and exports it back for vLLM."""
    from safetensors.torch import save_file

    from sparkrl.drafters import load_drafter

    hf = hf_model("qwen3", num_hidden_layers=6)
    policy = ours_from_hf(hf).double()
    d, V, Vd = policy.args.hidden_size, policy.args.vocab_size, 40
    layer = {
        "model_type": "llama",
        "hidden_size": d,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 80,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "rope_theta": 1e6,
        "hidden_act": "silu",
    }
    (tmp_path / "pub").mkdir()
    (tmp_path / "pub" / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "eagle3",
                "transformer_layer_config": layer,
                "draft_vocab_size": Vd,
                "target_hidden_size": d,
                "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                "speculators_config": {
                    "proposal_methods": [{"speculative_tokens": 3}],
                    "verifier": {"name_or_path": "x"},
                },
            }
        )
    )
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1
    vocab = torch.randperm(V, generator=g)[:Vd].sort().values
    w = {
        "fc.weight": r(d, 3 * d),
        "norm.weight": 1 + r(d),
        "lm_head.weight": r(Vd, d),
        "d2t": vocab - torch.arange(Vd),
        "t2d": torch.zeros(V, dtype=torch.bool),
        "embed_tokens.weight": r(V, d),
        "layers.0.input_layernorm.weight": 1 + r(d),
        "layers.0.hidden_norm.weight": 1 + r(d),
        "layers.0.self_attn.q_proj.weight": r(64, 2 * d),
        "layers.0.self_attn.k_proj.weight": r(32, 2 * d),
        "layers.0.self_attn.v_proj.weight": r(32, 2 * d),
        "layers.0.self_attn.o_proj.weight": r(d, 64),
        "layers.0.post_attention_layernorm.weight": 1 + r(d),
        "layers.0.mlp.gate_proj.weight": r(80, d),
        "layers.0.mlp.up_proj.weight": r(80, d),
        "layers.0.mlp.down_proj.weight": r(d, 80),
    }
    save_file(w, str(tmp_path / "pub" / "model.safetensors"))
    drafter = load_drafter(str(tmp_path / "pub"), policy.args, "eagle3").double().bind(policy)
    assert drafter.feature_layers == (0, 2, 3) and drafter.norm_before_residual and not drafter.stack.args.qk_norm
    tokens = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        o = policy(tokens, taps=tuple(range(6)))
        step = drafter(tokens, drafter.features(o.taps))
        got, fed_back = vllm_reference(
            tmp_path / "pub", policy.model.embed_tokens.weight, {i + 1: t[0] for i, t in o.taps.items()}, tokens[0]
        )
    assert torch.allclose(fed_back, step.a[0], atol=1e-10)
    assert torch.allclose(got[:, vocab].float(), step.z[0], atol=1e-5, rtol=1e-5)
    out = export_draft(drafter, policy, hf.config.to_dict(), tmp_path / "again", dtype=torch.float64)
    again, _ = vllm_reference(
        out, policy.model.embed_tokens.weight, {i + 1: t[0] for i, t in o.taps.items()}, tokens[0]
    )
    assert torch.allclose(again, got, atol=1e-9)
