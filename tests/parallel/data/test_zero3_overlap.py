"""ZeRO-3's gathers in the order CUDA would run them, traced on the CPU under CUDA's policy.

Under CUDA's policy (`DataParallel(prefetch=True)`, one reduce-scatter left in flight:
`parallel_cases.OverlapTrace`) a gather that nothing needs is bandwidth taken from the reduce-scatters
beside it, and a gather that nothing overlaps holds up the compute stream. The trace names each
all-gather and each free by its unit, and marks the end of each forward; the parameters after the
steps are one process's.
"""

from __future__ import annotations


from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, parallelize, parallelize_run
from paratrain.testing import run_on_ranks
from paratrain.error_model import FP32_ADAMW
from parallel_cases import (OverlapTrace, adamw, assert_matches_reference, batches, make_model, parallel_run,
                             reference_run)

STEPS = 2  # the second forward follows the order the first recorded


def _trace_units(engine, comm: OverlapTrace) -> None:
    """Mark each unit's all-gathers and frees (of a gathered or arriving buffer) in the trace."""
    for unit in engine.units:
        launch, free = unit.launch_gather, unit.free

        def traced_launch(*args, _unit=unit, _launch=launch):
            comm.mark("gather", _unit.name)
            return _launch(*args)

        def traced_free(_unit=unit, _free=free):
            if _unit.full is not None or _unit.pending:
                comm.mark("free", _unit.name)
            return _free()

        unit.launch_gather, unit.free = traced_launch, traced_free


def _zero3_steps(rank, world):
    mesh = build_mesh(MeshShape(dp=world))
    comm = OverlapTrace(mesh)
    model, optimizer = parallelize_run(make_model(), mesh, optimizer=adamw, comm=comm,
                                       data=DataParallel(zero=3, prefetch=True, grad_reduction="sum"))
    _trace_units(model.engine, comm)
    # Around the engine's own hooks: "forward" before its first gather, "forward done" once it ended the forward.
    model.module.register_forward_pre_hook(lambda *_: comm.mark("forward"), prepend=True)
    model.module.register_forward_hook(lambda *_: comm.mark("forward done"))
    losses = parallel_run(model, optimizer, batches(steps=STEPS), rank, world, lambda t: comm.all_reduce(t, "dp"))
    steps: list[list[tuple]] = []  # each step's events, from its forward to the next one
    for event in comm.events:
        if event == ("forward",):
            steps.append([])
        if steps:
            steps[-1].append(event)
    return steps, {k: v.detach().clone() for k, v in model.full_state_dict().items()}, losses


_RESULTS: list = []


def _results():
    if not _RESULTS:
        _RESULTS.extend(run_on_ranks(_zero3_steps, 2, timeout=120))
    return _RESULTS


def test_zero3_backward_gathers_no_embedding_and_still_reduces_its_gradient():
    """The embedding's backward reads only the indices: no all-gather of it after the forward; its
    gradient is reduce-scattered like every unit's."""
    units = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    for steps, _, _ in _results():
        assert len(steps) == STEPS
        for trace in steps:
            backward = trace[trace.index(("forward done",)) + 1:]
            assert ("gather", "tok_embeddings") not in backward, backward
            assert [e for e in trace if e[0] == "gather"][:len(units)] == [("gather", u) for u in units]
            assert sum(1 for e in backward if e[:2] == ("launch", "reduce_scatter")) == len(units)


def test_zero3_keeps_the_last_forward_unit_gathered_into_backward():
    """The output head ends the forward and begins the backward: it is gathered once per step and freed
    only once its backward is done, not freed and gathered again between the passes."""
    for steps, _, _ in _results():
        for trace in steps:
            done = trace.index(("forward done",))
            assert trace.count(("gather", "output")) == 1 and trace.index(("gather", "output")) < done, trace
            assert trace.index(("free", "output")) > done, trace


def test_zero3_under_the_cuda_policy_matches_one_process():
    ref_losses, reference = reference_run(make_model(), batches(steps=STEPS))
    for _, params, losses in _results():
        assert_matches_reference(losses, params, ref_losses, reference, FP32_ADAMW)
