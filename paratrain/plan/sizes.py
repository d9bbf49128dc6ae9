"""Sizes as people write them on a command line: parameter and token counts ('7.5B'), memory ('80GB', '40GiB').

`paratrain plan` reads --params, --tokens and --gpu-memory with them, `paratrain train` its --mem-budget.
"""

from __future__ import annotations

import re

from paratrain.plan.memory import GB, PlanError

_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_BYTE_UNITS = {"": GB, "B": 1, "KB": 1e3, "MB": 1e6, "GB": GB, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30, "TIB": 2**40}


def parse_count(text: str, flag: str = "--params") -> int:
    """'7.5B' → 7_500_000_000; also K, M, T suffixes and plain integers (underscores and commas allowed)."""
    match = re.fullmatch(r"\s*([0-9][0-9_,]*\.?[0-9]*)\s*([KMBGT]?)\s*", str(text), re.IGNORECASE)
    if not match:
        raise PlanError(f"{flag} {text!r} is not a count; use e.g. 7.5B, 70B, 1T or 6738415616")
    value = float(match.group(1).replace("_", "").replace(",", "")) * _SUFFIXES[match.group(2).upper()]
    if value < 1:
        raise PlanError(f"{flag} {text!r} must be at least 1")
    return int(round(value))


def parse_bytes(text: str, flag: str = "--gpu-memory") -> float:
    """'80GB' → 80e9 bytes (GB = 10⁹, GiB = 2³⁰); a bare number is GB."""
    match = re.fullmatch(r"\s*([0-9]+\.?[0-9]*)\s*([KMGT]?I?B?)\s*", str(text), re.IGNORECASE)
    if not match or match.group(2).upper() not in _BYTE_UNITS or float(match.group(1)) <= 0:
        raise PlanError(f"{flag} {text!r} is not a memory size; use e.g. 80GB, 40GiB or 141")
    return float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]
