"""Tensor parallelism through parallelize(), alone and inside data parallelism (ZeRO over dp only).

Every case is AdamW steps with gradient clipping on the same global batches (uneven target
counts per row) as one process. fp64 cases (8 steps) make the comparison exact (1e-9) at lr 1e-2, where a
gradient summed on the wrong axis shows at 1e-3 from the first step. fp32 cases (20 steps) must match one fp32 process within
1e-5 in loss and parameters; they run at lr 1e-3, because at 1e-2 this tiny model is chaotic in
fp32: one fp32 process already drifts ~1e-4 from its fp64 twin by step 20 (while the first 10
steps of every layout agree to ~2e-7), so any reordering of fp32 sums shows at that level.
All cases of one world size share one launch.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, TensorParallel, parallelize
from paratrain.precision import Precision
from paratrain.error_model import FP32_ADAMW, FP64_PARITY
from parallel_cases import (LR, TINY, adamw, assert_matches_reference, batches, launch_once, make_model, parallel_run,
                             reference_run)

FP64 = Precision("fp64", torch.float64, torch.float64, torch.float64)
FP32_LR = 1e-3
FP64_STEPS = 8


@dataclasses.dataclass(frozen=True)
class Case:
    zero: int
    sp: bool = False
    tied: bool = False
    fp64: bool = True
    dp: int = 2
    tp: int = 2

    @property
    def lr(self) -> float:
        return LR if self.fp64 else FP32_LR

    @property
    def batches(self) -> list:
        return batches()[:FP64_STEPS] if self.fp64 else batches()


def _fp32_matrix():
    """On 2 ranks every (sp, tied) pair; on 4 (the costly launch on 2 cores) the two ends of tp 4 and each ZeRO
    stage of dp 2 × tp 2 under sequence parallelism (the fp64 cases above check the rest exactly)."""
    cases = {}
    for tp, dp in ((2, 1), (4, 1), (2, 2)):
        for sp in (False, True):
            for tied in (False, True):
                for zero in ((0, 1, 3) if dp > 1 else (0,)):
                    if dp > 1 and (not sp or (tied and zero != 3)):
                        continue  # tied × 2D once, with the hardest stage
                    if tp == 4 and sp != tied:
                        continue
                    name = f"fp32_dp{dp}_tp{tp}{'_sp' if sp else ''}{'_tied' if tied else ''}_zero{zero}"
                    cases[name] = Case(zero, sp, tied, fp64=False, dp=dp, tp=tp)
    return cases


CASES = {
    "dp2_tp2_zero0": Case(0),
    "dp2_tp2_zero1": Case(1),
    "dp2_tp2_zero2_sp": Case(2, sp=True),
    "dp2_tp2_zero3": Case(3),
    "dp2_tp2_zero3_sp_tied": Case(3, sp=True, tied=True),
    "dp2_tp2_zero1_sp_tied": Case(1, sp=True, tied=True),
    **_fp32_matrix(),
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
        if case.dp * case.tp == world:
            shape = MeshShape(dp=case.dp, tp=case.tp)
            mesh = meshes[shape] = meshes.get(shape) or build_mesh(shape)
            results[name] = _train(case, mesh)
    return results


_RESULTS = {}
_REFERENCE = {}


def _results(name):
    return [per_rank[name] for per_rank in launch_once(_RESULTS, CASES[name].dp * CASES[name].tp, _all_cases)]


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
    """fp32, 20 steps, losses and parameters as one fp32 process's (FP32_ADAMW: per tensor, by its norm)."""
    case = CASES[name]
    ref_losses, ref_params = _reference(case, torch.float32)
    for losses, params in _results(name):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)
