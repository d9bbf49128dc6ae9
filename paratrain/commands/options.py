"""Command-line options derived from the config dataclasses: one name, type, choices and help per option.

`paratrain train` takes every config field as a flag (`--section.field` spelled `--field-name`, or
the field's own `flag`); `plan` and `verify` take the ones they share with it through the same
function, so an option is spelled, typed and explained the same in every command. A command may
keep older spellings as aliases, give its own default, or say what it does without the option.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable, Mapping

from paratrain.config import Config, iter_options, load_toml
from paratrain.option_values import coerce


def add_config_options(parser, keys: Iterable[str] | None = None, *, aliases: Mapping[str, tuple[str, ...]] = {},
                       defaults: Mapping[str, Any] = {}, notes: Mapping[str, str] = {}) -> None:
    """One flag per config field, help taken from the field.

    keys: the options to add, as "section.field", into `parser` (an argument group, say) in this
        order; None: every field, each section in its own group (`paratrain train`).
    aliases: other spellings kept for an option (e.g. `plan`'s --seq for --seq-len).
    defaults: this command's default of an option (then always set); notes: what the help says of
        the default of an option the command fills itself. Any other option the user leaves out is
        absent from the parsed namespace (`given_options`).
    """
    options = {f"{section}.{f.name}": (section, cls, f, flag) for section, cls, f, flag in iter_options()}
    groups = {}
    for key in options if keys is None else keys:
        section, cls, f, flag = options[key]
        target = parser
        if keys is None:
            target = groups.get(section) or groups.setdefault(
                section, parser.add_argument_group(f"[{section}] options"))
        kwargs = dict(dest=key, default=defaults.get(key, argparse.SUPPRESS), help=_help(f, key, defaults, notes))
        spellings = (flag, *aliases.get(key, ()))
        if isinstance(f.default, bool):
            target.add_argument(*spellings, action=argparse.BooleanOptionalAction, **kwargs)
        elif f.default is None and _optional_bool(cls, f):  # --x alone is true, --x false, --no-x; unset: the default
            target.add_argument(*spellings, metavar="BOOL", nargs="?", const="true", **kwargs)
            target.add_argument("--no-" + flag[2:], dest=key, action="store_const", const="false",
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif f.metadata.get("repeat"):
            target.add_argument(*spellings, metavar=f.name.upper(), action=_Joined, **kwargs)
        else:
            target.add_argument(*spellings, metavar=f.name.upper(), **kwargs)


def _optional_bool(cls: type, f) -> bool:
    import typing
    return set(typing.get_args(typing.get_type_hints(cls)[f.name])) == {bool, type(None)}


class _Joined(argparse.Action):
    """A repeatable option: each use adds its value to the ones before, comma-separated."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if not isinstance(before, str) or not before else f"{before},{values}")


def _help(f, key: str, defaults: Mapping[str, Any], notes: Mapping[str, str]) -> str:
    text = f.metadata["help"]
    choices = f.metadata.get("choices")
    allowed = f"; one of {', '.join(str(c) if c != '' else repr(c) for c in choices)}" if choices else ""
    if key in defaults or key in notes:  # the command's own default replaces the one the field describes
        text = text[:text.rfind(" (default:")] if text.endswith(")") and " (default:" in text else text
        return f"{text}{allowed} (default: {notes[key] if key in notes else defaults[key]})"
    shown = "auto" if f.default is None else "none" if f.default == "" else f.default  # '' is an option left off
    return f"{text}{allowed}" + ("" if "(default:" in text else f" (default: {shown})")


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config options on `args` ({"section.field": value}), each converted to its field's type (ConfigError)."""
    values = vars(args)
    return {f"{section}.{f.name}": coerce(flag, section_cls, f, values[f"{section}.{f.name}"])
            for section, section_cls, f, flag in iter_options() if f"{section}.{f.name}" in values}


def config_from_args(args: argparse.Namespace) -> Config:
    """Defaults, then the TOML file (--config), then the command line."""
    data = load_toml(args.config) if getattr(args, "config", None) else {}
    for key, value in given_options(args).items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    return Config.from_dict(data)
