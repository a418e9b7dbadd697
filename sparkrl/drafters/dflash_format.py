"""DFlash's checkpoint format: a DFlash-style drafter in DFlash's layout (`drafters.dflash`) written as the
checkpoint vLLM's `dflash` speculative method loads (vLLM 0.32 `qwen3_dflash.py`; the layout of z-lab's DFlash
checkpoints). `vllm_export.export_draft` writes the folder:

  * config.json: a Qwen3 config of the drafter (`architectures` DFlashDraftModel, its layers, heads and sizes, the
    policy's RoPE and vocabulary) plus `draft_vocab_size`, `target_hidden_size`, `block_size` and `dflash_config`:
    `target_layer_ids` (the policy layers whose outputs feed `fc`, ascending, counted as sparkrl counts them: vLLM
    adds one to read the state after that layer), `mask_token_id` (the token vLLM feeds at a block's mask
    positions) and `causal` false (a block attends to itself both ways);
  * model.safetensors, without the `model.` prefix vLLM adds: `layers.N.*` (Qwen3 decoder layers: q/k/v/o
    projections, per-head `q_norm` / `k_norm`, MLP, both norms), `fc.weight` (vLLM taps each layer once, in
    ascending order: blocks of a layer tapped twice are summed), `hidden_norm.weight` (the context's norm before
    every layer's key and value projections), `norm.weight`, `lm_head.weight` (the policy's head restricted to the
    draft vocabulary), and `d2t` / `t2d` for a draft vocabulary smaller than the policy's. No token embedding:
    vLLM shares the target's, as sparkrl's drafter does;
  * mask_embedding.pt: the learnt mask embedding, which vLLM puts in place of `mask_token_id`'s embedding
    (`{"mask_token_id": id, "embedding": (d,)}`; vLLM also replaces it where the anchor itself is that token, and
    sparkrl's drafter does the same, so the two compute one function).

vLLM: `LLM(model=POLICY, speculative_config={"method": "dflash", "model": OUT, "num_speculative_tokens": K})`
drafts K tokens a round in one forward of K + 1 positions (the anchor, then K masks), greedily, which is sparkrl's
block of size K + 1.
"""

from __future__ import annotations

import io

import torch

from sparkrl.drafters.eagle3_format import fc_by_layer, layer_fields, policy_rope, vocab_map
from sparkrl.model.transformer import Transformer

MASK_FILE = "mask_embedding.pt"  # vLLM's name for a separately learnt mask embedding


def why_not(drafter) -> str | None:
    """Why a DFlash-style `drafter` cannot be written in DFlash's format (None: it can)."""
    if drafter.layout != "dflash":
        return (
            "this drafter uses sparkrl's earlier stacked layout (the context runs through its layers), which vLLM's "
            "dflash method cannot run; carry it into DFlash's layout with a continued run, `sparkrl pretrain-draft "
            "--draft dflash --init THIS_FILE --draft-layout dflash`, or train one (DFlash's layout is the default)"
        )
    return None


def dflash_config(drafter, policy_config: dict, dtype: torch.dtype) -> dict:
    """config.json of the export (see the module doc); policy_config: the policy's own config.json."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **layer_fields(drafter, policy_config, dtype),
        **policy_rope(policy_config),
        "block_size": drafter.block_size,
        "dflash_config": {
            "mask_token_id": drafter.mask_token_id,
            "target_layer_ids": sorted(set(drafter.feature_layers)),
            "causal": False,
        },
    }


def dflash_weights(drafter, policy: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors under DFlash's names (see the module doc), in `dtype`; the mask embedding too, as
    `mask_embedding` (its own file in a folder, `mask_file`; vLLM's in-place reload takes it under this name)."""
    out = {
        "fc.weight": fc_by_layer(drafter),
        "hidden_norm.weight": drafter.hidden_norm.weight,
        "norm.weight": drafter.stack.norm.weight,
        "lm_head.weight": policy.lm_head.weight.detach()[drafter.vocab_ids],
        "mask_embedding": drafter.mask_embed,
    }
    for i, layer in enumerate(drafter.stack.layers):
        out.update({f"layers.{i}.{k}": v for k, v in layer.state_dict().items()})
    out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in out.items()}
    return out | vocab_map(drafter, policy.args.vocab_size)


def mask_file(mask_token_id: int, embedding: torch.Tensor) -> bytes:
    """mask_embedding.pt's bytes, as vLLM reads it (`torch.load(..., weights_only=True)`)."""
    buf = io.BytesIO()
    torch.save({"mask_token_id": mask_token_id, "embedding": embedding.clone()}, buf)
    return buf.getvalue()
