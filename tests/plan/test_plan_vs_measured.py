"""The planner's numbers against the engines': per-rank model state and communication of one step.

For every layout the data-parallel tests run (dp 2 and 4, ZeRO 0-3, fp32 and bf16), the
planner's params, grads, fp32 master and Adam moments (and their total) must agree with the
bytes of the tensors that exist on a rank after a step, and its dp bytes per step with what
paratrain.comm counted, within 10%. The tensor, sequence, pipeline and context-parallel layouts the
other parity tests run are checked the same way, per mesh axis. Both sides see the same model and batch.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, PipelineParallel, TensorParallel, parallelize
from paratrain.plan import Layout, Workload, comm_bytes_per_rank, estimate_memory
from paratrain.plan.memory import ScheduleName
from parallel_cases import BATCH, SEQ, TINY, adamw, batches, launch_once
from test_data_parallel import _one_measured_step

# (zero, precision, gradient dtype): the trainer's default reduces bf16 gradients in fp32.
CASES = [(zero, precision, reduce_dtype) for precision, reduce_dtype in
         [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")] for zero in (0, 1, 2, 3)]
WORLDS = [2, 4]
TOLERANCE = 0.10

_MEASURED: dict = {}


def _measure_all(rank, world):
    """Every case of this file that runs on `world` ranks, in one launch (a launch costs seconds; a case
    milliseconds): the data-parallel cases, and on 4 ranks the tensor and pipeline layouts, on 2 ZeRO-3's."""
    out = {"dp": [_one_measured_step(rank, world, zero, precision, reduce_dtype)
                  for zero, precision, reduce_dtype in CASES]}
    if world == 4:
        out["layouts"] = {name: _measure_layout(layout, name) for name, layout in LAYOUTS_4.items()}
    if world == 2:
        out["zero3"] = [_zero3_step(*case) for case in ZERO3_CASES]
    return out


def launched(world: int) -> list[dict]:
    """Every rank's `_measure_all` on `world` ranks, launched once."""
    return launch_once(_MEASURED, world, _measure_all, timeout=300)


def measured(world: int) -> dict[tuple, tuple[int, dict]]:
    """{case: (dp bytes sent by rank 0, rank 0's resident model state)} for `world` ranks."""
    return dict(zip(CASES, launched(world)[0]["dp"]))


