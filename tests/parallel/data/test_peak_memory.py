"""Peak memory per rank, measured over whole steps, against the ZeRO formulas plus named buffers.

The measure is `paratrain.peak_memory.TensorMemory`: every operator of the step is seen, each
storage followed from creation to free, and the peak of live tensor bytes kept (not a count read
at one moment, which cannot see a peak). It is checked here against torch's own MemTracker.

The model is weights only (8 × Linear(256, 256), batch of 2 rows), so the peak is model state
and the buffers each stage promises, and nothing else:

    stage   fp32 (bytes per parameter)        mixed bf16 (ZeRO paper + fp32 grads of own masters)
    0       4 + 4 + 8 = 16                    2 + 2 + (4 + 8) + 4 = 20
    1       4 + 4 + 8/N                       2 + 2 + (12 + 4)/N
    2       4 + (4 + 8)/N                     2 + (4 + 12)/N   (the reduced shard is fp32: it is the master's grad)
    3       (4 + 4 + 8)/N                     (4 + 4 + 8)/N    (the shards are the fp32 masters)

and the buffers on top, each named in `BUFFERS` below.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, parallelize
from paratrain.peak_memory import TensorMemory
from paratrain.testing import run_on_ranks

WIDTH, LAYERS, ROWS = 256, 8, 2
PSI = LAYERS * (WIDTH * WIDTH + WIDTH)
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear in fp32: a ZeRO-3 unit, and about one bucket
BUCKET_MB = LAYER_BYTES / 2**20


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


# Model state in bytes per parameter on one of N ranks.
STATE = {
    "fp32": {0: lambda n: 16, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 16 / n},
    "bf16": {0: lambda n: 20, 1: lambda n: 4 + 16 / n, 2: lambda n: 2 + 16 / n, 3: lambda n: 16 / n},
}


def buffers(stage: int, precision: str, n: int) -> int:
    """The transient bytes each stage may hold on top of its state, at most, on gloo (L: one layer in fp32).

    - optimizer: AdamW without foreach makes two parameters' worth of temporaries at a time (the
      square root of the second moment and its quotient): 2L on stage 0, 2L/N on sharded stages.
    - ZeRO-1: one reduce-scatter at a time, whose input gloo copies until it completes (NCCL reads it in
      place; on the CPU each completes before backward goes on), one bucket; after the step, one
      bucket's all-gather of updated parameters (param dtype).
    - ZeRO-2: one bucket, filled or being reduced, gloo's copy of it while reduced, and the gradient
      autograd just made (one layer's).
    - ZeRO-3: two gathered units (the one computing and the one prefetched, param dtype); a unit's
      gradients as autograd makes them (param dtype); its flat copy being reduce-scattered and gloo's
      copy of that (reduce dtype).
    """
    layer, reduce_bytes = LAYER_BYTES, LAYER_BYTES * (2 if precision == "bf16" else 4) // 4
    param_layer = LAYER_BYTES * (2 if precision == "bf16" else 4) // 4
    if stage == 0:
        return 2 * layer
    optimizer = 2 * layer // n
    if stage == 1:
        return max(optimizer, reduce_bytes, param_layer)
    if stage == 2:
        return reduce_bytes * (1 + 2)
    return 2 * param_layer + param_layer + 2 * reduce_bytes


def _one_measured_step(rank, world, stage, precision, dp_shard=0):
    mesh = build_mesh(MeshShape(dp=world, dp_shard=dp_shard))
    model, optimizer = parallelize(
        make_model(), mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, foreach=False),
        precision=precision, reduce_dtype="bf16" if precision == "bf16" else None,
        data=DataParallel(zero=stage, bucket_mb=BUCKET_MB, prefetch=True))  # ZeRO-3: the CUDA default
    g = torch.Generator().manual_seed(rank)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step():
        model(torch.randn(ROWS, WIDTH, generator=g).to(dtype)).float().pow(2).mean().backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    meter = TensorMemory()
    with meter:
        meter.begin(model, optimizer)
        step()
        window = meter.end(model, optimizer)
    return window.peak_bytes, window.by_category


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_peak_over_a_step_is_the_zero_formula_plus_named_buffers(stage, world, precision):
    state = STATE[precision][stage](world) * PSI
    expected = state + buffers(stage, precision, world)
    for peak, by_category in run_on_ranks(_one_measured_step, world, stage, precision, timeout=120):
        detail = {k: round(v / 2**20, 3) for k, v in by_category.items() if v}
        assert peak == pytest.approx(expected, rel=0.10), (peak / 2**20, expected / 2**20, detail)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_holds_the_formula_of_its_shard_group(stage):
    """4 ranks as 2 replicas × 2 shards hold what 2 ranks of plain ZeRO hold: memory follows 1/dp_shard
    (the all-reduce between replicas adds only a 1/dp_shard shard of a bucket in flight)."""
    world, dp_shard = 4, 2
    expected = STATE["fp32"][stage](dp_shard) * PSI + buffers(stage, "fp32", dp_shard)
    for peak, by_category in run_on_ranks(_one_measured_step, world, stage, "fp32", dp_shard, timeout=120):
        detail = {k: round(v / 2**20, 3) for k, v in by_category.items() if v}
        assert peak == pytest.approx(expected, rel=0.10), (peak / 2**20, expected / 2**20, detail)


def test_the_measure_agrees_with_torch_memtracker():
    """One step: TensorMemory's peak against torch's own tracker of live tensor bytes (in a fresh process,
    where nothing but this step's tensors lives)."""
    ours, theirs = run_on_ranks(_both_measures, 1, timeout=120)[0]
    assert ours == pytest.approx(theirs, rel=0.03), (ours / 2**20, theirs / 2**20)


def _both_measures(rank, world):
    from torch.distributed._tools.mem_tracker import MemTracker

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, WIDTH)

    def step():
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    meter = TensorMemory()
    with meter:
        meter.begin(model, optimizer)
        step()
        ours = meter.end(model, optimizer).peak_bytes
    # Both count every live tensor; MemTracker leaves out the batch (made before, owned by neither).
    return ours, theirs + x.numel() * x.element_size()
