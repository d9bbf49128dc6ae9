"""The subcommands of `paratrain`, one module each, with one convention.

Each module has `add_parser(subparsers)`, which registers the command and its options (every
option with its --help text), and `run(args) -> int`, which does the work and returns the exit
code. Bad input raises a `paratrain.errors.ParatrainError`; `paratrain.cli.main` prints its one
line and exits with its code, so no command catches errors of its own.
"""

from paratrain.commands import export, models, plan, prepare, report, train, verify

COMMANDS = {"train": train, "prepare": prepare, "models": models, "plan": plan, "report": report,
            "verify": verify, "export": export}

__all__ = ["COMMANDS"]
