"""Tensor parallelism through parallelize(), alone and inside data parallelism (ZeRO over dp only).

Every case is AdamW steps with gradient clipping on the same global batches (uneven target
counts per row) as one process. fp64 cases (3 steps, as the pipeline's: the second and third steps' losses and
the parameters read AdamW's moments) make the comparison exact (1e-9) at lr 1e-2, where a gradient summed on the
wrong axis shows at 1e-3 from the first step. fp32 cases (5 steps, as the data-parallel parity cases) must match
one fp32 process within FP32_ADAMW's per-step bounds in loss and parameters; they run at lr 1e-3, because at 1e-2
this tiny model is chaotic in fp32: one fp32 process already drifts ~1e-4 from its fp64 twin by step 20 (while
the first 10 steps of every layout agree to ~2e-7), so any reordering of fp32 sums shows at that level.
All cases of one world size share one launch.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paratrain.mesh import build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, TensorParallel, parallelize
from paratrain.precision import Precision
from paratrain.error_model import FP32_ADAMW, FP64_PARITY
from parallel_cases import (LR, TINY, Layout, adamw, assert_matches_reference, batches, launch_once, make_model, parallel_run,
                             reference_run, variant)

FP64 = Precision("fp64", torch.float64, torch.float64, torch.float64)
FP32_LR = 1e-3
FP64_STEPS = 3
FP32_STEPS = 5


@dataclasses.dataclass(frozen=True)
class Case(Layout):
    tied: bool = False  # the embedding and the output head share their weight

    @property
    def fp64(self) -> bool:
        return self.precision == "fp64"

    @property
    def lr(self) -> float:
        return LR if self.fp64 else FP32_LR

    @property
    def batches(self) -> list:
        return batches()[:FP64_STEPS if self.fp64 else FP32_STEPS]


def _cases(*names: str, tied: bool = False) -> dict[str, Case]:
    return {name + ("_tied" if tied else ""): variant(Case, name, tied=tied) for name in names}


CASES = {
    **_cases("dp2_tp2_fp64", "dp2_tp2_zero1_fp64", "dp2_tp2_sp_zero2_fp64", "dp2_tp2_zero3_fp64"),
    **_cases("dp2_tp2_sp_zero3_fp64", "dp2_tp2_sp_zero1_fp64", tied=True),
    # fp32: on 2 ranks every (sp, tied) pair; on 4 (the costly launch on 2 cores) the two ends of tp 4 and each ZeRO
    # stage of dp 2 × tp 2 under sequence parallelism, tied × 2D once, with the hardest stage (the fp64 cases above
    # check the rest exactly)
    **_cases("tp2", "tp2_sp", "tp4", "dp2_tp2_sp", "dp2_tp2_sp_zero1", "dp2_tp2_sp_zero3"),
    **_cases("tp2", "tp2_sp", "tp4_sp", "dp2_tp2_sp_zero3", tied=True),
}


def _config(case: Case):
    heads = {"n_heads": 8, "n_kv_heads": 4} if case.tp == 4 else {}  # kv heads must divide by tp
    return dataclasses.replace(TINY, tie_embeddings=case.tied, **heads)


def _train(case: Case, mesh):
    """Built on the meta device: parallelize materializes each rank's tp (and, ZeRO-3, dp) slices."""
    with torch.device("meta"):
        model = Transformer(_config(case)).to(torch.float64 if case.fp64 else torch.float32)
    model, optimizer = parallelize(model, mesh, optimizer=functools.partial(adamw, lr=case.lr),
                                   precision=FP64 if case.fp64 else "fp32", init=lambda name,
                                   shape: model.param_init(name, shape, 0),
                                   data=DataParallel(zero=case.zero, grad_reduction="sum"),
                                   tensor=TensorParallel(sequence_parallel=case.sp))
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    losses = parallel_run(model, optimizer, case.batches, dp_rank, dp, lambda t: model.comm.all_reduce(t, "dp"))
    return losses, {k: v.double() for k, v in model.full_state_dict().items()}


def _all_cases(rank, world):  # noqa: ARG001
    meshes: dict = {}
    results = {}
    for name, case in CASES.items():
        if case.world == world:
            shape = case.mesh_shape()
            mesh = meshes[shape] = meshes.get(shape) or build_mesh(shape)
            results[name] = _train(case, mesh)
    return results


_RESULTS = {}
_REFERENCE = {}


def _results(name):
    return [per_rank[name] for per_rank in launch_once(_RESULTS, CASES[name].world, _all_cases)]


def _reference(case: Case, dtype: torch.dtype):
    key = (_config(case), dtype, case.lr, len(case.batches))
    if key not in _REFERENCE:
        model = make_model(_config(case)).to(dtype)
        losses, params = reference_run(model, case.batches, lr=case.lr)
        _REFERENCE[key] = losses, {k: v.double() for k, v in params.items()}
    return _REFERENCE[key]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.fp64])
def test_2d_matches_one_process_in_fp64(name):
    case = CASES[name]
    ref_losses, ref_params = _reference(case, torch.float64)
    for losses, params in _results(name):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP64_PARITY)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.fp64])
def test_fp32_matches_one_process(name):
    """fp32, 5 steps, losses and parameters as one fp32 process's (FP32_ADAMW: per tensor, by its norm)."""
    case = CASES[name]
    ref_losses, ref_params = _reference(case, torch.float32)
    for losses, params in _results(name):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)
