"""Layouts written as tokens, and a layout's run compared with the one-process reference.

What both `paratrain verify` commands share (`paratrain.commands.verify` on the reference model,
`paratrain.commands.verify_model` on the user's own): the layout grammar, the processes and
micro-batches a layout runs with, its layout rules, and the comparison that judges it.

A layout is a comma-separated list of tokens (LAYOUT_TOKENS): `dpN`, `shardN`, `epN` (expert ranks are data ranks: `ep2` alone is dp 2), `tpN`, `ppN`,
`zeroK`, `sp`, a precision (`fp32`, `bf16`, `fp16`), a pipeline schedule (`gpipe`, `1f1b`,
`interleaved`, `zb-h1`) and `vN` (virtual stages). Each sets one field of the `[parallel]`
config section, whose values it takes (ZeRO stages, precisions, schedules).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from paratrain.config import ParallelSection
from paratrain.error_model import default_bound
from paratrain.errors import ParatrainError
from paratrain.parallel.pipeline.schedules import SCHEDULES
from paratrain.parallel.rules import ZERO_STAGES, LayoutSpec


class VerifyError(ParatrainError, ValueError):
    """Bad input to `paratrain verify`; the message names the option or token and the fix."""


@dataclass(frozen=True)
class LayoutToken:
    """One kind of layout token: how it is written, the [parallel] field it sets, how to read its value."""

    pattern: str
    spelling: str  # for help and error messages
    field: str
    value: Callable[[re.Match], Any]
    what: str  # for the "not supported yet" message


def _choices(name: str) -> tuple:
    """The values the [parallel] option `name` allows (its config field's choices)."""
    return next(f.metadata["choices"] for f in dataclasses.fields(ParallelSection) if f.name == name)


_PRECISIONS = _choices("precision")

# One line per kind of token; a token is usable as soon as ParallelSection has its field.
LAYOUT_TOKENS = (
    LayoutToken(r"dp([1-9]\d*)", "dpN", "dp", lambda m: int(m[1]), "data parallelism"),
    LayoutToken(r"shard([1-9]\d*)", "shardN", "dp_shard", lambda m: int(m[1]), "hybrid sharding (--dp-shard)"),
    LayoutToken(r"tp([1-9]\d*)", "tpN", "tp", lambda m: int(m[1]), "tensor parallelism"),
    LayoutToken(r"pp([1-9]\d*)", "ppN", "pp", lambda m: int(m[1]), "pipeline parallelism"),
    LayoutToken(r"cp([1-9]\d*)", "cpN", "cp", lambda m: int(m[1]), "context parallelism"),
    LayoutToken(r"ep([1-9]\d*)", "epN", "ep", lambda m: int(m[1]), "expert parallelism"),
    LayoutToken(f"zero({'|'.join(map(str, ZERO_STAGES))})", f"zero{ZERO_STAGES[0]}-{ZERO_STAGES[-1]}", "zero",
                lambda m: int(m[1]), "ZeRO"),
    LayoutToken(r"sp", "sp", "sequence_parallel", lambda m: True, "sequence parallelism"),
    LayoutToken("|".join(_PRECISIONS), "/".join(_PRECISIONS), "precision", lambda m: m[0], "mixed precision"),
    LayoutToken("|".join(SCHEDULES), "/".join(SCHEDULES), "schedule", lambda m: m[0], "pipeline schedules"),
    LayoutToken(r"v([1-9]\d*)", "vN", "virtual_stages", lambda m: int(m[1]), "interleaved virtual stages"),
)
DEGREES = ("dp", "tp", "pp", "cp")
KNOWN = ", ".join(kind.spelling for kind in LAYOUT_TOKENS)


def parse_layout(text: str) -> dict[str, Any]:
    """'dp2,zero3' → {'dp': 2, 'zero': 3}: [parallel] overrides; raise VerifyError on a bad token."""
    overrides: dict[str, Any] = {}
    tokens = [t.strip() for t in text.split(",")]
    if not any(tokens):
        raise VerifyError(f"--layouts: empty layout {text!r}; write e.g. 'dp2,zero3'")
    for token in tokens:
        kind, match = next(((k, m) for k in LAYOUT_TOKENS if (m := re.fullmatch(k.pattern, token.lower()))),
                           (None, None))
        if kind is None:
            raise VerifyError(f"--layouts: unknown token {token!r} in {text!r}; known tokens: {KNOWN}")
        if kind.field in overrides:
            raise VerifyError(f"--layouts: {text!r} sets {kind.field} twice; keep one of its tokens")
        overrides[kind.field] = kind.value(match)
    if overrides.get("ep", 1) > 1 and "dp" not in overrides:  # expert ranks are data ranks: ep2 alone is dp2
        overrides["dp"] = overrides["ep"]
    return overrides


def num_processes(overrides: dict[str, Any]) -> int:
    """Processes a layout needs: the product of its degrees (dp, tp, pp, cp; 1 when absent)."""
    n = 1
    for axis in DEGREES:
        n *= overrides.get(axis) or 1
    return n


def format_layout(parallel: dict[str, Any]) -> str:
    """A [parallel] section (dict) as layout tokens: 'dp2,zero3,bf16'; defaults are left out."""
    tokens = [f"dp{parallel.get('dp') or 1}"]
    if 0 < (parallel.get("dp_shard") or 0) < (parallel.get("dp") or 1):  # hybrid sharding: ZeRO over groups of N
        tokens.append(f"shard{parallel['dp_shard']}")
    tokens += [f"{axis}{parallel[axis]}" for axis in ("ep", "cp", "tp", "pp") if (parallel.get(axis) or 1) > 1]
    if parallel.get("zero"):
        tokens.append(f"zero{parallel['zero']}")
    if parallel.get("sequence_parallel"):
        tokens.append("sp")
    if parallel.get("precision", "fp32") != "fp32":
        tokens.append(parallel["precision"])
    if (parallel.get("pp") or 1) > 1 and parallel.get("schedule"):
        tokens.append(parallel["schedule"])
        if (parallel.get("virtual_stages") or 1) > 1:
            tokens.append(f"v{parallel['virtual_stages']}")
    return ",".join(tokens)


def micro_batch(global_batch: int, layout: dict[str, Any], given: int | None = None) -> int:
    """Rows per micro-batch: `given`, else one micro-batch per data rank, or pp of them when the layout pipelines.

    VerifyError when the global batch does not split over the layout's data ranks.
    """
    dp, pp = layout.get("dp") or 1, layout.get("pp") or 1
    if global_batch % dp:
        raise VerifyError(f"--global-batch {global_batch} is not divisible by the {dp} data ranks of layout "
                          f"{format_layout(layout)!r}; choose a multiple of {dp}")
    if given is not None:
        return given
    per_rank = global_batch // dp
    return per_rank // pp if pp > 1 and per_rank % pp == 0 else per_rank


def layout_spec(layout: dict[str, Any], global_batch: int, seq_len: int, given_micro_batch=None,
                model=None) -> LayoutSpec:
    """One parsed layout (`parse_layout`) as the rules read it (`paratrain.parallel.rules.check_layout` decides it)."""
    names = {f.name for f in dataclasses.fields(LayoutSpec)}
    options = {k: v for k, v in layout.items() if k in names and v is not None}
    options["dp"] = options.get("dp") or 1
    return LayoutSpec(**options, world_size=num_processes(layout), model=model, global_batch=global_batch,
                      micro_batch=micro_batch(global_batch, layout, given_micro_batch), seq_len=seq_len)


# -- judging --------------------------------------------------------------------------------------

@dataclass
class Comparison:
    """One layout against the single-process reference."""

    layout: str
    processes: int
    loss_rel_diff: float = float("nan")  # largest |loss − reference| / |reference| over the steps
    param_rel_diff: float = float("nan")  # ‖θ − θ_ref‖₂ / ‖θ_ref‖₂ over every parameter
    param_abs_diff: float = float("nan")  # largest |θ − θ_ref| of one element (shown, not judged)
    error: str = ""
    loss_bound: float = float("nan")  # what judges the two differences (`Bound`)
    param_bound: float = float("nan")
    bound: str = ""  # which bound, and why

    def passed(self) -> bool:
        return not self.error and self.loss_rel_diff <= self.loss_bound and self.param_rel_diff <= self.param_bound

    def judge_by(self, layout: dict[str, Any], steps: int, tol: float | None, optimizer: str = "adamw") -> Comparison:
        """Set the bounds this layout is judged by: `tol` for both when given, else the error model of its precision,
        FP8 recipe and optimizer (`paratrain.error_model.default_bound`) over `steps` optimizer steps."""
        if tol is not None:
            self.loss_bound = self.param_bound = tol
            self.bound = f"--tol {tol:g}"
            return self
        model = default_bound(layout.get("precision") or "fp32", layout.get("fp8") or "", optimizer)
        self.loss_bound, self.param_bound = model.bounds(steps)
        self.bound = (f"{model.name}: {model.loss_rtol:g} (loss) and {model.param_rtol:g} (parameters) per step"
                      f"{'' if steps == 1 else f' x {steps} steps'}; {model.why}")
        return self


def compare(reference: Path, candidate: Path, comparison: Comparison) -> Comparison:
    """Fill in the largest loss and parameter differences between two run directories."""
    from safetensors.torch import load_file

    from paratrain.metrics import read_metrics

    ref_losses = [r["loss"] for r in read_metrics(reference / "metrics.jsonl")]
    losses = [r["loss"] for r in read_metrics(candidate / "metrics.jsonl")]
    if len(losses) != len(ref_losses):
        comparison.error = f"{len(losses)} steps logged, the reference has {len(ref_losses)}"
        return comparison
    comparison.loss_rel_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    ref_params = load_file(reference / "final" / "model.safetensors")
    params = load_file(candidate / "final" / "model.safetensors")
    if params.keys() != ref_params.keys():
        comparison.error = "the final weights have different parameter names"
        return comparison
    diffs = [(params[k] - ref_params[k]).flatten() for k in ref_params]
    comparison.param_abs_diff = max(float(d.abs().max()) for d in diffs)
    reference_norm = math.sqrt(sum(float(p.double().square().sum()) for p in ref_params.values()))
    comparison.param_rel_diff = math.sqrt(sum(float(d.double().square().sum()) for d in diffs)) / reference_norm
    return comparison
