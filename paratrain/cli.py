"""The `paratrain` command: a thin layer over the Python API, one module per subcommand (`paratrain.commands`).

    paratrain train [--config FILE] [--steps N ...]   train (one process, --nproc N, or under torchrun/srun)
    paratrain prepare --data PATH --out DIR          tokenize a corpus into memory-mapped token files
    paratrain models [--json]                        list the named model configs and their sizes
    paratrain plan --model NAME (--gpus N | --dp --tp --pp --zero ...)   estimate memory and time; search layouts
    paratrain report RUN_DIR [...]                   figures and a summary of finished runs
    paratrain verify --layouts "dp2,zero3;dp2"       check layouts against one process
    paratrain export RUN_OR_CKPT OUT                 write a run's weights as a Hugging Face Llama directory

Every error paratrain raises on purpose is a `ParatrainError`: it ends with one line on stderr
and its exit code (2 for bad input, 1 for a run that failed), never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from paratrain.commands import COMMANDS
from paratrain.errors import ParatrainError, RunFailure, one_line_warnings


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line (and exit code 2), without the usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line of every command, or of `only` (its module alone imported: see `paratrain.commands`)."""
    parser = _Parser(prog="paratrain", description="Train large language models across many processes.")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in [only] if only else COMMANDS:
        COMMANDS[name].add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        with one_line_warnings(args.command):
            return COMMANDS[args.command].run(args)
    except ParatrainError as e:
        # A run that failed says where itself; bad input is an "error:" the user can fix.
        print(f"paratrain {args.command}: {'' if isinstance(e, RunFailure) else 'error: '}{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"paratrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
