"""EAGLE-3's checkpoint format, both ways: an EAGLE3-style drafter (EAGLE-3's layout) written as the checkpoint
vLLM's `eagle3` speculative method loads (`eagle3_config`, `eagle3_weights`; `vllm_export.export_draft` writes the
folder), and a published EAGLE-3 checkpoint (vLLM's Llama EAGLE-3
format or the `speculators` one) read as a sparkrl drafter (`read_eagle3`, which `--draft-checkpoint FOLDER`
uses), its own output head and layer sizes kept.

`vllm_export.export_draft(drafter, policy, policy_config, out)` writes a folder with:

  * config.json: a Llama config of the drafter (`architectures` LlamaForCausalLMEagle3, its layers, heads and
    sizes, the policy's RoPE and vocabulary) plus EAGLE-3's fields: `draft_vocab_size`, `target_hidden_size`,
    `num_aux_hidden_states` and `eagle_aux_hidden_state_layer_ids` (the policy layers whose hidden states feed
    `fc`, counted as vLLM counts them: k is the state after k decoder layers, so sparkrl's layer i, whose output
    it taps, is k = i + 1), `norm_before_residual` false (the feature itself is the residual);
  * model.safetensors: `midlayer.*` (the first decoder layer; further ones `layers.N.*`), `fc.weight`,
    `norm.weight` (vLLM taps each layer once, in ascending order: `fc`'s blocks are put in that order, and those of
    a layer a small policy's default taps twice are summed, which computes the same), `lm_head.weight` (the policy's
    output head restricted to the draft vocabulary, which is what
    sparkrl's drafter drafts with), `d2t` (draft id -> target id offset: target = draft + d2t[draft]) and `t2d`
    (target ids in the draft vocabulary) when the draft vocabulary is smaller than the policy's. The token
    embedding is left out: vLLM then shares the target's, as sparkrl's drafter does;
  * sparkrl_draft.json: what it was made from (kind, feature layers), the marker of an export.

vLLM: `LLM(model=POLICY, speculative_config={"method": "eagle3", "model": OUT, "num_speculative_tokens": k})`.
The same layout and names are EAGLE-3's reference checkpoints' and SGLang's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparkrl.errors import UserError
from sparkrl.model.transformer import ModelArgs, Transformer
from sparkrl.model.weights import load_state_dict


def why_not(drafter) -> str | None:
    """Why an EAGLE3-style `drafter` cannot be written in EAGLE-3's format (None: it can)."""
    if drafter.layout != "eagle3":
        return (
            "this drafter uses sparkrl's earlier fused layout, which vLLM and SGLang cannot run; carry it into "
            "EAGLE-3's layout with a continued run, `sparkrl pretrain-draft --draft eagle3 --init THIS_FILE "
            "--draft-layout eagle3`, or train one (EAGLE-3's layout is the default)"
        )
    args = drafter.stack.args
    if args.qk_norm or args.o_bias or args.qkv_bias:
        return (
            f"the drafter of a {args.arch} policy has {'q/k norms' if args.qk_norm else 'attention biases'}, which "
            "vLLM's Llama EAGLE-3 drafter lacks; export drafters of Llama-architecture policies"
        )
    return None


def policy_rope(policy_config: dict) -> dict:
    """The RoPE fields of the policy's config.json, which a drafter's config repeats."""
    return {k: policy_config[k] for k in ("rope_parameters", "rope_scaling", "rope_theta") if k in policy_config}


def eagle3_config(drafter, policy_config: dict, dtype: torch.dtype) -> dict:
    """config.json of the export (see the module doc); policy_config: the policy's own config.json."""
    a: ModelArgs = drafter.stack.args
    rope = policy_rope(policy_config)
    if "rope_theta" in drafter.layer:  # an imported drafter's own
        rope = {"rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta}}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **layer_fields(drafter, policy_config, dtype),
        "mlp_bias": a.mlp_bias,
        **rope,
        "num_aux_hidden_states": len(set(drafter.feature_layers)),
        "eagle_aux_hidden_state_layer_ids": sorted({i + 1 for i in drafter.feature_layers}),
        "norm_before_residual": drafter.norm_before_residual,
        "norm_before_fc": False,
    }


