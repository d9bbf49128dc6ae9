"""One configuration option: its field (help text, flag, choices) and how a TOML or command-line value becomes
the field's type (`coerce`); the sections that hold the options are `paratrain.config`'s."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any

from paratrain.errors import ParatrainError


class ConfigError(ParatrainError, ValueError):
    """A configuration value is invalid; the message names the option and the fix."""


def option(default: Any, help: str, flag: str | None = None, choices: tuple | None = None, repeat: bool = False):
    """A config field with its help text (and its CLI flag, allowed values, whether repeats join with commas)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "repeat": repeat})


def _base_type(section_cls: type, f: dataclasses.Field) -> type:
    """The concrete type of a field, with `X | None` reduced to X."""
    hint = typing.get_type_hints(section_cls)[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def coerce(where: str, section_cls: type, f: dataclasses.Field, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    kind = _base_type(section_cls, f)
    if value is None:
        return None
    if set(typing.get_args(typing.get_type_hints(section_cls)[f.name])) == {int, str}:  # a count or a named mode
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: expected a number or a name, got {value!r}")
        return value
    try:
        if kind is bool:
            value = _to_bool(value)
        elif kind is int and not isinstance(value, bool):
            value = int(value) if not isinstance(value, float) or value.is_integer() else _bad()
        elif kind is float and not isinstance(value, bool):
            value = float(value)
        elif kind is str and isinstance(value, str):  # a TOML list or number is not silently made a string
            value = str(value)
        else:
            _bad()
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}") from None
    if kind is float and not math.isfinite(value):  # nan passes every `<` check; no option means inf
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}")
    return value


def _bad():
    raise ValueError


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)
