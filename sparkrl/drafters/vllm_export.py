"""A trained drafter written as the checkpoint folder vLLM's speculative decoding loads (`sparkrl export-draft`,
`--engine vllm`): an EAGLE3-style drafter in EAGLE-3's format for vLLM's `eagle3` method (`eagle3_format`), a
DFlash-style one in DFlash's format for its `dflash` method (`dflash_format`): each kind's method bears its name.
Beside the weights and config.json, sparkrl_draft.json marks the folder as an export (what it was made from: kind,
feature layers), so a later export may replace it and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from sparkrl.drafters import dflash_format, eagle3_format
from sparkrl.errors import UserError
from sparkrl.model.transformer import Transformer
from sparkrl.model.weights import save_tensors

MARKER = "sparkrl_draft.json"
WEIGHTS = "model.safetensors"


def exportable(drafter) -> str | None:
    """Why `drafter` cannot be written for vLLM (None: it can)."""
    if drafter.kind == "eagle3":
        return eagle3_format.why_not(drafter)
    if drafter.kind == "dflash":
        return dflash_format.why_not(drafter)
    return f"a {drafter.kind} drafter, which vLLM has no speculative method for; export an eagle3 or dflash drafter"


def served_weights(drafter, policy: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the names its vLLM method loads (an in-place update sends these)."""
    if drafter.kind == "dflash":
        return dflash_format.dflash_weights(drafter, policy, dtype)
    return eagle3_format.eagle3_weights(drafter, policy, dtype)


def export_draft(
    drafter, policy: Transformer, policy_config: dict, out: Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write `drafter` (serving `policy`, whose config.json is `policy_config`) as vLLM's checkpoint folder for its
    kind at `out`, through a temporary sibling renamed into place; returns `out`. An existing `out` is replaced only
    when it is empty or an earlier export."""
    why = exportable(drafter)
    if why:
        raise UserError(f"cannot export for vLLM: {why}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise UserError(f"--out {out} exists and is not an earlier draft export; pass a new or empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    try:
        tensors = served_weights(drafter, policy, dtype)
        if drafter.kind == "dflash":  # vLLM reads the mask embedding from a file of its own
            mask = tensors.pop("mask_embedding")
            (tmp / dflash_format.MASK_FILE).write_bytes(dflash_format.mask_file(drafter.mask_token_id, mask))
            config = dflash_format.dflash_config(drafter, policy_config, dtype)
        else:
            config = eagle3_format.eagle3_config(drafter, policy_config, dtype)
        save_tensors(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        marker = {
            "format": f"sparkrl-{drafter.kind}-draft",
            "version": 1,
            "kind": drafter.kind,
            "feature_layers": list(drafter.feature_layers),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def method(folder: Path) -> str:
    """The vLLM speculative method of an export folder (`export_draft`): its drafter's kind, which vLLM's method of
    the same name runs."""
    return json.loads((Path(folder) / MARKER).read_text())["kind"]
