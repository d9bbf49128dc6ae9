"""`paratrain verify --model-factory pkg.module:function`: the layouts checked on the user's own model.

Each run (the one-process reference and every layout) is its own set of processes under torch's
elastic agent; each process calls the factory, parallelizes what it returns for the layout,
trains `--steps` steps of the same random global batches with the trainer's own step
(`paratrain.train.train_step`), and rank 0 writes the losses (`metrics.jsonl`) and the final
weights (`final/model.safetensors`) that `paratrain.verify.compare` reads. Every layout's rules
(`paratrain.parallel.rules`) are checked before the first process starts.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from paratrain.config import TrainSection
from paratrain.parallel import rules
from paratrain.parallel.api import ModelSpec
from paratrain.verify import Comparison, VerifyError, compare, layout_spec, micro_batch, num_processes

LR = 1e-2  # the full rate from step 1, so a wrong gradient moves the parameters visibly


def load_factory(path: str):
    """The function `pkg.module:function` names; VerifyError when it cannot be imported or called."""
    module_name, _, function = path.partition(":")
    if not module_name or not function:
        raise VerifyError(f"--model-factory {path!r}: write it as pkg.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's module beside them
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise VerifyError(f"--model-factory {path!r}: cannot import {module_name} ({e})") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise VerifyError(f"--model-factory {path!r}: {module_name} has no function {function!r}")
    return factory


def build_spec(path: str) -> ModelSpec:
    """Call the factory; its module, plan and loss as a ModelSpec (one-line errors for anything else)."""
    made = load_factory(path)()
    spec = made if isinstance(made, ModelSpec) else ModelSpec(made) if isinstance(made, nn.Module) else None
    if spec is None or not isinstance(spec.module, nn.Module):
        raise VerifyError(f"--model-factory {path!r} returned a {type(made).__name__}; return an nn.Module or a "
                          "paratrain.ModelSpec(module, plan=..., loss_fn=...)")
    return spec


def vocabulary(spec: ModelSpec, seq_len: int) -> int:
    """The model's vocabulary: the last dim of its output for one sequence of token 0."""
    with torch.no_grad():
        out = spec.module(torch.zeros(1, seq_len, dtype=torch.long))
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise VerifyError(f"the model returned {type(out).__name__}; --model-factory models take token ids "
                          "[batch, seq] and return logits [batch, seq, vocab] (or an object with .logits)")
    return logits.shape[-1]


def batches(vocab: int, steps: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic global batches; rows keep different numbers of target tokens (the rest ignored)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        keep = torch.randint(1, seq + 1, (batch,), generator=g)
        y[torch.arange(seq)[None, :] >= keep[:, None]] = -100
        out.append((x, y))
    return out


def verify_factory(factory: str, given: dict[str, Any], layouts: list[tuple[str, dict[str, Any]]], work: Path,
                   log=print) -> list[Comparison]:
    """Run the one-process reference and every layout on the user's model; one Comparison per layout.

    `given`: the options shared with `paratrain train` ({"train.steps": 3, ...}, as `verify` parsed them).
    """
    from paratrain.launch import LaunchFailed

    spec = build_spec(factory)  # fails here, once, before any process starts
    base = {"factory": factory, "steps": given["train.steps"], "global_batch": given["train.global_batch"],
            "micro_batch": given.get("train.micro_batch"), "seq_len": given["data.seq_len"],
            "seed": given.get("train.seed", TrainSection().seed), "optimizer": given.get("train.optimizer", "adamw"),
            "vocab": vocabulary(spec, given["data.seq_len"])}
    for text, layout in layouts:
        _check_layout(text, layout, spec, base)
    jobs = {precision: {**base, "layout": {"precision": precision}, "out": str(work / f"reference-{precision}")}
            for precision in {o.get("precision", "fp32") for _, o in layouts}}
    for precision, job in jobs.items():
        log(f"reference: 1 process, {precision}, global batch {base['global_batch']}, {base['steps']} steps")
        _launch(job, 1)
    results = []
    for i, (text, overrides) in enumerate(layouts):
        job = {**base, "layout": overrides, "out": str(work / f"layout{i}")}
        comparison = Comparison(text, num_processes(overrides))
        log(f"{text}: {comparison.processes} process(es)")
        try:
            _launch(job, comparison.processes)
        except LaunchFailed as e:
            comparison.error = str(e)
        else:
            compare(Path(jobs[overrides.get("precision", "fp32")]["out"]), Path(job["out"]), comparison)
        results.append(comparison)
    return results


def _launch(job: dict, nproc: int) -> None:
    """One run on `nproc` processes; LaunchFailed naming the first rank that failed."""
    from paratrain.launch import LaunchFailed, describe_failure, launch_processes

    try:
        launch_processes(_worker, job, nproc)
    except ChildFailedError as e:
        raise LaunchFailed(describe_failure(e)) from None


def _check_layout(text: str, layout: dict[str, Any], spec: ModelSpec, job: dict) -> None:
    """What the user's model needs for the layout (a plan for tp, a Sequential for pp), then the layout rules."""
    tp, pp = (layout.get(axis) or 1 for axis in ("tp", "pp"))
    if tp > 1 and spec.plan is None:
        raise VerifyError(f"layout {text!r} has tp={tp} but the factory gave no tensor-parallel plan; return "
                          "paratrain.ModelSpec(module, plan={pattern: style}) (see paratrain.parallel.tensor.plan)")
    if pp > 1 and not isinstance(spec.module, nn.Sequential):
        raise VerifyError(f"layout {text!r} has pp={pp}: pipeline parallelism splits an nn.Sequential, and the "
                          f"factory returned a {type(spec.module).__name__}")
    try:
        rules.check_layout(layout_spec(layout, job["global_batch"], job["seq_len"], job["micro_batch"]))
    except rules.LayoutRuleError as e:
        raise VerifyError(f"layout {text!r}: {e}") from None


def _given(layout: dict[str, Any], *names: str) -> dict[str, Any]:
    return {name: layout[name] for name in names if name in layout}


@record
def _worker(job: dict) -> None:
    """Each process of one run: the user's model under the layout, trained by the trainer's step."""
    from paratrain.distributed import shutdown

    try:
        run(job)
    finally:
        shutdown()


def _optimizer(name: str):
    """AdamW at verify's learning rate, or with --optimizer muon the Muon recipe (torch's Muon defaults, AdamW at LR
    for the rest), both without weight decay."""
    if name == "muon":
        from paratrain.parallel.muon import MuonRecipe

        return MuonRecipe(muon={"weight_decay": 0.0}, adamw={"lr": LR, "weight_decay": 0.0})
    return functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.0)


