"""`paratrain verify`: does every layout train exactly like one process?

    paratrain verify --model tiny --layouts "dp2,zero3;dp2,zero1;dp2" [--steps 3] [--tol 1e-4]

Runs a few steps of the trainer once as a single process and once per layout
(on as many local processes as the layout's degrees multiply to), all with the
same global batch, and compares the per-step losses and the final parameters.
A layout whose largest relative loss difference, or whose relative parameter
difference ‖θ − θ_ref‖₂ / ‖θ_ref‖₂, exceeds the tolerance FAILs, and the
command exits with code 1. The largest difference of a single parameter
element is printed too but not judged: Adam divides each gradient by its own
running magnitude, so an element whose gradient is almost zero turns
reduction-order rounding into an update of up to the learning rate, in a
correct layout as much as in a wrong one.

A layout is a comma-separated list of tokens (LAYOUT_TOKENS): `dpN`, `tpN`,
`ppN`, `zeroK`, `sp`, a precision (`fp32`, `bf16`, `fp16`), a pipeline
schedule (`gpipe`, `1f1b`, `interleaved`, `zb-h1`) and `vN` (virtual stages). Each sets
one field of the `[parallel]` config section; a token whose field the trainer
does not have yet is refused with a one-line error.

With `--model-factory pkg.module:function` the model is the user's own: the
function returns an `nn.Module` (token ids in, logits out; an `nn.Sequential`
for pipeline layouts) or a `paratrain.ModelSpec` adding its tensor-parallel plan
and loss. Every process calls it and must get the same initial weights (seed
inside the function). The batches are random token ids over the model's
vocabulary (read from one forward), with some targets ignored, the loss a sum
over tokens divided by the global token count; each layout runs the trainer's
step (`paratrain.train.train_step`) through `parallelize`, the reference the
same on one process.

To test this command itself, inject a fault into every layout's processes with
PARATRAIN_FAULT (`paratrain.faults`): `negate_grads@rank1:step*` makes rank 1
negate its gradients before each optimizer step (an engine that reduces
gradients wrongly on one rank), which verify must report as FAIL.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from paratrain.config import Config
from paratrain.faults import FAULT_ENV, parse_faults
from paratrain.parallel.pipeline.schedules import SCHEDULES
from paratrain.errors import ParatrainError



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


# One line per kind of token; a token is usable as soon as ParallelSection has its field.
LAYOUT_TOKENS = (
    LayoutToken(r"dp([1-9]\d*)", "dpN", "dp", lambda m: int(m[1]), "data parallelism"),
    LayoutToken(r"shard([1-9]\d*)", "shardN", "dp_shard", lambda m: int(m[1]), "hybrid sharding (--dp-shard)"),
    LayoutToken(r"tp([1-9]\d*)", "tpN", "tp", lambda m: int(m[1]), "tensor parallelism"),
    LayoutToken(r"pp([1-9]\d*)", "ppN", "pp", lambda m: int(m[1]), "pipeline parallelism"),
    LayoutToken(r"zero([0-3])", "zero0-3", "zero", lambda m: int(m[1]), "ZeRO"),
    LayoutToken(r"sp", "sp", "sequence_parallel", lambda m: True, "sequence parallelism"),
    LayoutToken(r"fp32|bf16|fp16", "fp32/bf16/fp16", "precision", lambda m: m[0], "mixed precision"),
    LayoutToken("|".join(SCHEDULES), "/".join(SCHEDULES), "schedule", lambda m: m[0],
                "pipeline schedules"),
    LayoutToken(r"v([1-9]\d*)", "vN", "virtual_stages", lambda m: int(m[1]), "interleaved virtual stages"),
)
DEGREES = ("dp", "tp", "pp")
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
    return overrides


def num_processes(overrides: dict[str, Any]) -> int:
    """Processes a layout needs: the product of its degrees (dp, tp, pp; 1 when absent)."""
    n = 1
    for axis in DEGREES:
        n *= overrides.get(axis, 1)
    return n


def format_layout(parallel: dict[str, Any]) -> str:
    """A [parallel] section (dict) as layout tokens: 'dp2,zero3,bf16'; defaults are left out."""
    tokens = [f"dp{parallel.get('dp') or 1}"]
    if 0 < (parallel.get("dp_shard") or 0) < (parallel.get("dp") or 1):  # hybrid sharding: ZeRO over groups of N
        tokens.append(f"shard{parallel['dp_shard']}")
    tokens += [f"{axis}{parallel[axis]}" for axis in ("tp", "pp") if (parallel.get(axis) or 1) > 1]
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


# -- running --------------------------------------------------------------------------------


@dataclass
class Comparison:
    """One layout against the single-process reference."""

    layout: str
    processes: int
    loss_rel_diff: float = float("nan")  # largest |loss − reference| / |reference| over the steps
    param_rel_diff: float = float("nan")  # ‖θ − θ_ref‖₂ / ‖θ_ref‖₂ over every parameter
    param_abs_diff: float = float("nan")  # largest |θ − θ_ref| of one element (shown, not judged)
    error: str = ""

    def passed(self, tol: float) -> bool:
        return not self.error and self.loss_rel_diff <= tol and self.param_rel_diff <= tol


def base_config(args, out: Path, overrides: dict[str, Any]) -> Config:
    """The trainer's config for one run: few steps, no sampling or progress bar, the layout's overrides."""
    cfg = Config()
    cfg.model.name = args.model
    cfg.data.path, cfg.data.seq_len = args.data, args.seq_len
    t = cfg.train
    t.steps, t.global_batch, t.seed = args.steps, args.global_batch, args.seed
    # The full learning rate from step 1, so a wrong gradient moves the parameters visibly.
    t.warmup_steps, t.eval_every, t.eval_batches, t.sample_tokens = 0, 0, 1, 0
    cfg.run.out, cfg.run.progress, cfg.run.overwrite = str(out), False, True
    for key, value in overrides.items():
        setattr(cfg.parallel, key, value)
    dp = overrides.get("dp", 1)
    if args.global_batch % dp:
        raise VerifyError(f"--global-batch {args.global_batch} is not divisible by the {dp} data ranks of "
                          f"layout {format_layout(overrides)!r}; choose a multiple of {dp}")
    t.micro_batch = micro_batch(args.global_batch, overrides)
    cfg.run.nproc = num_processes(overrides)
    return cfg


def micro_batch(global_batch: int, overrides: dict[str, Any]) -> int:
    """Rows per micro-batch: one micro-batch per data rank, or pp of them when the layout pipelines."""
    dp, pp = overrides.get("dp", 1), overrides.get("pp", 1)
    per_rank = global_batch // dp
    return per_rank // pp if pp > 1 and per_rank % pp == 0 else per_rank


def run_layout(cfg: Config) -> None:
    """Train `cfg` on its processes (one: in this process; more: through the local launcher)."""
    from paratrain.launch import launch_local
    from paratrain.train import train

    if cfg.run.nproc == 1:
        train(cfg)
    else:
        launch_local(cfg)  # the workers inherit PARATRAIN_FAULT, if set


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


def verify(args, work: Path, log=print) -> list[Comparison]:
    """Run the reference and every layout under `work`; return one Comparison per layout.

    Every configuration is checked before the first process starts, so a bad layout costs
    no training time.
    """
    from paratrain.launch import LaunchFailed
    from paratrain.run.build import preflight

    layouts = [(text.strip(), parse_layout(text)) for text in args.layouts.split(";") if text.strip()]
    if not layouts:
        raise VerifyError("--layouts is empty; give e.g. 'dp2,zero3;dp2'")
    faults = parse_faults(os.environ.get(FAULT_ENV, ""))  # a bad spec fails now, not in every layout
    if faults:
        log(f"fault injection is on ({FAULT_ENV}={os.environ[FAULT_ENV]}): every layout's processes run it")
    if args.model_factory:
        from paratrain.commands.verify_model import verify_factory

        return verify_factory(args, layouts, work, log)
    configs = [base_config(args, work / f"layout{i}", overrides) for i, (_, overrides) in enumerate(layouts)]
    # The reference computes in the layout's precision: one single-process run per precision used.
    references = {cfg.parallel.precision: base_config(args, work / f"reference-{cfg.parallel.precision}",
                                                      {"precision": cfg.parallel.precision}) for cfg in configs}
    for cfg in [*references.values(), *configs]:
        preflight(cfg, cfg.run.nproc)
    for precision, cfg in references.items():
        log(f"reference: 1 process, {precision}, global batch {args.global_batch}, {args.steps} steps")
        run_layout(cfg)
    results = []
    for (text, _), cfg in zip(layouts, configs):
        log(f"{text}: {cfg.run.nproc} process(es)")
        comparison = Comparison(text, cfg.run.nproc)
        try:
            run_layout(cfg)
        except LaunchFailed as e:
            comparison.error = str(e)
        else:
            compare(Path(references[cfg.parallel.precision].run.out), Path(cfg.run.out), comparison)
        results.append(comparison)
    return results


def format_table(results: list[Comparison], tol: float) -> str:
    """The verdict table: layout, processes, largest differences, PASS/FAIL."""
    width = max(len("layout"), *(len(r.layout) for r in results))
    lines = [f"{'layout':<{width}}  procs  max rel loss diff  rel param diff  max abs param diff  result"
             f"  (tolerance {tol:g})"]
    for r in results:
        verdict = "PASS" if r.passed(tol) else "FAIL"
        tail = f"  {r.error}" if r.error else ""
        lines.append(f"{r.layout:<{width}}  {r.processes:>5}  {r.loss_rel_diff:>17.2e}  {r.param_rel_diff:>14.2e}"
                     f"  {r.param_abs_diff:>18.2e}  {verdict}{tail}")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `verify` subcommand to the main CLI's subparsers; returns its parser."""
    parser = subparsers.add_parser("verify", help="check that layouts train like one process", description=(
        "Train a few steps as one process and in each layout with the same global batch; compare "
        "per-step losses and final parameters. Exits 1 if any layout differs beyond --tol."))
    parser.add_argument("--model", default="tiny", help="named model config (default tiny)")
    parser.add_argument("--model-factory", metavar="PKG.MODULE:FUNCTION",
                        help="verify your own model instead: a function (importable from the current "
                             "directory or PYTHONPATH) returning an nn.Module, or a paratrain.ModelSpec with "
                             "its tensor-parallel plan and loss; --data is not used (random token batches)")
    parser.add_argument("--layouts", required=True,
                        help=f"';'-separated layouts of ','-separated tokens ({KNOWN}), e.g. 'dp2,zero3;dp2'")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="largest allowed relative difference of the losses and of the parameters "
                             "(L2 norm) (default 1e-4; bf16 and fp16 layouts round differently from one "
                             "process and need about 1e-2)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, every layout (default 8)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--data", default="default", help="corpus, as for `paratrain train --data` (default: "
                                                          "the standard library's sources)")
    parser.add_argument("--seed", type=int, default=0, help="initialization and data-order seed (default 0)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories in DIR (default: a temporary "
                                                      "directory, removed afterwards)")
    return parser


def run(args) -> int:
    """Run `paratrain verify`: 0 if every layout passes, 1 if one fails (bad input raises: exit 2)."""
    from paratrain.distributed import detect_env

    if args.steps < 1 or args.global_batch < 1 or args.seq_len < 1:
        raise VerifyError("--steps, --global-batch and --seq-len must be at least 1")
    if not args.tol > 0:
        raise VerifyError(f"--tol must be positive, got {args.tol}")
    if detect_env().distributed:
        raise VerifyError("run `paratrain verify` as one process: it launches the layouts' processes itself")
    if args.keep:
        results = verify(args, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as work:
            results = verify(args, Path(work))
    print(format_table(results, args.tol))
    return 0 if all(r.passed(args.tol) for r in results) else 1
