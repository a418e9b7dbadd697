"""How a config field is declared, checked and converted, for every config class (this package's and the settings
of the commands only the command line runs): `option`, `at_least`, `above` and `same_as` declare a field with its CLI
metadata and its bound; `Checked`, the base of the config classes, checks each field's declared choices (its
`Literal[...]` type) and bound, then the class's `validate`; `flag` and `choices` are what `cli.py` makes flags from;
`build` makes a nested config from a flat {field name: value} dict, `to_dict` a nested dict from a config.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from functools import cache
from typing import Literal

from sparkrl.errors import UserError


def require(ok: bool, msg: str) -> None:
    """A user error with `msg` unless `ok`."""
    if not ok:
        raise UserError(msg)


def option(default, **meta):
    """A field with CLI metadata: required=True (its flag must be given), trl=NAME (`train` also takes TRL
    GRPOConfig's name for it, --NAME), train_only=True (not a
    flag of `generate`), positional=True (an argument, not a flag)."""
    return field(default=default, metadata=meta)


def at_least(low, default, why: str = "", flag_name: str = "", **meta):
    """A field whose value must be >= low (`why`: the reason, shown in the error; `flag_name`: the
    flag that sets it, when not the field's own)."""
    return field(default=default, metadata={"bound": (">=", low, why), "flag": flag_name, **meta})


def above(low, default, why: str = "", **meta):
    """A field whose value must be > low."""
    return field(default=default, metadata={"bound": (">", low, why), "flag": "", **meta})


def same_as(cls, name: str):
    """A field that sets field `name` of `cls` from another config (`DraftConfig`'s tree fields are
    `TreeShape`'s): its default and help text are that field's, and `cls` checks the value."""
    return field(default=cls.__dataclass_fields__[name].default, metadata={"same_as": (cls, name)})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@cache
def choices(cls) -> dict[str, tuple]:
    """{field name: allowed values} of the `Literal[...]` fields of a config class."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: typing.get_args(hints[f.name])
        for f in dataclasses.fields(cls)
        if typing.get_origin(hints[f.name]) is Literal
    }


class Checked:
    """Base of the config classes: checks every field's declared choices and bounds, then `validate`."""

    def __post_init__(self):
        allowed = choices(type(self))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in allowed:
                require(
                    v in allowed[f.name],
                    f"{flag(f.name)} must be one of {', '.join(map(str, allowed[f.name]))}, got {v!r}",
                )
            if "bound" in f.metadata:
                op, low, why = f.metadata["bound"]
                ok = v >= low if op == ">=" else v > low
                require(
                    ok,
                    f"{f.metadata['flag'] or flag(f.name)} must be {op} {low}"
                    + (f" ({why})" if why else "")
                    + f", got {v}",
                )
        self.validate()

    def validate(self) -> None:
        """Checks that relate several fields (none by default)."""


# --- dataclass <-> flat dict --------------------------------------------------------------------


def build(cls, flat: dict):
    """Construct a nested config from {field name: value}; missing names keep their defaults."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default):
            kwargs[f.name] = build(type(f.default), flat)
        elif f.name in flat:
            kwargs[f.name] = flat[f.name]
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
