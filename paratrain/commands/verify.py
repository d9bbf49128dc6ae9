"""`paratrain verify`: does every layout train exactly like one process?

    paratrain verify --model tiny --layouts "dp2,zero3;dp2,zero1;dp2" [--steps 3] [--tol TOL] [--optimizer muon]

Runs a few steps of the trainer once as a single process and once per layout
(on as many local processes as the layout's degrees multiply to), all with the
same global batch, and compares the per-step losses and the final parameters.
A layout whose largest relative loss difference, or whose relative parameter
difference ‖θ − θ_ref‖₂ / ‖θ_ref‖₂, exceeds its bound FAILs, and the
command exits with code 1. The bounds are the error model of the layout's
precision and FP8 recipe (`paratrain.error_model.default_bound`: per optimizer
step, times --steps; the parity tests assert the same model), or --tol for both;
the table names the bound each layout was judged by and why. The largest difference of a single parameter
element is printed too but not judged: Adam divides each gradient by its own
running magnitude, so an element whose gradient is almost zero turns
reduction-order rounding into an update of up to the learning rate, in a
correct layout as much as in a wrong one. With `--optimizer muon` the bound is also
Muon's (`paratrain.error_model.MUON`): its Newton–Schulz iteration rounds each update to
bf16 in every run, so a correct fp32 layout may differ by about bf16's unit roundoff.

A layout is a comma-separated list of tokens (`paratrain.verify.LAYOUT_TOKENS`): `dpN`, `shardN`,
`tpN`, `ppN`, `zeroK`, `sp`, a precision (`fp32`, `bf16`, `fp16`), a pipeline schedule (`gpipe`,
`1f1b`, `interleaved`, `zb-h1`) and `vN` (virtual stages). Each sets one field of the `[parallel]`
config section. The options verify shares with `paratrain train` (`--model`, `--global-batch`,
`--seq-len`, `--zero`, `--precision`, ...) are the trainer's, with verify's defaults; a
`[parallel]` option given on the command line applies to every layout whose tokens leave it.

With `--model-factory pkg.module:function` the model is the user's own: the
function returns an `nn.Module` (token ids in, logits out; an `nn.Sequential`
for pipeline layouts) or a `paratrain.ModelSpec` adding its tensor-parallel plan
and loss. Every process calls it and must get the same initial weights (seed
inside the function). The batches are random token ids over the model's
vocabulary (read from one forward), with some targets ignored, the loss a sum
over tokens divided by the global token count; each layout runs the trainer's
step (`paratrain.train.train_step`) through `parallelize`, the reference the
same on one process.

`--fp8 RECIPE` (with `--precision bf16`) runs every layout and the reference with FP8 linears; each
matmul's scales come from its own operands, so the reference then runs the layout's micro-batches.

To test this command itself, inject a fault into every layout's processes with
PARATRAIN_FAULT (`paratrain.faults`): `negate_grads@rank1:step*` makes rank 1
negate its gradients before each optimizer step (an engine that reduces
gradients wrongly on one rank), which verify must report as FAIL.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from paratrain.commands.options import add_config_options, given_options
from paratrain.config import Config
from paratrain.faults import FAULT_ENV, parse_faults
from paratrain.verify import (KNOWN, Comparison, VerifyError, compare, micro_batch, num_processes,
                              parse_layout)

# The options shared with `paratrain train` (the trainer's flags and help) and verify's defaults of them.
SHARED = ("model.name", "model.n_layers", "model.dim", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
          "train.steps", "train.global_batch", "train.micro_batch", "data.seq_len", "data.path", "train.seed",
          "train.optimizer")
LAYOUT_OPTIONS = ("parallel.dp", "parallel.dp_shard", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.zero",
                  "parallel.sequence_parallel", "parallel.precision", "parallel.reduce_dtype", "parallel.schedule",
                  "parallel.virtual_stages", "parallel.activation_checkpointing", "parallel.bucket_mb", "parallel.fp8",
                  "parallel.offload")
DEFAULTS = {"train.steps": 3, "train.global_batch": 8, "data.seq_len": 64}


# -- running --------------------------------------------------------------------------------


def base_config(given: dict[str, Any], out: Path, layout: dict[str, Any]) -> Config:
    """The trainer's config for one run: the shared options, few steps, no sampling or progress bar, the layout."""
    data: dict[str, dict] = {}
    for key, value in given.items():
        section, name = key.split(".")
        if section != "parallel":  # the layout (the options' and the tokens') comes whole below
            data.setdefault(section, {})[name] = value
    cfg = Config.from_dict(data)
    t = cfg.train
    # The full learning rate from step 1, so a wrong gradient moves the parameters visibly.
    t.warmup_steps, t.eval_every, t.eval_batches, t.sample_tokens = 0, 0, 1, 0
    cfg.run.out, cfg.run.progress, cfg.run.overwrite = str(out), False, True
    for key, value in layout.items():
        setattr(cfg.parallel, key, value)
    t.micro_batch = micro_batch(t.global_batch, layout, given.get("train.micro_batch"))
    cfg.run.nproc = num_processes(layout)
    return cfg


