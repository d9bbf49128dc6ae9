"""LoRA's and QLoRA's memory under ZeRO-3 over two data ranks, measured over a whole step with `TensorMemory`.

- The planner: the peak of live tensor bytes of a whole step (forward, backward, clipping, optimizer step, after two
  warm-up steps) is `paratrain plan --lora RANK [--base-dtype nf4]`'s total within 10%, on the model of
  `tests/plan/test_plan_peaks.py` (whose plain ZeRO-3 peaks the planner predicts as well), in bf16.
- QLoRA's base: the frozen NF4 weights a rank holds cost at most 0.6 bytes per parameter of its share (Ψ / N), and
  no storage alive at the step's peak is as large as a bf16 copy of the rank's share of the base (half the whole
  base's), on a model whose linears outweigh everything else: the base is gathered in 4 bits unit by unit and each
  weight decoded for its own matmul.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from paratrain import init_mesh, parallelize
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.api import DataParallel
from paratrain.parallel.lora import LoRA
from paratrain.plan import Layout, Workload, estimate_memory
from paratrain.plan.lora import target_params
from parallel_cases import batches, launch_once, plain_step, step_window

CFG = ModelConfig(vocab_size=1024, dim=128, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=352, max_seq_len=128)
WIDE = ModelConfig(vocab_size=64, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=704, max_seq_len=64)
ROWS, SEQ, WORLD, RANK = 4, 128, 2, 16
TOLERANCE = 0.10
BASES = [None, "nf4"]


def _step_peak(mesh, cfg: ModelConfig, base_dtype: str | None, rows: int, seq: int):
    """(peak live bytes of the third step, its largest storages, the bytes of this rank's frozen NF4 tensors)."""
    gc.collect()
    with torch.device("meta"):
        model = Transformer(cfg)
    init = functools.partial(model.param_init, seed=0)
    model, optimizer = parallelize(model, mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                   data=DataParallel(zero=3), precision="bf16", reduce_dtype="fp32", init=init,
                                   lora=LoRA(RANK, base_dtype=base_dtype))
    x, y = (t[mesh.rank * rows:(mesh.rank + 1) * rows]
            for t in batches(vocab=cfg.vocab_size, steps=1, batch=rows * WORLD, seq=seq)[0])
    window = step_window(model, optimizer, plain_step(model, optimizer, x, y))
    nf4 = sum(p.nbytes for n, p in model.module.named_parameters() if ".weight_nf4" in n)
    return window.peak_bytes, window.largest, nf4


def _measure(rank, world):
    mesh = init_mesh(dp=world)
    out = {base: _step_peak(mesh, CFG, base, ROWS, SEQ) for base in BASES}
    out["wide"] = _step_peak(mesh, WIDE, "nf4", 2, 64)
    return out


_RESULTS: dict = {}


def planned(base_dtype: str | None):
    workload = Workload.for_model(CFG, seq_len=SEQ, global_batch=ROWS * WORLD, precision="bf16", reduce_dtype="fp32",
                                  lora=RANK, base_dtype=base_dtype)
    return estimate_memory(workload, Layout(dp=WORLD, zero=3, micro_batch=ROWS))


@pytest.mark.parametrize("base_dtype", BASES)
def test_the_zero3_lora_step_peak_is_what_the_planner_predicts(base_dtype):
    for rank, result in enumerate(launch_once(_RESULTS, WORLD, _measure, timeout=300)):
        peak, plan = result[base_dtype][0], planned(base_dtype).total
        assert 1 - TOLERANCE <= peak / plan <= 1 + TOLERANCE, \
            f"rank {rank}: measured {peak / 2**20:.2f} MiB, planned {plan / 2**20:.2f} (ratio {peak / plan:.3f})"


def test_a_qlora_base_costs_its_nf4_bytes_and_is_never_whole_in_bf16():
    share = WIDE.n_layers * target_params(WIDE) / WORLD  # base parameters per rank
    for rank, result in enumerate(launch_once(_RESULTS, WORLD, _measure, timeout=300)):
        _, largest, nf4 = result["wide"]
        assert 0 < nf4 <= 0.6 * share, f"rank {rank}: {nf4 / share:.3f} bytes per parameter of its share"
        assert largest[0][0] < 2 * share, f"rank {rank}: a storage of {largest[0][0]:,} bytes at the peak " \
                                          f"({largest[0][1:]}), a bf16 share of the base is {2 * share:,.0f}"
