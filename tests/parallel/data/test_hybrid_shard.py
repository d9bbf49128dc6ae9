"""Hybrid sharding (HSDP): ZeRO within groups of dp_shard ranks, replicas of the shards across groups.

Every parity case (the hybrid entries of `parallel_cases.LAYOUTS`) is 5 AdamW steps in fp32 with gradient
clipping on the same global batches as one process, at the fp32 learning rate of test_parallel_2d, as the
data-parallel parity cases: losses and final parameters within FP32_ADAMW's per-step bounds. The communication of one step is counted from the tensors that reach torch.distributed
(`paratrain.testing.Collectives`), per mesh axis, against the theory. All cases of one world size
share one launch.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn

from paratrain.mesh import MeshError, MeshShape, build_mesh
from paratrain.parallel.rules import degree_violations
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, ParallelConfigError, TensorParallel, parallelize
from paratrain.testing import Collectives
from paratrain.error_model import FP32_ADAMW
from parallel_cases import (TINY, Layout, adamw, assert_matches_reference, batches, launch_once, layouts, make_model,
                             parallel_run, reference_run)

LR = 1e-3  # fp32: see test_parallel_2d


STEPS = 5  # as test_data_parallel's parity cases: a misplaced reduction moves the loss far beyond the bound
CASES = layouts("hsdp2x2_zero1", "hsdp2x2_zero2", "hsdp2x2_zero3", "m2_hsdp2x2_zero2", "hsdp2x4_zero1",
                "hsdp2x4_zero2", "hsdp2x4_zero3", "hsdp2x2_tp2_zero1", "hsdp2x2_tp2_zero2", "hsdp2x2_tp2_zero3")

# The communication case: Linear layers whose rows divide by every shard group here, so no padding.
WIDTH, LAYERS = 64, 4
PSI = LAYERS * (WIDTH * WIDTH + WIDTH)


def _train(case: Layout, mesh):
    with torch.device("meta"):
        model = Transformer(TINY)
    model, optimizer = parallelize(model, mesh, optimizer=functools.partial(adamw, lr=LR), precision="fp32",
                                   init=lambda name, shape: model.param_init(name, shape, 0),
                                   data=DataParallel(zero=case.zero, grad_reduction="sum"),
                                   tensor=TensorParallel() if case.tp > 1 else None)
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    rows = len(batches(steps=1)[0][0]) // dp
    losses = parallel_run(model, optimizer, batches(steps=STEPS), dp_rank, dp, lambda t: model.comm.all_reduce(t, "dp"),
                          micro=rows // case.microbatches)
    return losses, {k: v.double() for k, v in model.full_state_dict().items()}


def _step_bytes(mesh, zero: int) -> dict[str, float]:
    """Bytes per mesh axis of one training step (the second: the optimizer state exists), as sent."""
    torch.manual_seed(0)
    module = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    model, optimizer = parallelize(module, mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                   data=DataParallel(zero=zero, bucket_mb=0.01))
    counted = Collectives()
    for step in range(2):
        with counted if step else contextlib.nullcontext():
            model(torch.randn(2, WIDTH)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return counted.by_axis(mesh)


def _all_cases(rank, world):  # noqa: ARG001
    meshes: dict = {}
    results = {}
    for name, case in CASES.items():
        if case.world == world:
            shape = case.mesh_shape()
            mesh = meshes[shape] = meshes.get(shape) or build_mesh(shape)
            results[name] = _train(case, mesh)
    shape = MeshShape(dp=world, dp_shard=world // 2)  # 2 replicas of world/2 shards
    mesh = meshes.get(shape) or build_mesh(shape)
    results["bytes"] = {zero: _step_bytes(mesh, zero) for zero in (1, 2, 3)}
    return results


_RESULTS: dict = {}
_REFERENCE: dict = {}


def _results(world: int, name: str):
    return [per_rank[name] for per_rank in launch_once(_RESULTS, world, _all_cases)]


def _reference():
    if not _REFERENCE:
        losses, params = reference_run(make_model(TINY), batches(steps=STEPS), lr=LR)
        _REFERENCE["fp32"] = losses, {k: v.double() for k, v in params.items()}
    return _REFERENCE["fp32"]


def test_the_data_axis_splits_into_replicas_of_neighbouring_shard_groups():
    shape = MeshShape(dp=4, tp=2, dp_shard=2)
    assert shape.dp_replicate == 2
    assert shape.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.groups("dp_shard") == [[0, 2], [4, 6], [1, 3], [5, 7]]  # tp neighbours, then shard neighbours
    assert shape.groups("dp_replicate") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert shape.coords(6) == {"pp": 0, "dp": 3, "cp": 0, "tp": 0, "dp_shard": 1, "dp_replicate": 1,
                                "dp_cp": 3, "ep": 0, "ep_replicate": 3}
    for r in range(shape.world_size):
        c = shape.coords(r)
        assert shape.rank_of(pp=c["pp"], tp=c["tp"], dp_shard=c["dp_shard"], dp_replicate=c["dp_replicate"]) == r
    assert MeshShape(dp=4) == MeshShape(dp=4, dp_shard=4)  # the default: one shard group, no replicas
    with pytest.raises(MeshError, match="--dp-shard 3 must divide the data-parallel degree 4"):
        MeshShape(dp=4, dp_shard=3)
    assert degree_violations(8, 4, 2, 1, dp_shard=2, zero=0)[0].message.startswith("--dp-shard 2 < dp = 4")


def test_ddp_refuses_a_split_data_axis():
    from paratrain.mesh import Mesh

    mesh = Mesh(shape=MeshShape(dp=4, dp_shard=2), rank=0, groups={})
    with pytest.raises(ParallelConfigError, match="needs --zero 1, 2 or 3"):
        parallelize(nn.Linear(4, 4), mesh, data=DataParallel(zero=0))


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_sharding_matches_one_process(name):
    case = CASES[name]
    ref_losses, ref_params = _reference()
    for losses, params in _results(case.world, name):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bytes_per_axis_are_the_theory(world, zero):
    """Per step, fp32: reduce-scatter + all-gather of the whole model within the shard group, an
    all-reduce of the 1/dp_shard shard between replicas. ZeRO-3 gathers in forward and again in
    backward, where only the units whose weights autograd saved are needed: not the first Linear,
    whose input needs no gradient (its weight gradient is grad_out × input), nor the last, which stays
    gathered from its forward into its backward."""
    shard, replicas = world // 2, 2
    full = 4 * PSI
    gathers = 2 - 2 / LAYERS if zero == 3 else 1
    # On gloo ZeRO-1's reduce-scatter, in place, is issued as the all-reduce gloo's sends anyway (comm.py).
    reduced = 2 if zero == 1 else 1
    expected = {"dp_shard": (reduced + gathers) * full * (shard - 1) / shard,
                "dp_replicate": 2 * (full / shard) * (replicas - 1) / replicas}
    for per_rank in _results(world, "bytes"):
        measured = per_rank[zero]
        for axis, theory in expected.items():
            assert measured[axis] == pytest.approx(theory, rel=0.01), (axis, measured)
        assert measured.get("dp", 0) < 0.01 * full  # only the used-parameter counts cross the whole data axis


def test_context_parallel_rules_name_the_fix():
    from paratrain.parallel.rules import LayoutSpec, layout_violations

    assert layout_violations(LayoutSpec(dp=2, cp=2, zero=3, seq_len=128, world_size=4)) == []
    (bad,) = layout_violations(LayoutSpec(dp=1, cp=2, seq_len=126))
    assert bad.message == ("--seq-len 126 is not divisible by 2 × --cp = 4 (each rank holds 2 load-balanced "
                           "chunks); use --seq-len 124")
    assert layout_violations(LayoutSpec(dp=1, cp=2, tp=2, sequence_parallel=True, seq_len=64)) == []
    assert layout_violations(LayoutSpec(dp=1, cp=2, pp=2, activation_checkpointing="full", seq_len=64)) == []
    assert layout_violations(LayoutSpec(dp=4, cp=2, zero=3, dp_shard=2))[0].rule == "cp_dp_shard"
    assert "dp × cp × tp × pp = 1 × 2 × 1 × 1 = 2 ≠ 4 ranks" in layout_violations(
        LayoutSpec(dp=1, cp=2, world_size=4))[0].message
