"""What `paratrain report` puts beside the measurements: the planner's estimate for a run's own config.

The run's resolved config becomes the planner's (Workload, Layout); its communication per axis marks
the comm figure, and its step time and breakdown stand next to the measured medians in the summary.
A `Run` is `paratrain.commands.report.Run`.
"""

from __future__ import annotations

import dataclasses
import statistics

from paratrain.parallel.rules import FP8_CUDA_MIN_FEATURES


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


_MODEL_SIZES = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")


def planned_inputs(run: Run):
    """(Workload, Layout) of the run's resolved config for the planner; None for an older or partial config.

    `parallel.dp_shard` makes it a hybrid-sharded layout, whose data-parallel communication the
    planner gives per axis (dp_shard, dp_replicate) as the runtime records it.

    Activation checkpointing is the planner's mode of the same name ("selective", "full" or 1); every k-th
    block for k > 1 is counted as none (`Checkpointing.planned`: the planner recomputes all blocks or none).
    """
    from paratrain.models import get_model_config
    from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE
    from paratrain.parallel.rules import Checkpointing
    from paratrain.plan import Layout, Workload
    from paratrain.plan.lora import run_options

    c = run.config
    try:
        p, t, m, lora = c["parallel"], c["train"], c["model"], c.get("lora", {})
        sizes = {k: m[k] for k in _MODEL_SIZES if m.get(k) is not None}
        model = dataclasses.replace(get_model_config(m["name"]), **sizes)
        workload = Workload.for_model(model, seq_len=c["data"]["seq_len"], global_batch=t["global_batch"],
                                      precision=p.get("precision", "fp32"), reduce_dtype=p.get("reduce_dtype"),
                                      **_fp8_options(run),
                                      **run_options(model, lora.get("rank"), lora.get("base_dtype"), lora.get("targets")))
        pp = p.get("pp") or 1
        layout = Layout(dp=run.dp, tp=p.get("tp") or 1, pp=pp, zero=p.get("zero", 0), dp_shard=p.get("dp_shard") or 0,
                        micro_batch=t["micro_batch"], sequence_parallel=bool(p.get("sequence_parallel")),
                        recompute=Checkpointing.parse(p.get("activation_checkpointing") or 0).planned,
                        schedule=p.get("schedule") or DEFAULT_SCHEDULE, cp=p.get("cp") or 1, ep=p.get("ep") or 1,
                        virtual_stages=(p.get("virtual_stages") or 1) if pp > 1 else 1,
                        bucket_mb=p.get("bucket_mb") or 25.0, compile=bool(p.get("compile")))
    except (KeyError, TypeError, ValueError):  # an older or hand-written config: no estimate
        return None
    return workload, layout


def _fp8_options(run: Run) -> dict:
    """The run's FP8 recipe for the planner: its linears (parallelize's default floor on features is CUDA's 1024,
    none on the CPU; a run on CUDA logs the caching allocator's reserved bytes, a CPU run none)."""
    p = run.config["parallel"]
    if not p.get("fp8"):
        return {}
    minimum = p.get("fp8_min_features", -1)
    if minimum is None or minimum < 0:
        on_cuda = any(r.get("reserved_mem_bytes") for r in run.records)
        minimum = FP8_CUDA_MIN_FEATURES if on_cuda else 0
    return {"fp8": p["fp8"], "fp8_min_features": minimum}


def planned_comm(run: Run) -> dict[str, int] | None:
    """Bytes per step per axis that the planner estimates for the run's model and layout (None: unknown)."""
    from paratrain.plan import comm_bytes_per_rank

    inputs = planned_inputs(run)
    return comm_bytes_per_rank(*inputs) if inputs else None


def measured_breakdown(run: Run) -> dict[str, float] | None:
    """Medians over the steps of the step time and of each part of `time_breakdown_s` (None: not logged)."""
    rows = [r for r in run.records if isinstance(r.get("time_breakdown_s"), dict) and r.get("step_time_s")]
    if not rows:
        return None
    parts = [r["time_breakdown_s"] for r in rows]
    axes = sorted({axis for b in parts for axis in (b.get("comm_exposed_s") or {})})
    out = {"step": median_or_none([r["step_time_s"] for r in rows]),
           "compute": median_or_none([b.get("compute_s", 0.0) for b in parts]),
           "optimizer": median_or_none([b.get("optimizer_s", 0.0) for b in parts]),
           "pipeline": median_or_none([b.get("pipeline_wait_s", 0.0) for b in parts]),
           "other": median_or_none([sum(b.get(k, 0.0) for k in ("data_s", "checkpoint_s", "other_s")) for b in parts])}
    for axis in axes:
        out[f"comm {axis}"] = median_or_none([(b.get("comm_exposed_s") or {}).get(axis, 0.0) for b in parts])
    return out


def predicted_step(run: Run, hardware):
    """The planner's StepTime for the run's config on `hardware` (None when the config is not understood)."""
    from paratrain.plan import step_time

    inputs = planned_inputs(run)
    return step_time(*inputs, hardware) if inputs else None


def format_prediction(run: Run, hardware) -> list[str]:
    """Predicted against measured step time and breakdown, one line per part."""
    measured, predicted = measured_breakdown(run), predicted_step(run, hardware)
    if measured is None or predicted is None:
        return ["  predicted step time: n/a (the run logs no time breakdown, or its config is not understood)"]
    predicted_comm = {**predicted.dp_comm_by_axis, "tp": predicted.tp_comm, "world": predicted.sync}
    comm_axes = sorted({k.split()[1] for k in measured if k.startswith("comm ")} | set(predicted.dp_comm_by_axis)
                       | {"tp"})
    rows = [("compute", measured["compute"], predicted.compute)]
    rows += [(f"exposed comm {axis}", measured.get(f"comm {axis}", 0.0), predicted_comm.get(axis, 0.0))
             for axis in comm_axes]
    rows += [("pipeline wait (bubble + pp comm)", measured["pipeline"], predicted.bubble + predicted.pp_comm),
             ("optimizer", measured["optimizer"], predicted.optimizer),
             ("data, checkpoint, other", measured["other"], None)]
    lines = [f"  step time: measured median {measured['step']:.3f} s, predicted {predicted.total:.3f} s "
             f"({predicted.total / measured['step']:.2f}× the measured) on {hardware.name}",
             f"    {'part':<34}{'measured s':>11}{'predicted s':>12}"]
    lines += [f"    {name:<34}{m:>11.3f}{'-' if p is None else f'{p:.3f}':>12}" for name, m, p in rows]
    return lines
