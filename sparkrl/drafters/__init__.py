"""Drafters propose tokens for the policy to verify: eagle3.py (trees, chains) and dflash.py (blocks).

A drafter exposes, at every drafted context, `h` (the feature entering its output head) and `z`
(its logits over its vocabulary `vocab_ids`), the interface SPARK corrects; each kind owns its model,
its proposals and its loss (`base.py` says what the engine needs). This package's face: the kinds,
and `load_drafter` for a checkpoint checked against the policy it will serve.
"""

from __future__ import annotations

from pathlib import Path

from sparkrl.drafters.base import policy_fingerprint, read_checkpoint, read_description, same_policy
from sparkrl.drafters.dflash import DFlashDrafter
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.eagle3_format import feature_layers
from sparkrl.errors import UserError
from sparkrl.model.transformer import ModelArgs

KINDS = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter}  # kind -> drafter class
SHIPPED = Path(__file__).parent / "shipped"  # default drafters for the default model (shipped/README.md)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def shipped_path(kind: str) -> Path:
    return SHIPPED / f"{DEFAULT_MODEL.lower()}-{kind}.safetensors"


def find_checkpoint(choice: str, kind: str, policy, flag: str = "--draft-checkpoint") -> str | None:
    """The drafter checkpoint --draft-checkpoint `choice` names for a `kind` drafter serving `policy`
    (None: a freshly initialised drafter). '' picks the shipped drafter when it was made for this
    policy (same embedding, `same_policy`) and None otherwise; 'default' insists on the shipped one;
    'fresh' is None; anything else is a path."""
    if choice == "fresh":
        return None
    if choice not in ("", "default"):
        return choice
    path = shipped_path(kind)
    serves = path.is_file() and same_policy(read_description(path).get("fingerprint", []), policy_fingerprint(policy))
    if choice == "default" and not serves:
        why = "is not installed" if not path.is_file() else "was made for another policy"
        raise UserError(
            f"{flag} default: the shipped {kind} drafter {why}; it serves --model default "
            f"({DEFAULT_MODEL}); make one for this model with `sparkrl pretrain-draft --draft {kind}`"
        )
    return str(path) if serves else None


def load_drafter(path: str | Path | dict, policy_args: ModelArgs, kind: str | None = None, where: str = ""):
    """A drafter checkpoint (file, or a dict from `read_checkpoint`) checked against the policy it will
    serve (and the kind asked for). where: the file a dict came from, for the error messages."""
    ck = read_checkpoint(path)
    path = where or ("the checkpoint" if isinstance(path, dict) else path)
    if kind is not None and ck["kind"] != kind:
        raise UserError(
            f"{path} holds a drafter of kind {ck['kind']!r}, not {kind!r}; pass --draft {ck['kind']} or "
            "another checkpoint"
        )
    if ck["kind"] not in KINDS:
        raise UserError(f"{path} holds a drafter of kind {ck['kind']!r}; this sparkrl knows {', '.join(KINDS)}")
    cls = KINDS[ck["kind"]]
    settings = {**getattr(cls, "LEGACY", {}), **ck.get("settings", {})}
    d = cls(policy_args, feature_layers(ck, policy_args.num_layers), ck["state"]["vocab_ids"], **settings)
    want = d.signature()
    for k, v in ck["policy"].items():
        if want.get(k) != v:
            raise UserError(
                f"drafter checkpoint {path} was made for a policy with {k}={v}, this policy has "
                f"{k}={want.get(k)}; pretrain a drafter for this model"
            )
    try:
        d.load_state_dict(ck["state"])
    except RuntimeError as e:
        raise UserError(f"drafter checkpoint {path} does not fit the drafter ({str(e).splitlines()[0]})") from None
    return d