def layer_fields(drafter, policy_config: dict, dtype: torch.dtype) -> dict:
    """What a drafter's config.json says of its decoder layers, its vocabularies and its dtype, in Hugging Face's
    names (the fields EAGLE-3's and DFlash's configs share)."""
    a: ModelArgs = drafter.stack.args
    return {
        "hidden_act": "silu",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps,
        "attention_bias": False,
        "max_position_embeddings": policy_config.get("max_position_embeddings", 4096),
        "vocab_size": a.vocab_size,
        "draft_vocab_size": int(drafter.vocab_ids.numel()),
        "target_hidden_size": a.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def eagle3_weights(drafter, policy: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors under EAGLE-3's names (see the module doc), in `dtype`."""
    head = drafter.head.weight if drafter.own_head else policy.lm_head.weight.detach()[drafter.vocab_ids]
    out = {"fc.weight": fc_by_layer(drafter), "norm.weight": drafter.stack.norm.weight, "lm_head.weight": head}
    layers = drafter.stack.layers
    for i, layer in enumerate(layers):
        prefix = "midlayer." if len(layers) == 1 else f"layers.{i}."
        out.update({prefix + k: v for k, v in layer.state_dict().items()})
    out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in out.items()}
    return out | vocab_map(drafter, policy.args.vocab_size)


def fc_by_layer(drafter) -> torch.Tensor:
    """The drafter's `fc` as vLLM applies it: vLLM taps each policy layer once, in ascending order, so fc's blocks
    go in that order, and those of a layer tapped twice are summed (which computes the same)."""
    layers = drafter.feature_layers
    blocks = drafter.fc.weight.detach().view(drafter.fc.weight.shape[0], len(layers), -1)  # one block per tap
    return torch.cat([sum(blocks[:, j] for j in range(len(layers)) if layers[j] == i) for i in sorted(set(layers))], 1)


def vocab_map(drafter, vocab_size: int) -> dict[str, torch.Tensor]:
    """d2t (draft id -> target id offset) and t2d (target ids in the draft vocabulary) of a draft vocabulary smaller
    than the policy's; nothing for the whole vocabulary."""
    ids = drafter.vocab_ids.to("cpu", torch.long)
    if ids.numel() == vocab_size:
        return {}
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


LAYER_FIELDS = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "qk_norm",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
)  # what an imported drafter's layers keep of their own config


def is_eagle3_folder(path: Path) -> bool:
    """Whether `path` is a folder holding an EAGLE-3 checkpoint (vLLM's Llama format or speculators')."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    c = json.loads(cfg.read_text())
    return (
        "speculators_model_type" in c
        or any("Eagle3" in a for a in c.get("architectures") or [])
        or "eagle_aux_hidden_state_layer_ids" in c
        or "draft_vocab_size" in c
    )


def read_eagle3(path: Path) -> dict:
    """A published EAGLE-3 checkpoint folder as a sparkrl drafter checkpoint (`drafters.load_drafter` reads it):
    its layer sizes and output head kept (the `layer`, `own_head` settings), the feature layers from
    `eagle_aux_hidden_state_layer_ids` (vLLM's k, after k layers, is sparkrl's layer k - 1; absent: vLLM's default
    2, L/2, L - 3 of an L-layer policy, resolved when the policy is known), the draft vocabulary from `d2t`. The
    token embedding is the policy's."""
    path = Path(path)
    top = json.loads((path / "config.json").read_text())
    cfg = {
        **top.get("transformer_layer_config", {}),
        **{k: v for k, v in top.items() if k != "transformer_layer_config"},
    }
    if cfg.get("norm_before_fc") or cfg.get("fc_norm"):
        raise UserError(f"{path}: an EAGLE-3 drafter with norms before fc, which sparkrl's drafter lacks")
    args = ModelArgs.from_hf({**cfg, "model_type": "llama"})
    raw = load_state_dict(path)
    state = {}
    for k, v in raw.items():
        k = k.removeprefix("model.")
        if k.startswith("midlayer."):
            state["stack.layers.0." + k[len("midlayer.") :]] = v
        elif k.startswith("layers."):
            state["stack." + k] = v
        elif k in ("fc.weight", "norm.weight"):
            state[k if k == "fc.weight" else "stack.norm.weight"] = v
        elif k == "lm_head.weight":
            state["head.weight"] = v
    d2t = raw.get("d2t")
    vd = state["head.weight"].shape[0]
    state["vocab_ids"] = (torch.arange(vd) + d2t.long()) if d2t is not None else torch.arange(vd)
    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = [k - 1 for k in sorted(set(aux))] if aux else None  # None: `feature_layers` resolves vLLM's default
    target = cfg.get("target_hidden_size") or cfg["hidden_size"]
    return {
        "kind": "eagle3",
        "policy": {"hidden_size": target, "vocab_size": cfg["vocab_size"]},
        "feature_layers": layers,
        "settings": {
            "layout": "eagle3",
            "num_layers": cfg.get("num_hidden_layers", 1),
            "own_head": True,
            "norm_before_residual": bool(cfg.get("norm_before_residual", "speculators_model_type" in top)),
            "feature_weight": 0.0,
            "layer": {f: getattr(args, f) for f in LAYER_FIELDS},
        },
        "state": state,
    }


def feature_layers(ck: dict, num_layers: int) -> tuple[int, ...]:
    """A drafter checkpoint's feature layers; for an EAGLE-3 checkpoint that names none, vLLM's default for an
    L-layer policy (after 2, L/2 and L - 3 layers: sparkrl's layers 1, L/2 - 1, L - 4)."""
    if ck["feature_layers"] is not None:
        return tuple(ck["feature_layers"])
    return tuple(sorted({max(k - 1, 0) for k in (2, num_layers // 2, num_layers - 3)}))