def run_layout(cfg: Config) -> None:
    """Train `cfg` on its processes (one: in this process; more: through the local launcher)."""
    from paratrain.launch import launch_local
    from paratrain.train import train

    if cfg.run.nproc == 1:
        train(cfg)
    else:
        launch_local(cfg)  # the workers inherit PARATRAIN_FAULT, if set


def verify(args, work: Path, log=print) -> list[Comparison]:
    """Run the reference and every layout under `work`; return one Comparison per layout.

    Every configuration is checked before the first process starts, so a bad layout costs
    no training time.
    """
    from paratrain.launch import LaunchFailed
    from paratrain.run.build import preflight

    given = given_options(args)
    every = {key.split(".")[1]: value for key, value in given.items() if key.startswith("parallel.")}
    layouts = [(text.strip(), {**every, **parse_layout(text)}) for text in args.layouts.split(";") if text.strip()]
    if not layouts:
        raise VerifyError("--layouts is empty; give e.g. 'dp2,zero3;dp2'")
    faults = parse_faults(os.environ.get(FAULT_ENV, ""))  # a bad spec fails now, not in every layout
    if faults:
        log(f"fault injection is on ({FAULT_ENV}={os.environ[FAULT_ENV]}): every layout's processes run it")
    steps, optimizer = given["train.steps"], given.get("train.optimizer", "adamw")
    if args.model_factory:
        from paratrain.commands.verify_model import verify_factory

        results = verify_factory(args.model_factory, given, layouts, work, log)
        return [r.judge_by(layout, steps, args.tol, optimizer) for r, (_, layout) in zip(results, layouts)]
    configs = [base_config(given, work / f"layout{i}", layout) for i, (_, layout) in enumerate(layouts)]
    # The reference computes in the layout's precision: one single-process run per precision used. Under FP8
    # each matmul's scales come from its own operands, so the reference also runs the layout's micro-batches.
    references = {_reference_key(cfg): _reference(given, work, cfg) for cfg in configs}
    # The layout rules (paratrain.parallel.rules), before anything runs; each runs with the options it resolved.
    references = {key: preflight(cfg, cfg.run.nproc).cfg for key, cfg in references.items()}
    configs = [preflight(cfg, cfg.run.nproc).cfg for cfg in configs]
    for key, cfg in references.items():
        log(f"reference: 1 process, {' '.join(str(k) for k in key if k)}, global batch {cfg.train.global_batch}, "
            f"{cfg.train.steps} steps")
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
            compare(Path(references[_reference_key(cfg)].run.out), Path(cfg.run.out), comparison)
        results.append(comparison.judge_by({"precision": cfg.parallel.precision, "fp8": cfg.parallel.fp8}, steps,
                                           args.tol, cfg.train.optimizer))
    return results


def _reference_key(cfg: Config) -> tuple:
    """What a layout's reference shares with it: the precision; under FP8 the recipe and the micro-batch."""
    p = cfg.parallel
    return (p.precision, p.fp8, f"micro-batch {cfg.train.micro_batch}") if p.fp8 else (p.precision,)


