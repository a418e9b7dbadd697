"""DFlash's checkpoint format (sparkrl.drafters.dflash_format) against a float64 reference of what vLLM's
`qwen3_dflash.py` computes from a checkpoint folder alone: the context's keys and values projected from the normed
fused feature into every layer, the block (the anchor's embedding, then the mask embedding read from
mask_embedding.pt) attending to them and to itself both ways, the draft vocabulary mapped through d2t. An export's
names, shapes, layer ids and files are what vLLM reads. (tests/test_vllm_dflash.py runs vLLM itself on an export.)"""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import exportable_pair, hf_model, ours_from_hf
from safetensors.torch import load_file
from test_eagle3_format import rms, rope

from sparkrl.drafters.dflash import DFlashDrafter, block_logits, relayout
from sparkrl.drafters.vllm_export import export_draft
from sparkrl.errors import UserError


def vllm_dflash_reference(folder, embed, taps, tokens, anchor: int, k: int):
    """vLLM's DFlash forward for one sequence, in float64, from the export: the context is positions 0..anchor-1
    (their fused feature fc(cat(target layers' outputs))), the queries the token at `anchor` and k mask tokens at
    positions anchor..anchor+k; returns the draft logits at the k mask positions over the target vocabulary (-inf
    outside the draft vocabulary)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}
    mask = torch.load(io.BytesIO((folder / "mask_embedding.pt").read_bytes()), weights_only=True)
    dc = cfg["dflash_config"]
    assert mask["mask_token_id"] == dc["mask_token_id"] and not dc["causal"]
    eps, H, Hk, D = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg["rope_parameters"]["rope_theta"]
    aux = torch.cat([taps[i + 1] for i in dc["target_layer_ids"]], -1)[:anchor]  # vLLM reads the state after i + 1
    ctx = rms(aux @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (C, d)
    ids = torch.tensor([int(tokens[anchor])] + [dc["mask_token_id"]] * k)
    x = embed[ids].double()
    x[ids == dc["mask_token_id"]] = mask["embedding"].double()  # the separate mask embedding, where the id stands
    cpos, qpos = torch.arange(anchor), anchor + torch.arange(k + 1)
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: w[f"layers.{i}.{n}"]
        h = rms(x, p("input_layernorm.weight"), eps)
        q = rms((h @ p("self_attn.q_proj.weight").T).view(-1, H, D), p("self_attn.q_norm.weight"), eps)
        kq = rms((h @ p("self_attn.k_proj.weight").T).view(-1, Hk, D), p("self_attn.k_norm.weight"), eps)
        kc = rms((ctx @ p("self_attn.k_proj.weight").T).view(-1, Hk, D), p("self_attn.k_norm.weight"), eps)
        vq, vc = (
            (h @ p("self_attn.v_proj.weight").T).view(-1, Hk, D),
            (ctx @ p("self_attn.v_proj.weight").T).view(-1, Hk, D),
        )
        keys = torch.cat([rope(kc, cpos, theta), rope(kq, qpos, theta)]).repeat_interleave(H // Hk, 1)
        vals = torch.cat([vc, vq]).repeat_interleave(H // Hk, 1)
        att = (torch.einsum("qhd,khd->hqk", rope(q, qpos, theta), keys) / D**0.5).softmax(-1)  # no mask: non-causal
        x = x + torch.einsum("hqk,khd->qhd", att, vals).reshape(k + 1, H * D) @ p("self_attn.o_proj.weight").T
        m = rms(x, p("post_attention_layernorm.weight"), eps)
        x = (
            x
            + (F.silu(m @ p("mlp.gate_proj.weight").T) * (m @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        )
    z = rms(x, w["norm.weight"], eps)[1:] @ w["lm_head.weight"].T  # (k, draft vocab)
    full = torch.full((k, cfg["vocab_size"]), float("-inf"), dtype=torch.float64)
    d2t = w.get("d2t", torch.zeros(z.shape[1], dtype=torch.long))
    full[:, torch.arange(z.shape[1]) + d2t] = z
    return full


@pytest.mark.parametrize("feature_layers", [(0, 2, 3), (3, 0, 2), (2, 2, 1)])
def test_export_computes_in_vllms_layout_what_the_drafter_computes(feature_layers, tmp_path):
    hf, policy, vocab, d = exportable_pair(DFlashDrafter, feature_layers, block_size=5, num_layers=2)
    V = policy.args.vocab_size
    out = export_draft(d, policy, hf.config.to_dict(), tmp_path / "draft", dtype=torch.float64)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3" and cfg["block_size"] == 5
    assert cfg["dflash_config"]["target_layer_ids"] == sorted(set(feature_layers)) and cfg["draft_vocab_size"] == V // 2
    assert not any(k.startswith("model.") or "embed_tokens" in k for k in load_file(str(out / "model.safetensors")))
    tokens = torch.randint(0, V, (1, 14))
    tokens[0, 9] = d.mask_token_id  # an anchor that is the mask token reads the mask embedding in both
    with torch.no_grad():
        o = policy(tokens, taps=tuple(range(4)))
        taps = {i + 1: t[0] for i, t in o.taps.items()}  # vLLM's k: the state after k layers
        want = block_logits(d, tokens, d.features(o.taps), torch.tensor([[6, 9]]))[0]  # (2 blocks, 4, Vd)
    for b, anchor in enumerate((6, 9)):
        got = vllm_dflash_reference(out, policy.model.embed_tokens.weight, taps, tokens[0], anchor, 4)
        assert torch.allclose(got[:, vocab].float(), want[b], atol=1e-5, rtol=1e-5)  # logits come as float32
        assert torch.isinf(got).sum() == 4 * (V - V // 2)


def test_a_stacked_drafter_is_refused_and_carried_over(tmp_path):
    hf = hf_model("llama", num_hidden_layers=4)
    policy = ours_from_hf(hf)
    stacked = DFlashDrafter(policy.args, layout="stacked").bind(policy)
    with pytest.raises(UserError, match="stacked layout.*--draft-layout dflash"):
        export_draft(stacked, policy, hf.config.to_dict(), tmp_path / "x")
    carried = relayout(stacked)
    new = carried.state_dict()
    kept = [k for k, v in stacked.state_dict().items() if torch.equal(new[k], v)]
    assert len(kept) == len(stacked.state_dict())  # every weight both layouts have, kept
    assert {k for k in new if k not in kept} == {"hidden_norm.weight"} | {
        f"stack.layers.{i}.self_attn.{n}_norm.weight" for i in range(3) for n in "qk"
    }
    assert carried.layout == "dflash" and export_draft(carried, policy, hf.config.to_dict(), tmp_path / "y").is_dir()
