"""2D parallelism: tensor parallel inside data parallel (ZeRO over dp only) against one process.

One launch of 4 ranks (dp2 × tp2) trains every case; each case is 20 AdamW steps with
gradient clipping on the same global batches as one process. fp64 makes the comparison
exact (1e-9): a missing reduction or a gradient summed on the wrong axis shows at 1e-3.
fp32 is checked the way the tensor-parallel tests check it: this tiny, high-lr run is chaotic
in fp32, so the 2D run must stay as close to the fp64 truth as one fp32 process does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import parallelize
from paratrain.precision import Precision
from paratrain.testing import run_on_ranks
from parallel_cases import TINY, adamw, batches, make_model, parallel_run, reference_run

FP64 = Precision("fp64", torch.float64, torch.float64, torch.float64)


@dataclasses.dataclass(frozen=True)
class Case:
    zero: int
    sp: bool = False
    tied: bool = False
    fp64: bool = True


CASES = {
    "dp2_tp2_zero0": Case(0),
    "dp2_tp2_zero1": Case(1),
    "dp2_tp2_zero2_sp": Case(2, sp=True),
    "dp2_tp2_zero3": Case(3),
    "dp2_tp2_zero3_sp_tied": Case(3, sp=True, tied=True),
    "dp2_tp2_zero1_sp_tied": Case(1, sp=True, tied=True),
    "fp32_dp2_tp2_zero3_sp": Case(3, sp=True, fp64=False),
}


def _config(case: Case):
    return dataclasses.replace(TINY, tie_embeddings=case.tied)


def _train(case: Case, mesh):
    """Built on the meta device: parallelize materializes each rank's tp (and, ZeRO-3, dp) slices."""
    with torch.device("meta"):
        model = Transformer(_config(case)).to(torch.float64 if case.fp64 else torch.float32)
    model, optimizer = parallelize(model, mesh, optimizer=adamw, zero=case.zero, grad_reduction="sum",
                                   precision=FP64 if case.fp64 else "fp32", sequence_parallel=case.sp,
                                   init=lambda name, shape: model.param_init(name, shape, 0))
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    losses = parallel_run(model, optimizer, batches(), dp_rank, dp, lambda t: model.comm.all_reduce(t, "dp"))
    return losses, {k: v.double() for k, v in model.full_state_dict().items()}


def _all_cases(rank, world):
    mesh = build_mesh(MeshShape(dp=2, tp=2))
    return {name: _train(case, mesh) for name, case in CASES.items()}


_RESULTS = {}
_REFERENCE = {}


def _results(name):
    if "all" not in _RESULTS:
        try:
            _RESULTS["all"] = run_on_ranks(_all_cases, 4, timeout=400)
        except Exception as error:  # noqa: BLE001 - reported by every test
            _RESULTS["all"] = error
    if isinstance(_RESULTS["all"], Exception):
        raise _RESULTS["all"]
    return [per_rank[name] for per_rank in _RESULTS["all"]]


def _reference(tied: bool, dtype: torch.dtype):
    key = (tied, dtype)
    if key not in _REFERENCE:
        model = make_model(dataclasses.replace(TINY, tie_embeddings=tied)).to(dtype)
        losses, params = reference_run(model, batches())
        _REFERENCE[key] = losses, {k: v.double() for k, v in params.items()}
    return _REFERENCE[key]


def _max_deviation(losses, params, truth):
    ref_losses, ref_params = truth
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return loss, max((params[n] - v).abs().max().item() for n, v in ref_params.items())


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.fp64])
def test_2d_matches_one_process_in_fp64(name):
    case = CASES[name]
    ref_losses, ref_params = _reference(case.tied, torch.float64)
    for losses, params in _results(name):
        assert losses == pytest.approx(ref_losses, rel=1e-9)
        assert params.keys() >= ref_params.keys()
        for key, value in ref_params.items():
            assert torch.allclose(params[key], value, rtol=1e-9, atol=1e-9), \
                f"{key}: max abs difference {(params[key] - value).abs().max().item():.3g}"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.fp64])
def test_2d_fp32_tracks_one_process(name):
    case = CASES[name]
    truth = _reference(case.tied, torch.float64)
    one_fp32 = _reference(case.tied, torch.float32)
    one_loss, one_params = _max_deviation(*one_fp32, truth)
    for losses, params in _results(name):
        assert losses[:10] == pytest.approx(one_fp32[0][:10], rel=1e-5)
        loss_dev, param_dev = _max_deviation(losses, params, truth)
        assert loss_dev <= 4 * one_loss + 1e-6, (loss_dev, one_loss)
        assert param_dev <= 4 * one_params + 1e-6, (param_dev, one_params)