def run(job: dict) -> None:
    from paratrain.checkpoint.files import write_safetensors

    from paratrain import DataParallel, PipelineParallel, TensorParallel, init_mesh
    from paratrain.parallel.api import parallelize_run
    from paratrain.comm import Comm
    from paratrain.faults import faulty
    from paratrain.train import train_step

    layout = job["layout"]
    mesh = init_mesh(dp=layout.get("dp") or 1, tp=layout.get("tp") or 1, pp=layout.get("pp") or 1,
                     dp_shard=layout.get("dp_shard") or None, cp=layout.get("cp") or 1)
    spec = build_spec(job["factory"])
    given = functools.partial(_given, layout)  # the layout's [parallel] options, the rest left to the defaults
    comm = Comm(mesh)  # the one the model communicates through, which an injected fault uses too
    model, optimizer = parallelize_run(
        spec.module, mesh, optimizer=_optimizer(job.get("optimizer", "adamw")),
        data=DataParallel(grad_reduction="sum", **given("zero", "bucket_mb")),
        tensor=TensorParallel(plan=spec.plan, **given("sequence_parallel")),
        pipeline=PipelineParallel(**given("schedule", "virtual_stages")),
        **given("precision", "reduce_dtype", "activation_checkpointing"), comm=comm)
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    rows, micro = job["global_batch"] // dp, micro_batch(job["global_batch"], layout, job.get("micro_batch"))
    records = []
    for step, (x, y) in enumerate(batches(job["vocab"], job["steps"], job["global_batch"], job["seq_len"],
                                          job["seed"]), start=1):
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        pieces = [(x[i:i + micro], y[i:i + micro]) for i in range(0, rows, micro)]
        step_fn = faulty(train_step, comm, mesh.rank, step)  # PARATRAIN_FAULT's faults: how verify is tested
        outcome = step_fn(model, optimizer, pieces, 1.0, loss_fn=spec.loss_fn)
        records.append({"step": step, "loss": outcome.loss})
    out = Path(job["out"])
    shapes, weights = model.full_shapes(), model.full_parameters()  # collective: every rank iterates
    if mesh.rank != 0:
        for _ in weights:
            pass
    else:
        (out / "final").mkdir(parents=True, exist_ok=True)
        (out / "final" / "model.safetensors").unlink(missing_ok=True)
        entries = [(name, torch.float32, shape) for name, shape in shapes.items()]
        write_safetensors(out / "final" / "model.safetensors", entries, ((k, v.cpu()) for k, v in weights))
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