def planned(world: int, zero: int, precision: str, reduce_dtype: str) -> tuple[dict[str, float], float]:
    """(model-state bytes by kind, dp bytes sent) per rank, as `paratrain plan` estimates them."""
    workload = Workload.for_model(TINY, seq_len=SEQ, global_batch=BATCH, precision=precision,
                                  reduce_dtype=reduce_dtype)
    layout = Layout(dp=world, zero=zero, micro_batch=BATCH // world)
    m = estimate_memory(workload, layout)
    state = {"params": m.params, "grads": m.grads, "master": m.master_weights, "optimizer": m.adam_moments}
    if precision != "fp32" and reduce_dtype != "fp32" and zero < 3:
        # Beyond the paper (its docstring says so): fp32 copies of the masters' gradients while the
        # optimizer steps (DDP / ZeRO-1), ZeRO-2's shard summed in fp32.
        psi = TINY.num_params()
        state["grads"] += 4 * psi / (world if zero >= 1 else 1) if zero < 2 else 2 * psi / world
    state["total"] = sum(state.values())
    return state, comm_bytes_per_rank(workload, layout)["dp"]


def _agrees(measured: float, planned: float) -> bool:
    return measured == pytest.approx(planned, rel=TOLERANCE, abs=1)


@pytest.mark.parametrize("world", WORLDS)
def test_model_state_and_communication_match_the_planner(world):
    wrong = []
    for case, (sent, resident) in measured(world).items():
        state, comm = planned(world, *case)
        kinds = [k for k in state if not _agrees(resident[k], state[k])]
        if kinds or not _agrees(sent, comm):
            wrong.append(f"dp{world} zero{case[0]} {case[1]} ({case[2]} grads): measured {resident}, planned "
                         f"{ {k: round(v) for k, v in state.items()} }; comm {sent:,} measured, {comm:,} planned")
    assert not wrong, "\n".join(["planner and engines disagree by more than 10%:", *wrong])


# -- tensor and pipeline layouts: communication per axis and model state ------------------------

EIGHT_LAYERS = dataclasses.replace(TINY, n_layers=8)
LAYOUTS_4 = {  # name: (Layout, global batch rows per micro-batch on each data rank)
    "tp4": Layout(tp=4, micro_batch=BATCH),
    "dp2_tp2_zero1": Layout(dp=2, tp=2, zero=1, micro_batch=BATCH // 2),
    "dp2_tp2_sp_zero3": Layout(dp=2, tp=2, zero=3, sequence_parallel=True, micro_batch=BATCH // 2),
    "pp4_1f1b": Layout(pp=4, micro_batch=2),
    "pp2_dp2_gpipe_zero1": Layout(pp=2, dp=2, zero=1, micro_batch=2, schedule=ScheduleName.GPIPE),
    # a head tied to the embedding: the table's ZeRO-1 rows of gradient summed over pp once per step
    "pp2_dp2_gpipe_zero1_tied": Layout(pp=2, dp=2, zero=1, micro_batch=2, schedule=ScheduleName.GPIPE),
    "pp2_tp2_sp_interleaved": Layout(pp=2, tp=2, sequence_parallel=True, micro_batch=2,
                                     schedule=ScheduleName.INTERLEAVED, virtual_stages=2),
    # the ring's K/V sends on cp, ZeRO-1 over the dp × cp ranks on dp_cp
    "dp2_cp2_zero1": Layout(dp=2, cp=2, zero=1, micro_batch=2),
}


def _config_for(layout: Layout, name: str = ""):
    if name.endswith("_tied"):
        return dataclasses.replace(EIGHT_LAYERS, tie_embeddings=True)
    if layout.cp > 1:  # the reference model repeats K/V to the query heads before SDPA on the CPU: the ring carries
        return dataclasses.replace(EIGHT_LAYERS, n_kv_heads=EIGHT_LAYERS.n_heads)  # H heads, which Hk = H plans
    return dataclasses.replace(EIGHT_LAYERS, n_heads=8, n_kv_heads=4) if layout.tp == 4 else EIGHT_LAYERS


def _measure_layout(layout: Layout, name: str):
    """Two steps; comm bytes per axis of the second (pipeline shapes are agreed in the first) and model state."""
    mesh = build_mesh(MeshShape(pp=layout.pp, dp=layout.dp, tp=layout.tp, cp=layout.cp))
    with torch.device("meta"):
        model = Transformer(_config_for(layout, name))
    model, optimizer = parallelize(model, mesh, optimizer=adamw, init=lambda name,
                                   shape: model.param_init(name, shape, 0),
                                   data=DataParallel(zero=layout.zero, grad_reduction="sum"),
                                   tensor=TensorParallel(sequence_parallel=layout.sequence_parallel),
                                   pipeline=PipelineParallel(schedule=layout.schedule.value, virtual_stages=layout.virtual_stages))
    rows = BATCH // layout.dp
    for x, y in batches(steps=2):
        x, y = (t[mesh.coord("dp") * rows:(mesh.coord("dp") + 1) * rows] for t in (x, y))
        micro = [(x[i:i + layout.micro_batch], y[i:i + layout.micro_batch]) for i in range(0, rows, layout.micro_batch)]
        tokens = model.comm_sum(torch.tensor(float((y != -100).sum()))).item()
        model.comm.reset()
        if layout.pp > 1:
            model.train_step(micro, tokens)
        else:
            for i, (xs, ys) in enumerate(micro):
                with model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    (model.loss_fn(model(xs), ys) / tokens).backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        resident = model.resident_bytes(optimizer)  # gradients still held, as at the step's peak
        optimizer.zero_grad(set_to_none=True)
    return model.comm.bytes_by_axis(), resident


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_tensor_and_pipeline_layouts_match_the_planner(name):
    """Per axis, the busiest rank's bytes per step; per rank, params + grads + optimizer state (incl. master)."""
    layout = LAYOUTS_4[name]
    per_rank = [result["layouts"][name] for result in launched(4)]
    workload = Workload.for_model(_config_for(layout, name), seq_len=SEQ, global_batch=BATCH, precision="fp32",
                                  reduce_dtype="fp32")
    planned_comm = comm_bytes_per_rank(workload, layout)
    for axis in planned_comm:  # dp (dp_cp under cp), tp, pp, and cp under cp
        measured_axis = max(comm.get(axis, 0) for comm, _ in per_rank)
        assert _agrees(measured_axis, planned_comm[axis]), (axis, measured_axis, planned_comm[axis])
    m = estimate_memory(workload, layout)
    planned_state = m.params + m.grads + m.master_weights + m.adam_moments
    measured_state = max(resident["total"] for _, resident in per_rank)
    assert _agrees(measured_state, planned_state), (measured_state, planned_state)


# -- ZeRO-3 with tied and untied embeddings, fp32, bf16 and FP8 ----------------------------------------------------

ZERO3_CASES = [(tied, precision, fp8) for tied in (True, False)
               for precision, fp8 in (("fp32", None), ("bf16", None), ("bf16", "tensorwise"))]
ZERO3_TOLERANCE = 0.05


def _zero3_step(tied: bool, precision: str, fp8: str | None):
    """dp bytes rank 0 sends in the second of two steps (two micro-batches each), as the trainer runs ZeRO-3: bf16
    gradients reduced in fp32, FP8 on every block linear (the CPU's floor on features)."""
    mesh = build_mesh(MeshShape(dp=2))
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    with torch.device("meta"):
        model = Transformer(cfg)
    model, optimizer = parallelize(model, mesh, optimizer=adamw,
                                   init=lambda name, shape: model.param_init(name, shape, 0),
                                   data=DataParallel(zero=3, grad_reduction="sum"), precision=precision,
                                   reduce_dtype="fp32", fp8=fp8, fp8_min_features=0 if fp8 else None)
    rows, micro = BATCH // 2, BATCH // 4
    for x, y in batches(steps=2):
        x, y = (t[mesh.coord("dp") * rows:(mesh.coord("dp") + 1) * rows] for t in (x, y))
        model.comm.reset()
        for i in range(0, rows, micro):
            (model.loss_fn(model(x[i:i + micro]), y[i:i + micro]) / 100).backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.comm.bytes_by_axis()


@pytest.mark.parametrize("case", ZERO3_CASES, ids=lambda c: f"{'tied' if c[0] else 'untied'}-{c[1]}-{c[2] or 'no fp8'}")
def test_zero3_bytes_per_axis_match_the_planner_tied_or_not(case):
    """The embedding and the head are ZeRO-3 units of their own, each gathered once per micro-batch (the embedding's
    backward reads only its indices, the head stays gathered into its backward); a tied table is in both units."""
    tied, precision, fp8 = case
    measured = launched(2)[0]["zero3"][ZERO3_CASES.index(case)]
    workload = Workload.for_model(dataclasses.replace(TINY, tie_embeddings=tied), seq_len=SEQ, global_batch=BATCH,
                                  precision=precision, reduce_dtype="fp32", fp8=fp8, fp8_min_features=0)
    planned = comm_bytes_per_rank(workload, Layout(dp=2, zero=3, micro_batch=BATCH // 4))
    assert planned["dp"] > 0
    for axis, bytes_ in planned.items():  # dp, and tp and pp with nothing on them
        got = measured.get(axis, 0)
        assert got == pytest.approx(bytes_, rel=ZERO3_TOLERANCE, abs=1), f"{axis}: measured {got:,}, planned {bytes_:,}"
