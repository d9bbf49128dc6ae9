"""Device→host syncs of one training step, per layout: the agreement's read, and the grad norm when logged.

On a GPU every read of device memory by the host stalls the queue of kernels; `HostSyncs` counts
the operations that would (scalar reads, value-dependent shapes, `.tolist()`), here on the CPU.
The step is the trainer's (`paratrain.train.train_step`); the batch comes from the host (excused).
"""

from __future__ import annotations

import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, PipelineParallel, TensorParallel, parallelize
from paratrain.testing import HostSyncs
from paratrain.train import train_step
from parallel_cases import BATCH, TINY, adamw, batches, launch_once

# name: (pp, dp, tp, zero, sequence parallel, schedule, virtual stages)
LAYOUTS = {
    "dp2": (1, 2, 1, 0, False, "1f1b", 1),
    "dp2_zero1": (1, 2, 1, 1, False, "1f1b", 1),
    "dp2_zero2": (1, 2, 1, 2, False, "1f1b", 1),
    "dp2_zero3": (1, 2, 1, 3, False, "1f1b", 1),
    "tp2": (1, 1, 2, 0, False, "1f1b", 1),
    "tp2_sp": (1, 1, 2, 0, True, "1f1b", 1),
    "pp2_gpipe": (2, 1, 1, 0, False, "gpipe", 1),
    "pp2_1f1b": (2, 1, 1, 0, False, "1f1b", 1),
    "pp2_interleaved": (2, 1, 1, 0, False, "interleaved", 2),
    "pp2_zb-h1": (2, 1, 1, 0, False, "zb-h1", 1),
    "pp2_dp2_tp2_zero1": (2, 2, 2, 1, True, "1f1b", 1),  # 3D, 8 ranks
}
CFG = TINY.__class__(**{**TINY.__dict__, "n_layers": 4})
_CACHE: dict = {}


def _count(layout) -> tuple[list[str], list[str]]:
    """(syncs of a step that logs its grad norm, syncs of one that does not), after two warm-up steps."""
    pp, dp, tp, zero, sp, schedule, virtual = layout
    mesh = build_mesh(MeshShape(pp=pp, dp=dp, tp=tp))
    with torch.device("meta"):
        model = Transformer(CFG)
    model, optimizer = parallelize(model, mesh, optimizer=adamw, init=lambda n, s: model.param_init(n, s, 0),
                                   data=DataParallel(zero=zero, grad_reduction="sum"),
                                   tensor=TensorParallel(sequence_parallel=sp),
                                   pipeline=PipelineParallel(schedule=schedule, virtual_stages=virtual))
    rows, counts = BATCH // dp, []
    for step, (x, y) in enumerate(batches(steps=4), start=1):
        x, y = (t[mesh.coord("dp") * rows:(mesh.coord("dp") + 1) * rows] for t in (x, y))
        micro = [(x[i:i + 2], y[i:i + 2]) for i in range(0, rows, 2)]
        # The batch, and the optimizer's step counters (CPU tensors unless capturable/fused), live on the host.
        steps = tuple(state["step"] for state in optimizer.state.values() if "step" in state)
        with HostSyncs(host=tuple(t for pair in micro for t in pair) + steps) as syncs:
            train_step(model, optimizer, micro, 1.0, step=step, read_grad_norm=step != 4)
        counts.append(syncs.calls)
    return counts[2], counts[3]


def _count_all(rank, world, names):
    return {name: _count(LAYOUTS[name]) for name in names}


def _counts(world: int) -> dict:
    names = [n for n, (pp, dp, tp, *_) in LAYOUTS.items() if pp * dp * tp == world]
    return launch_once(_CACHE, world, _count_all, names, timeout=600)


def test_two_syncs_per_step_at_most_and_one_without_logging():
    found = {}
    for world in (2, 4, 8):
        if not any(pp * dp * tp == world for pp, dp, tp, *_ in LAYOUTS.values()):
            continue
        for per_rank in _counts(world):
            for name, (logged, quiet) in per_rank.items():
                found[name] = max(found.get(name, (0, 0)), (len(logged), len(quiet)))
                assert len(logged) <= 2 and len(quiet) <= 1, (name, logged, quiet)
    print({name: counts for name, counts in found.items()})
    assert set(found) == set(LAYOUTS)
