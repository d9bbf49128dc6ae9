"""Device→host syncs of one training step, per layout: the agreement's read, which brings the loss, the
token count and the gradient norm, and nothing else. The norm it brings is the norm one process
computes with `torch.nn.utils.clip_grad_norm_` on the whole batch, step by step.

On a GPU every read of device memory by the host stalls the queue of kernels; `HostSyncs` counts
the operations that would (scalar reads, value-dependent shapes, `.tolist()`), here on the CPU.
The step is the trainer's (`paratrain.train.train_step`); the batch comes from the host (excused).

Expert parallelism and MoE models are not in the table, by design: each MoE layer reads its exchanged
per-expert counts on the host once per forward, its backward reusing them (`paratrain.parallel.expert.dispatch`:
they are the split sizes of its all-to-all), the sync every dropless dispatcher makes (Megatron-Core's,
torchtitan's); and a MoE layer counts its tokens per expert with `torch.bincount`, which sizes its output on the
host, and where torch's grouped GEMM does not run (`paratrain.compat.grouped_mm`) loops over its experts' slices.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import Transformer
from paratrain.parallel.api import DataParallel, PipelineParallel, TensorParallel, parallelize
from paratrain.testing import HostSyncs
from paratrain.train import train_step
from parallel_cases import BATCH, TINY, adamw, batches, launch_once, loss_sum, make_model

# name: (pp, dp, tp, zero, sequence parallel, schedule, virtual stages[, dp_shard])
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
    "dp4_shard2_zero1": (1, 4, 1, 1, False, "1f1b", 1, 2),  # hybrid sharding: 2 replicas of 2 shards
    "dp4_shard2_zero3": (1, 4, 1, 3, False, "1f1b", 1, 2),
    "dp2_shard2_tp2_zero2": (1, 4, 2, 2, False, "1f1b", 1, 2),
}
STEPS, WARM_UP = 3, 2  # the syncs of the steps after the warm-up ones are counted
CLIP = 0.5  # below every step's norm: each step clips, so the norm decides the update
CFG = TINY.__class__(**{**TINY.__dict__, "n_layers": 4})
_CACHE: dict = {}


def _count(layout) -> tuple[list[list[str]], list[float]]:
    """(The syncs of each step after two warm-up steps, every step's gradient norm)."""
    pp, dp, tp, zero, sp, schedule, virtual, *shard = layout
    mesh = build_mesh(MeshShape(pp=pp, dp=dp, tp=tp, dp_shard=shard[0] if shard else 0))
    with torch.device("meta"):
        model = Transformer(CFG)
    model, optimizer = parallelize(model, mesh, optimizer=adamw, init=lambda n, s: model.param_init(n, s, 0),
                                   data=DataParallel(zero=zero, grad_reduction="sum"),
                                   tensor=TensorParallel(sequence_parallel=sp),
                                   pipeline=PipelineParallel(schedule=schedule, virtual_stages=virtual))
    rows, counts, norms = BATCH // dp, [], []
    for step, (x, y) in enumerate(batches(steps=STEPS), start=1):
        x, y = (t[mesh.coord("dp") * rows:(mesh.coord("dp") + 1) * rows] for t in (x, y))
        micro = [(x[i:i + 2], y[i:i + 2]) for i in range(0, rows, 2)]
        if step <= WARM_UP:
            outcome = train_step(model, optimizer, micro, CLIP)
        else:
            # The batch, and the optimizer's step counters (CPU tensors unless capturable/fused), live on the host.
            steps = tuple(state["step"] for state in optimizer.state.values() if "step" in state)
            with HostSyncs(host=tuple(t for pair in micro for t in pair) + steps) as syncs:
                outcome = train_step(model, optimizer, micro, CLIP)
            counts.append(syncs.calls)
        norms.append(outcome.grad_norm)
    return counts, norms


def _count_all(rank, world, names):
    return {name: _count(LAYOUTS[name]) for name in names}


def _counts(world: int) -> dict:
    names = [n for n, (pp, dp, tp, *_) in LAYOUTS.items() if pp * dp * tp == world]
    return launch_once(_CACHE, world, _count_all, names, timeout=600)


def _reference_norms() -> list[float]:
    """One process, the whole batch, the same model, optimizer and clipping: the norm before each clip."""
    model = make_model(CFG)
    optimizer, norms = adamw(list(model.parameters())), []
    for x, y in batches(steps=STEPS):
        (loss_sum(model, x, y) / (y != -100).sum()).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def test_one_sync_per_step_with_the_loss_and_the_grad_norm():
    found = {}
    for world in (2, 4, 8):
        if not any(pp * dp * tp == world for pp, dp, tp, *_ in LAYOUTS.values()):
            continue
        for per_rank in _counts(world):
            for name, (steps, _) in per_rank.items():
                found[name] = max([found.get(name, 0)] + [len(syncs) for syncs in steps])
                for syncs in steps:
                    assert len(syncs) == 1, (name, syncs)
    print(found)
    assert set(found) == set(LAYOUTS)


def test_the_agreed_gradient_norm_is_one_process_norm():
    reference = _reference_norms()
    assert min(reference) > CLIP
    for world in (2, 4, 8):
        for per_rank in _counts(world):
            for name, (_, norms) in per_rank.items():
                assert norms == pytest.approx(reference, rel=1e-4), (name, norms, reference)