def _reference(given: dict[str, Any], work: Path, cfg: Config) -> Config:
    key = _reference_key(cfg)
    layout = {"precision": cfg.parallel.precision, **({"fp8": cfg.parallel.fp8} if cfg.parallel.fp8 else {})}
    if cfg.parallel.fp8:
        given = {**given, "train.micro_batch": cfg.train.micro_batch}
    return base_config(given, work / ("reference-" + "-".join(str(k).replace(" ", "") for k in key)), layout)


def format_table(results: list[Comparison]) -> str:
    """The bounds used, each with why; then the verdict table: layout, processes, largest differences, PASS/FAIL and
    the bounds the layout was judged by (marked [n] when the layouts were judged by different ones)."""
    width = max(len("layout"), *(len(r.layout) for r in results))
    notes = list(dict.fromkeys(r.bound for r in results))
    lines = [f"bound{f' [{i}]' if len(notes) > 1 else ''}: {note}" for i, note in enumerate(notes, 1)]
    lines.append(f"{'layout':<{width}}  procs  max rel loss diff  rel param diff  max abs param diff  result"
                 f"  loss bound  param bound")
    for r in results:
        verdict = "PASS" if r.passed() else "FAIL"
        tail = f"  {r.error}" if r.error else ""
        mark = f" [{notes.index(r.bound) + 1}]" if len(notes) > 1 else ""
        lines.append(f"{r.layout:<{width}}  {r.processes:>5}  {r.loss_rel_diff:>17.2e}  {r.param_rel_diff:>14.2e}"
                     f"  {r.param_abs_diff:>18.2e}  {verdict:<6}  {r.loss_bound:>10.2e}  {r.param_bound:>11.2e}"
                     f"{mark}{tail}")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `verify` subcommand to the main CLI's subparsers; returns its parser."""
    parser = subparsers.add_parser("verify", help="check that layouts train like one process", description=(
        "Train a few steps as one process and in each layout with the same global batch; compare "
        "per-step losses and final parameters. Exits 1 if any layout differs beyond --tol."))
    parser.add_argument("--model-factory", metavar="PKG.MODULE:FUNCTION",
                        help="verify your own model instead: a function (importable from the current "
                             "directory or PYTHONPATH) returning an nn.Module, or a paratrain.ModelSpec with "
                             "its tensor-parallel plan and loss; --data is not used (random token batches)")
    parser.add_argument("--layouts", required=True,
                        help=f"';'-separated layouts of ','-separated tokens ({KNOWN}), e.g. 'dp2,zero3;dp2'")
    parser.add_argument("--tol", type=float, default=None,
                        help="largest allowed relative difference of the losses and of the parameters (L2 norm) "
                             "(default: the error model of the layout's precision and FP8 recipe, per step times "
                             "--steps, paratrain.error_model; the table names the bound used and why)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories in DIR (default: a temporary "
                                                      "directory, removed afterwards)")
    add_config_options(parser.add_argument_group("options of `paratrain train`, every run's"), SHARED,
                       defaults=DEFAULTS, notes={"train.micro_batch": "the global batch per data rank, over pp "
                                                                      "micro-batches when the layout pipelines"})
    add_config_options(parser.add_argument_group("[parallel] options of `paratrain train`, every layout's unless "
                                                 "its tokens set them"), LAYOUT_OPTIONS)
    return parser


def run(args) -> int:
    """Run `paratrain verify`: 0 if every layout passes, 1 if one fails (bad input raises: exit 2)."""
    from paratrain.distributed import detect_env

    given = given_options(args)
    if min(given["train.steps"], given["train.global_batch"], given["data.seq_len"]) < 1:
        raise VerifyError("--steps, --global-batch and --seq-len must be at least 1")
    if args.tol is not None and not args.tol > 0:
        raise VerifyError(f"--tol must be positive, got {args.tol}")
    if detect_env().distributed:
        raise VerifyError("run `paratrain verify` as one process: it launches the layouts' processes itself")
    if args.keep:
        results = verify(args, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as work:
            results = verify(args, Path(work))
    print(format_table(results))
    return 0 if all(r.passed() for r in results) else 1
