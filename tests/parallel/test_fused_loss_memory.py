"""The fused loss's memory, measured (`TensorMemory`) on a Llama-3-shaped model: a 128,256-token vocabulary over a small
width and few layers, so the loss is most of the step, as it is of Llama 3.1 8B's activations.

- the loss's share (what forward and backward of the loss add at their peak over the head's input and weight, which
  exist before it) is at most 1/4 of the whole logits' loss;
- a whole step (`train_step`, clipping, AdamW) peaks lower by at least the fp32 logits no longer held;
- the planner's peak with the fused loss (`Workload(loss_chunk=...)`) is within 10% of the measured step's.

The suite's shape is 4 × 32 tokens in chunks of 16 (8 chunks, as the default 1,024-token chunks cut a micro-batch of
4 × 2,048) over a width of 16, in fp32: the whole logits of 4 × 2,048 tokens would take 13 GB of the CPU's memory in
one step, and its bf16 matmuls are 8 times slower than fp32's. What the checks compare keeps its proportions at any
size with 8 tokens per unit of width and 8 chunks: the fp32 logits (tokens × vocabulary) are 8 times the head's
weight (vocabulary × width), a chunk's logits an eighth of the whole, and the blocks' activations (tokens × width) a
small fraction of the logits; the CPU's work is the logits' (tokens × vocabulary), so the width and the tokens are
small and the vocabulary is Llama 3's. `benchmarks/gpu_check.py`'s "fused loss" rows measure Llama 3.1 8B's own head.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.nn.functional as F

from paratrain import init_mesh, parallelize
from paratrain.models import ModelConfig
from paratrain.models.llama import Transformer
from paratrain.parallel.api import DataParallel
from paratrain.parallel.loss import linear_cross_entropy
from paratrain.peak_memory import TensorMemory
from paratrain.plan import Layout, Workload, estimate_memory
from paratrain.precision import DTYPES, cross_entropy

LLAMA3_SMALL = ModelConfig(vocab_size=128_256, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=56,
                           max_seq_len=64, rope_theta=500_000.0)
ROWS, SEQ, CHUNK = 4, 32, 16
PRECISION = "fp32"  # the CPU's bf16 matmuls are 8 times slower than its fp32 ones; the GPU rows run bf16
TOLERANCE = 0.10


def _batch(cfg: ModelConfig = LLAMA3_SMALL, rows: int = ROWS, seq: int = SEQ):
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (rows, seq), generator=g) for _ in range(2))
    y[:, : seq // 8] = -100  # a prompt's tokens, masked out of the loss
    return x, y


def loss_share(chunk: int, cfg: ModelConfig = LLAMA3_SMALL, rows: int = ROWS, seq: int = SEQ) -> int:
    """Peak bytes the loss's forward and backward add over what exists before it (the head's input and weight), in
    fused in chunks of `chunk` tokens, or (0) the whole logits as `precision.cross_entropy` takes them."""
    gc.collect()
    g = torch.Generator().manual_seed(0)
    dtype = DTYPES[PRECISION]
    hidden = torch.randn(rows * seq, cfg.dim, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(cfg.vocab_size, cfg.dim, generator=g) * 0.02).to(dtype).requires_grad_()
    targets = _batch(cfg, rows, seq)[1].flatten()
    meter = TensorMemory()
    with meter:
        meter.begin()
        if chunk:
            loss = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
        else:
            loss = cross_entropy(F.linear(hidden, weight), targets)
        loss.backward()
        del loss
        window = meter.end()
    return window.peak_bytes - window.start_bytes


def _left_alive() -> int:
    """Bytes of the tensors alive in this process now (what earlier tests in a pytest worker left behind)."""
    meter = TensorMemory()
    with meter:
        meter.begin()
        return meter.end().start_bytes


def step_peak(mesh, chunk: int, cfg: ModelConfig = LLAMA3_SMALL, rows: int = ROWS, seq: int = SEQ) -> int:
    """Peak live tensor bytes of `parallelize`'s second step (one micro-batch, clipping, AdamW; the first made the
    optimizer's state), the loss fused in chunks of `chunk` tokens (0: the whole logits); the tensors alive before
    the model was built are not the step's (a window counts every tensor alive in the process)."""
    gc.collect()
    before = _left_alive()
    with torch.device("meta"):
        model = Transformer(cfg)
    # torch's fused AdamW (a GPU run's): the CPU's foreach one adds a temporary the size of the parameters
    model, optimizer = parallelize(model, mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
                                   data=DataParallel(zero=0), precision=PRECISION, reduce_dtype="fp32",
                                   loss_chunk=chunk)
    batch = [_batch(cfg, rows, seq)]

    def step():
        model.train_step(batch, float(rows * seq))
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    meter = TensorMemory()
    with meter:
        meter.begin(model, optimizer)
        step()
        return meter.end(model, optimizer).peak_bytes - before


def planned(chunk: int, cfg: ModelConfig = LLAMA3_SMALL, rows: int = ROWS, seq: int = SEQ):
    workload = Workload.for_model(cfg, seq_len=seq, global_batch=rows, precision=PRECISION, reduce_dtype="fp32",
                                  loss_chunk=chunk)
    return estimate_memory(workload, Layout(micro_batch=rows))


@pytest.fixture(scope="module")
def peaks():
    mesh = init_mesh()
    try:
        yield {chunk: step_peak(mesh, chunk) for chunk in (CHUNK, 0)}
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_the_loss_holds_at_most_a_quarter_of_the_whole_logits_loss():
    fused, whole = loss_share(CHUNK), loss_share(0)
    logits = ROWS * SEQ * LLAMA3_SMALL.vocab_size * 4
    assert whole > 2 * logits  # the whole logits' loss holds fp32 log-probabilities and their gradient at once
    assert fused <= whole / 4, f"fused {fused / 2**20:.1f} MiB, whole logits {whole / 2**20:.1f} MiB"


def test_the_step_peaks_lower_by_at_least_the_fp32_logits(peaks):
    logits = ROWS * SEQ * LLAMA3_SMALL.vocab_size * 4
    assert peaks[0] - peaks[CHUNK] >= logits, \
        f"step peak {peaks[0] / 2**20:.1f} MiB whole, {peaks[CHUNK] / 2**20:.1f} fused; logits {logits / 2**20:.1f}"


def test_the_planner_prices_the_fused_loss(peaks):
    plan = planned(CHUNK).total
    assert 1 - TOLERANCE <= peaks[CHUNK] / plan <= 1 + TOLERANCE, \
        f"measured {peaks[CHUNK] / 2**20:.1f} MiB, planned {plan / 2**20:.1f} (ratio {peaks[CHUNK] / plan:.3f})"


def test_a_planner_that_kept_the_whole_logits_would_miss_the_fused_step(peaks):
    """The check can fail: priced as the whole logits, the fused step is over-predicted beyond the tolerance."""
    assert planned(0).total / peaks[CHUNK] > 1 + TOLERANCE
