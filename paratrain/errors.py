"""The errors paratrain raises on purpose, under one base class, and the shape of a broken layout rule.

Two kinds, told apart by their exit code (what `paratrain` exits with):

* `ParatrainError` itself (exit 2): input the user can fix — a flag, a config value, a model a
  strategy cannot split, a damaged checkpoint named on the command line. The message is one
  line naming the field and the fix. Each module's error class derives from it (and from
  ValueError or RuntimeError, as its callers expect).
* `RunFailure` (exit 1): a run that started and then failed — a rank died, a collective timed
  out, too many non-finite steps. The message is one line saying which rank and why.

The command line catches `ParatrainError` alone and prints the message; anything else is a bug
and keeps its traceback. paratrain's own warnings are one line there too (`one_line_warnings`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from dataclasses import dataclass


@contextlib.contextmanager
def one_line_warnings(command: str):
    """Inside, paratrain's own warnings print as one line, `paratrain COMMAND: warning: ...`, as its errors do (the
    command line, and each process it launches); anything else as Python shows it."""
    with warnings.catch_warnings():
        warnings.showwarning = functools.partial(_one_line, command, warnings.showwarning)
        yield


def _one_line(command: str, default, message, category, filename, lineno, file=None, line=None) -> None:
    if f"{os.sep}paratrain{os.sep}" in filename:
        print(f"paratrain {command}: warning: {message}", file=file or sys.stderr)
    else:
        default(message, category, filename, lineno, file, line)


class ParatrainError(Exception):
    """An error paratrain raises on purpose; `exit_code` is what the command line exits with."""

    exit_code = 2


class DataError(ParatrainError, ValueError):
    """Bad data configuration or input (a path, a tokenizer spec, a batch size)."""


class RunFailure(ParatrainError, RuntimeError):
    """A run that had started failed; the one-line message says where and why."""

    exit_code = 1


@dataclass(frozen=True)
class Violation:
    """One broken layout rule: a short rule name (for grouping) and the one-line reason.

    Each rule is one function that returns its violations; `paratrain plan` lists them for
    every candidate layout, `paratrain train` and `parallelize` raise the first.
    """

    rule: str
    message: str
