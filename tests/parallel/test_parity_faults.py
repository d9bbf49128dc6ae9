"""The parity bounds catch real bugs: one injected per strategy, each fails its parity comparison.

The error model (paratrain.error_model's FP32_ADAMW, FP64_PARITY) compares parameters per tensor by their norm, never
element by element, so that rounding on another processor cannot push a correct layout across it. This checks
the other side: a layout with the bug of a gradient summed twice still fails, by its losses and by its
parameters alone. Each fault counts rank 0's share twice in the one place its strategy combines gradients (or,
for the pipeline, the gradient a stage hands back), in the same runs, through the same comparison, that the
strategy's parity test makes. Measured: losses off by 2e-3 (experts) to 3e-2 (tensor parallel), 300x to 1,600x
their bounds; the worst tensor off by 15% (pipeline) to 120% (tensor parallel) of its norm, 300x to 1,300x.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import pytest
import torch

from paratrain.comm import Comm
from paratrain.error_model import BF16_ADAMW, FP32_ADAMW, FP32_ADAMW_MODEL_STRAY, FP64_PARITY
from parallel_cases import assert_matches_reference, batches, launch_once

# The pipeline's faulty run trains 6 steps, not its parity case's 3 (exact in fp64, where 3 show a wrong gradient):
# the bf16 bound `paratrain verify` judges by grows with the steps, and a doubled input gradient of one stage
# outgrows it only after more than 3. Its model has 8 blocks (4 a stage), not the parity case's 2: under one block
# a stage the doubled gradient reaches too few weights to outgrow that bound in 6 steps.
PIPELINE_STEPS = 6
PIPELINE_BLOCKS = 8



def _pipeline_case():
    """The 1F1B parity case with `PIPELINE_BLOCKS` blocks."""
    import test_pipeline

    return dataclasses.replace(test_pipeline.CASES["pp2_1f1b_m4_fp64"], blocks=PIPELINE_BLOCKS)


@contextlib.contextmanager
def _patched(owner, name: str, make):
    """owner.name replaced by make(original) while the block runs; yields the number of faulty calls."""
    original = inspect.getattr_static(owner, name)
    fired = [0]
    wrapped = make(original.__func__ if isinstance(original, staticmethod) else original, fired)
    setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
    try:
        yield fired
    finally:
        setattr(owner, name, original)


def _twice_on(rank: int, method: str, axis: str, sent: bool = False):
    """Comm.`method` over `axis` on global rank `rank` with its (asynchronous, gradient) input counted twice; or
    with `sent`, the floating tensors it sends doubled (a pipeline stage's input gradients)."""
    def make(original, fired):
        signature = inspect.signature(original)

        def faulty(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            a = bound.arguments
            if torch.distributed.get_rank() == rank and a.get("axis") == axis:
                if sent:
                    fired[0] += any(t.is_floating_point() for t, _ in a["sends"])
                    a["sends"] = [(t * 2 if t.is_floating_point() else t, peer) for t, peer in a["sends"]]
                elif a.get("async_op"):
                    key = "tensor" if "tensor" in a else "input"
                    a[key] = a[key] * 2 if key == "input" else a[key].mul_(2)
                    fired[0] += 1
            return original(*bound.args, **bound.kwargs)
        return faulty
    return _patched(Comm, method, make)


def _doubled_result_on_rank_0(owner, name: str):
    """owner.name's result doubled on rank 0 (`_fold`: the dK/dV a cp rank adds to the ring's sum)."""
    def make(original, fired):
        def faulty(*args, **kwargs):
            out = original(*args, **kwargs)
            if torch.distributed.get_rank() == 0:
                fired[0] += 1
                return out * 2
            return out
        return faulty
    return _patched(owner, name, make)


def _doubled_gradient_on_rank_0(owner, name: str, position: int):
    """owner.name called with its `position`-th argument (a gradient) doubled on rank 0."""
    def make(original, fired):
        def faulty(*args, **kwargs):
            if torch.distributed.get_rank() == 0:
                fired[0] += 1
                args = (*args[:position], args[position] * 2, *args[position + 1:])
            return original(*args, **kwargs)
        return faulty
    return _patched(owner, name, make)


def _faulty_runs(rank, world):  # noqa: ARG001
    import test_context_parallel
    import test_data_parallel
    import test_expert_parallel
    import test_pipeline
    import test_tensor_parallel
    from paratrain.mesh import MeshShape, build_mesh
    from paratrain.parallel.context import ring
    from paratrain.parallel.expert import dispatch
    from paratrain.parallel.tensor import primitives

    runs = {}
    with _twice_on(0, "all_reduce", "dp") as fired:
        runs["data parallel (DDP)"] = test_data_parallel._parity(rank, world, 0, None, "fp32"), fired[0]
    with _twice_on(0, "reduce_scatter", "dp") as fired:
        runs["ZeRO-3"] = test_data_parallel._parity(rank, world, 3, None, "fp32"), fired[0]
    with _doubled_gradient_on_rank_0(primitives, "_all_reduce_grad", 0) as fired:
        runs["tensor parallel"] = (test_tensor_parallel._train_case(rank, world, test_tensor_parallel.FP32["tp2_tp_untied"]),
                                   fired[0])
    case = _pipeline_case()
    with _twice_on(1, "exchange", "pp", sent=True) as fired:  # rank 1, the last stage, sends input gradients
        losses, params, *_ = test_pipeline._train(case, build_mesh(MeshShape(pp=2)), steps=PIPELINE_STEPS)
        runs["pipeline (1F1B)"] = (losses, params), fired[0]
    with _doubled_result_on_rank_0(ring, "_fold") as fired:
        losses, params, _ = test_context_parallel._train_case(test_context_parallel.CASES["cp2"], world)
        runs["context parallel"] = (losses, params), fired[0]
    with _doubled_gradient_on_rank_0(dispatch._AllToAll, "backward", 1) as fired:
        mesh = build_mesh(MeshShape(dp=2, ep=2))
        losses, params, _ = test_expert_parallel._parallel(mesh, 0, batches(steps=test_expert_parallel.STEPS,
                                                                           batch=test_expert_parallel.BATCH))
        runs["expert parallel"] = (losses, params), fired[0]
    return runs


@functools.cache
def _references() -> dict:
    import test_context_parallel
    import test_data_parallel
    import test_expert_parallel
    import test_pipeline
    import test_tensor_parallel

    dense = test_data_parallel.reference()
    run = test_tensor_parallel.FP32["tp2_tp_untied"]
    return {
        "data parallel (DDP)": (dense, FP32_ADAMW),
        "ZeRO-3": (dense, FP32_ADAMW),
        "tensor parallel": (test_tensor_parallel._reference(test_tensor_parallel._config(2, run.tied), run.dtype,
                                                            run.steps), FP32_ADAMW),
        "pipeline (1F1B)": (test_pipeline._reference(_pipeline_case(), PIPELINE_STEPS)[:2],
                            FP64_PARITY),
        "context parallel": (test_context_parallel._reference("ref"), FP32_ADAMW),
        "expert parallel": (test_expert_parallel._reference(), FP32_ADAMW),
    }


_RESULTS: dict = {}


@pytest.mark.parametrize("strategy", ["data parallel (DDP)", "ZeRO-3", "tensor parallel", "pipeline (1F1B)",
                                      "context parallel", "expert parallel"])
def test_a_gradient_counted_twice_fails_the_parity_comparison(strategy, monkeypatch):
    monkeypatch.delenv("PARATRAIN_ERROR_REPORT", raising=False)  # other_machines.sh's table is of correct layouts
    (ref_losses, ref_params), model = _references()[strategy]
    for per_rank in launch_once(_RESULTS, 2, _faulty_runs, timeout=600):
        (losses, params), fired = per_rank[strategy]
        with pytest.raises(AssertionError, match="loss off by"):
            assert_matches_reference(losses, params, ref_losses, ref_params, model, f"{strategy} with the fault")
        # the parameters alone show it too
        with pytest.raises(AssertionError, match="off by .* of its norm"):
            assert_matches_reference(ref_losses, params, ref_losses, ref_params, model, f"{strategy} with the fault")
        # with the two elements farthest apart set aside (as the transformers layouts are judged), the rest shows it
        with pytest.raises(AssertionError, match="the model off by"):
            assert_matches_reference(ref_losses, params, ref_losses, ref_params, FP32_ADAMW_MODEL_STRAY,
                                     f"{strategy} with the fault")
        # and the bf16 bound `paratrain verify` judges a bf16 layout by (the whole model, 10x looser per step) fails it
        with pytest.raises(AssertionError, match="off by"):
            assert_matches_reference(losses, params, ref_losses, ref_params, BF16_ADAMW, f"{strategy} with the fault")
    assert any(per_rank[strategy][1] for per_rank in _RESULTS[2]), "the fault never fired"
