"""The EAGLE-3 export (sparkrl.vllm.export) against a float64 reference of what vLLM's `llama_eagle3.py` computes
from the exported files alone: their names, shapes, the feature-layer order, the d2t map and the residual are
what vLLM reads. (tests/test_vllm.py runs vLLM itself on an export.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers import hf_model, ours_from_hf
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.errors import UserError
from sparkrl.vllm.export import export_draft


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):  # (T, H, D), neox-style halves as Llama's; angles in float32, as vLLM's cos/sin cache
    D = x.shape[-1]
    inv = (1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float()
    ang = pos[:, None].float() * inv[None]  # (T, D/2)
    cos, sin = (torch.cat([f(ang)] * 2, -1)[:, None].double() for f in (torch.cos, torch.sin))
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def vllm_reference(folder, embed, taps, tokens):
    """vLLM's Eagle3 Llama forward over T positions of one sequence, in float64, from the export: token t at
    position t with feature fc(cat(aux layers)) at t; returns (logits over the target vocabulary, -inf outside
    the draft vocabulary; the pre-norm output fed back as the next feature)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}
    eps, H, Hk, D = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg["rope_parameters"]["rope_theta"] if "rope_parameters" in cfg else cfg.get("rope_theta", 10000.0)
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
    att = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(T, H * D) @ w["midlayer.self_attn.o_proj.weight"].T
    x = feat + o  # the feature is the residual (norm_before_residual false)
    m = rms(x, w["midlayer.post_attention_layernorm.weight"], eps)
    x = x + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    z = rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T  # (T, draft vocab)
    full = torch.full((T, cfg["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, torch.arange(z.shape[1]) + w["d2t"]] = z
    return full, x


@pytest.mark.parametrize("feature_layers", [(0, 2, 3), (3, 0, 2), (2, 2, 1)])
def test_export_computes_in_vllms_layout_what_the_drafter_computes(feature_layers, tmp_path):
    hf = hf_model("llama", num_hidden_layers=4)
    policy = ours_from_hf(hf).double()
    V = policy.args.vocab_size
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:V // 2].sort().values
    torch.manual_seed(1)
    d = Eagle3Drafter(policy.args, feature_layers, vocab).double().bind(policy)
    for p in d.parameters():  # norms and projections away from their initial values
        p.data.add_(torch.randn_like(p) * 0.05)
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
