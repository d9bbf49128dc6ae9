"""Peak memory with compiled blocks: paratrain at most plain PyTorch's, on one rank, in bf16 and in fp32.

Plain PyTorch here is the same model with each block's forward compiled the same way (torch.compile,
static shapes), fp32 parameters, AdamW, and for bf16 `torch.autocast`; paratrain is parallelize(...,
compile=True) on a mesh of one rank (ZeRO-0), in bf16 or fp32. One step each, measured by
`TensorMemory` (which follows the buffers of compiled code: `_follow_compiled_allocations`) after two
warm-up steps, each run in the same fresh process after the one before it is gone. Inductor, as users run it:
its buffers and its partitioner's choice of saved tensors are what is measured.

Where the peak is (the end of the forward, all activations alive, no gradient yet), per parameter:

- plain bf16 holds fp32 parameters (4) + Adam's moments (8) + the bf16 copies of the weights autocast
  made, which the compiled forward saves for backward (2): 14 bytes, and its activations are bf16 where
  a matmul made them and fp32 elsewhere (the residual stream, the norms' inputs);
- paratrain bf16 holds fp32 masters (4) + bf16 parameters (2) + moments (8): 14 bytes, and activations in
  bf16 throughout. Its gradients go into the masters' as backward makes them: one rank keeps no gradient
  bucket between steps (an fp32 one would be 4 bytes more at the peak: 1.16× plain's peak here);
- fp32: 4 + 8 on both sides, the same activations.

So paratrain's peak is at most plain PyTorch's in both; `by_category` says where each stands.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.nn.functional as F

from paratrain import init_mesh, parallelize
from paratrain.models import ModelConfig, Transformer
from paratrain.plan import Layout, Workload, estimate_memory
from paratrain.testing import run_on_ranks
from parallel_cases import batches, step_window

CFG = ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)
ROWS, SEQ = 4, 64


def _model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(CFG)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def _peak(model, optimizer, step) -> tuple[int, dict[str, int]]:
    window = step_window(model, optimizer, step)
    return window.peak_bytes, window.by_category


def _plain(precision: str, x, y, compiled: bool = True):
    model = _model()
    for block in model.layers.values() if compiled else ():
        block.forward = torch.compile(block.forward, dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _peak(model, optimizer, step)


def _paratrain(precision: str, x, y, mesh, recompute: str = "none"):
    model, optimizer = parallelize(_model(), mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                   precision=precision, compile=True, activation_checkpointing=recompute)

    def step():
        model.loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _peak(model, optimizer, step)


def _measure(rank, world):  # noqa: ARG001
    torch._inductor.config.compile_threads = 1
    mesh = init_mesh()
    x, y = batches(vocab=CFG.vocab_size, steps=1, batch=ROWS, seq=SEQ)[0]
    runs = {("fp32", "eager"): functools.partial(_plain, "fp32", x, y, compiled=False)}
    for precision in ("bf16", "fp32"):
        runs[precision, "plain"] = functools.partial(_plain, precision, x, y)
        runs[precision, "paratrain"] = functools.partial(_paratrain, precision, x, y, mesh)
    runs["bf16", "paratrain selective"] = functools.partial(_paratrain, "bf16", x, y, mesh, "selective")
    results = {}
    for key, run in runs.items():
        torch._dynamo.reset()
        gc.collect()  # the previous model and its compiled code are gone
        results[key] = run()
    return results


_RESULTS: list = []


def _results() -> dict:
    if not _RESULTS:
        _RESULTS.append(run_on_ranks(_measure, 1, timeout=600)[0])
    return _RESULTS[0]


def test_the_measure_sees_what_compiled_blocks_keep():
    """The compiled step's activations, whose buffers compiled kernels write (no operator makes them), are seen:
    no more than eager's (compile's partitioner keeps less, recomputing cheap element-wise results), and most."""
    (_, compiled), (_, eager) = _results()["fp32", "plain"], _results()["fp32", "eager"]
    assert 0.5 * eager["activations"] < compiled["activations"] <= eager["activations"], (compiled, eager)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_compiled_peak_is_at_most_plain_pytorchs(precision):
    (plain, plain_parts), (ours, our_parts) = _results()[precision, "plain"], _results()[precision, "paratrain"]
    mib = lambda parts: {k: round(v / 2**20, 3) for k, v in parts.items() if v}  # noqa: E731
    assert ours <= plain, (ours / plain, mib(our_parts), mib(plain_parts))
    assert our_parts["other"] < 0.01 * ours, "no buffer outside the named roles: no gradient bucket kept"


@pytest.mark.parametrize("precision, row, recompute", [("bf16", "paratrain", "none"), ("fp32", "paratrain", "none"),
                                                        ("bf16", "paratrain selective", "selective")])
def test_the_planner_predicts_the_compiled_peak(precision, row, recompute):
    """`paratrain plan --compile`'s peak (`block_bytes_as_run(compiled=True)`: what inductor's partitioner keeps)
    within 10% of the measured one (1.001 of it in each row here); the eager count misses it by 10%."""
    peak = _results()[precision, row][0]
    workload = Workload.for_model(CFG, seq_len=SEQ, global_batch=ROWS, precision=precision, reduce_dtype="fp32")
    planned = {compiled: estimate_memory(workload, Layout(micro_batch=ROWS, recompute=recompute,
                                                          compile=compiled)).total for compiled in (True, False)}
    assert 0.9 <= peak / planned[True] <= 1.1, (peak / 2**20, planned[True] / 2**20)
    if recompute == "none":  # the measured 0.89-0.90 of eager's count, 1.00 of compiled's
        assert peak / planned[False] < 0.95, "compiled blocks keep less than eager ones"
