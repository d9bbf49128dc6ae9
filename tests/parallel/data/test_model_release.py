"""A dropped model is freed: whatever the layout, every tensor it made goes with its last reference.

A notebook, a sweep, `paratrain verify` or a test builds several models in one process; each must
give back its parameters, fp32 masters, gradient buckets and optimizer state once the caller drops
the model and the optimizer (and `gc.collect()` has run, for the reference cycles of Python code).
Measured, not bookkept: `TensorMemory` follows every storage from the operator that made it until
it is freed, so after the drop the live tensor bytes are back to none.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, parallelize
from paratrain.peak_memory import TensorMemory
from parallel_cases import TINY, adamw, batches, launch_once, make_model

# name -> (world, mesh degrees, ZeRO stage)
LAYOUTS = {
    **{f"zero{z}": (1, {}, z) for z in range(4)},
    **{f"dp2_zero{z}": (2, {"dp": 2}, z) for z in range(4)},
    "tp2": (2, {"tp": 2}, 0),
    "tp2_zero3": (2, {"tp": 2}, 3),
    "pp2_zero1": (2, {"pp": 2}, 1),
}
PRECISIONS = ("fp32", "bf16", "fp16")
# Two blocks, one per stage at pp2: each kind of tensor a model makes, fewer of each to build and step.
MODEL = dataclasses.replace(TINY, n_layers=2)


def _build_step_drop(mesh, zero: int, precision: str) -> dict:
    """Build, take one step, drop model and optimizer: what was alive, and what still is."""
    meter = TensorMemory()
    with meter:
        model, optimizer = parallelize(make_model(MODEL), mesh, optimizer=adamw, precision=precision,
                                       data=DataParallel(zero=zero, grad_reduction="sum"))
        x, y = batches(vocab=MODEL.vocab_size, steps=1, batch=4)[0]
        model.train_step([(x[:2], y[:2]), (x[2:], y[2:])], float((y != -100).sum()))
        optimizer.step()
        optimizer.zero_grad()
        tensors = [*model.parameters(), *model.engine.masters(),
                   *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
        refs = [weakref.ref(t) for t in tensors]
        built = meter.total
        del model, optimizer, x, y, tensors
        return {"built_bytes": built, "left_bytes": _left_after_release(meter), "tensors": len(refs),
                "alive": sum(ref() is not None for ref in refs)}


def _left_after_release(meter: TensorMemory, wait_s: float = 2.0) -> int:
    """Live tensor bytes once the dropped model's are freed: after a collection, and once the process group's
    thread lets go of the last bucket it reduced (its work holds the tensor until that thread releases it, on
    a loaded machine a moment after the drop). What stays after `wait_s` outlives the model."""
    deadline = time.monotonic() + wait_s
    gc.collect()
    while meter.total and time.monotonic() < deadline:
        time.sleep(0.02)
        gc.collect()
    return meter.total


def _all_layouts(rank, world):
    results = {}
    for name, (layout_world, degrees, zero) in LAYOUTS.items():
        if layout_world != world:
            continue
        mesh = build_mesh(MeshShape(**degrees))
        for precision in PRECISIONS:
            results[name, precision] = _build_step_drop(mesh, zero, precision)
    return results


_RESULTS: dict = {}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_dropped_model_frees_every_tensor(layout, precision):
    world = LAYOUTS[layout][0]
    for rank, results in enumerate(launch_once(_RESULTS, world, _all_layouts, timeout=300)):
        result = results[layout, precision]
        assert result["built_bytes"] > 0 and result["tensors"] > 0, result  # the meter saw the model
        assert result["alive"] == 0, f"rank {rank}: {result['alive']} of {result['tensors']} parameters, " \
                                     f"masters and optimizer states outlive the model: {result}"
        assert result["left_bytes"] == 0, f"rank {rank}: {result['left_bytes']} tensor bytes outlive the model"
