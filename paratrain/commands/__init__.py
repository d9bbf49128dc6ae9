"""The subcommands of `paratrain`, one module each, with one convention.

Each module has `add_parser(subparsers)`, which registers the command and its options (every
option with its --help text), and `run(args) -> int`, which does the work and returns the exit
code. Bad input raises a `paratrain.errors.ParatrainError`; `paratrain.cli.main` prints its one
line and exits with its code, so no command catches errors of its own.

`COMMANDS` imports a command's module when it is first looked up: a command that needs no
tensors (`paratrain plan`, `paratrain models`) answers without importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

NAMES = ("train", "prepare", "models", "plan", "report", "verify", "export")


class _Commands(Mapping):
    """{name: command module}, each module imported on first lookup."""

    def __getitem__(self, name: str) -> ModuleType:
        if name not in NAMES:
            raise KeyError(name)
        return importlib.import_module(f"paratrain.commands.{name}")

    def __iter__(self):
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)


COMMANDS = _Commands()

__all__ = ["COMMANDS", "NAMES"]
