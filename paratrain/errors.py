"""The errors paratrain raises on purpose, under one base class, and the shape of a broken layout rule.

Two kinds, told apart by their exit code (what `paratrain` exits with):

* `ParatrainError` itself (exit 2): input the user can fix — a flag, a config value, a model a
  strategy cannot split, a damaged checkpoint named on the command line. The message is one
  line naming the field and the fix. Each module's error class derives from it (and from
  ValueError or RuntimeError, as its callers expect).
* `RunFailure` (exit 1): a run that started and then failed — a rank died, a collective timed
  out, too many non-finite steps. The message is one line saying which rank and why.

The command line catches `ParatrainError` alone and prints the message; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


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
