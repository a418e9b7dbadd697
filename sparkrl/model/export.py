"""Exporting a trained policy as a Hugging Face model folder.

`export_model(policy, source, out)` writes what `transformers.AutoModelForCausalLM.from_pretrained(out)`
and `AutoTokenizer.from_pretrained(out)` load (and vLLM, llama.cpp's converter, ... read):

  * config.json        the source folder's config, with `dtype` / `torch_dtype` set to the saved dtype
                       (and `architectures` filled in when the source left it empty);
  * model.safetensors  the policy's state dict (parameter names are already Hugging Face's), without
                       `lm_head.weight` when the embeddings are tied;
  * the source folder's tokenizer, special-tokens, chat-template and generation-config files, copied;
  * sparkrl_export.json, the marker that makes the folder a sparkrl export (it lists the files written).

The folder is written into a temporary sibling and renamed into place, so `out` is never half-written.
An existing `out` is replaced only when it is empty or a previous export holding nothing but the files
its marker lists; anything else is refused, so a typo cannot delete a folder of other files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from sparkrl.errors import UserError
from sparkrl.model.transformer import ModelArgs, Transformer
from sparkrl.model.weights import save_tensors

MARKER = "sparkrl_export.json"
WEIGHTS = "model.safetensors"

# Files of a source folder that travel with the weights (matched on the file name's start or end).
_COPY_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "chat_template",
    "generation_config",
    "added_tokens",
    "vocab.",
    "merges.",
    "preprocessor_config",
)
_COPY_SUFFIXES = (".tiktoken",)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _copied(name: str) -> bool:
    return name.startswith(_COPY_PREFIXES) or name.endswith(_COPY_SUFFIXES)


def _check_replaceable(out: Path) -> None:
    """Raise UserError unless `out` is absent, an empty folder, or a previous export and nothing more."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise UserError(f"export target {out} exists and is not a folder; choose a new output folder")
    present = set(os.listdir(out))
    if not present:
        return
    fix = f"choose a new or empty output folder, or delete {out} yourself"
    if MARKER not in present:
        raise UserError(
            f"export target {out} is not a sparkrl export (it holds {', '.join(sorted(present)[:3])}"
            f"{', ...' if len(present) > 3 else ''} and no {MARKER}); {fix}"
        )
    try:
        listed = set(json.loads((out / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"export target {out} has an unreadable {MARKER}; {fix}") from None
    extra = sorted(present - listed - {MARKER})
    if extra:
        raise UserError(
            f"export target {out} holds files a sparkrl export did not write "
            f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}); {fix}"
        )


def _config(source: Path, policy: Transformer, dtype: torch.dtype) -> dict:
    try:
        cfg = json.loads((source / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot read {source / 'config.json'} ({type(e).__name__}); "
            "pass the policy's own model folder as the export source"
        ) from None
    try:
        args = ModelArgs.from_hf(cfg)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None
    if args != policy.args:
        raise UserError(
            f"the policy does not match {source / 'config.json'} ({policy.args.arch}, "
            f"{policy.args.num_layers} layers vs {args.arch}, {args.num_layers} layers); "
            "export from the folder the policy was loaded from"
        )
    cfg.pop("quantization_config", None)  # the exported weights are plain tensors
    if not cfg.get("architectures"):
        cfg["architectures"] = [ARCHITECTURES[args.arch]]
    cfg["dtype"] = cfg["torch_dtype"] = _DTYPE_NAMES[dtype]  # transformers >= 4.56 reads dtype, older torch_dtype
    cfg["tie_word_embeddings"] = args.tie_word_embeddings
    return cfg


def _state(policy: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for k, v in policy.weights().items():  # the tied head is the embedding: not stored
        v = v.detach().to("cpu")
        if v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous()
    # safetensors refuses tensors sharing memory; a cast or a copy to the CPU may leave views of one buffer.
    ptrs = [v.untyped_storage().data_ptr() for v in state.values()]
    if len(set(ptrs)) != len(ptrs):
        state = {k: v.clone() for k, v in state.items()}
    return state


def _linked(same_as: Path, state: dict[str, torch.Tensor], target: Path) -> bool:
    """Hard-link `same_as` at `target` if it holds `state`'s tensors (names, dtypes, shapes) with the metadata
    an export writes; False (nothing done) when it does not or the file system cannot link."""
    try:
        with safe_open(str(same_as), "pt") as f:
            if f.metadata() != {"format": "pt"} or set(f.keys()) != set(state):
                return False
            for k, v in state.items():
                s = f.get_slice(k)
                if list(s.get_shape()) != list(v.shape) or s.get_dtype() != _SAFETENSORS_DTYPES.get(v.dtype):
                    return False
        os.link(same_as, target)
    except OSError:
        return False
    return True


def _write_marker(folder: Path, source: Path, dtype: torch.dtype) -> None:
    """The marker of a sparkrl export in `folder`, listing the files written there (all it holds so far)."""
    files = sorted(os.listdir(folder))
    (folder / MARKER).write_text(
        json.dumps(
            {
                "format": "sparkrl-export",
                "version": 1,
                "source": str(source),
                "dtype": _DTYPE_NAMES[dtype],
                "files": files,
            },
            indent=2,
        )
        + "\n"
    )


def export_model(
    policy: Transformer, source: Path, out: Path, *, dtype: torch.dtype | None = None, same_as: Path | None = None
) -> Path:
    """Write `policy` as a Hugging Face model folder at `out` (replacing a previous export); returns `out`.

    source: the policy's own model folder (`weights.resolve_model_path(name)`): its config.json and its
    tokenizer / chat-template / generation-config files are carried over. dtype: the saved dtype
    (default: the policy's, that of its LM head). same_as: a safetensors file the caller knows holds exactly
    these weights (a training run's last checkpoint): hard-linked as the weights file when its tensors' names,
    dtypes and shapes match, which saves writing and storing them twice; written as usual otherwise.
    """
    source, out = Path(source), Path(out)
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        raise UserError(f"export target {out} is the source model folder; choose another output folder")
    dtype = dtype or policy.lm_head.weight.dtype
    if dtype not in _DTYPE_NAMES:
        raise UserError(f"cannot export in {dtype}; use float32, bfloat16 or float16")
    _check_replaceable(out)
    cfg = _config(source, policy, dtype)
    copies = sorted(p for p in source.iterdir() if p.is_file() and _copied(p.name))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    old = None
    try:
        state = _state(policy, dtype)
        if not (same_as and _linked(Path(same_as), state, tmp / WEIGHTS)):
            save_tensors(state, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for p in copies:
            shutil.copyfile(p, tmp / p.name)
        _write_marker(tmp, source, dtype)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out.exists():
            # A folder cannot be renamed over a non-empty one: move the old export aside first.
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.rename(out, old / "export")
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(old / "export", out)
                raise
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out
