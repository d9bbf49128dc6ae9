"""torch.compile per block (`parallelize(..., compile=True)`) in every layout: eager's numbers, one compile, one graph.

One launch of 2 ranks (each strategy alone) and one of 4 (each pair of axes: dp × tp, pp × tp, pp × dp; 3D is
their sum, proven eager by test_pipeline) trains every case twice from the same initialization on the same
batches, eager and compiled: 3 AdamW steps, the losses and the parameters after the steps within 1e-4 of
eager's in fp32 (bf16 and fp16 within their rounding: a compiled block rounds at other places than eager
kernels do). Each compiled run starts from an empty dynamo cache and counts the graphs dynamo compiled: some
in the first step, none after it (no recompilation), and no graph break anywhere (paratrain's hooks and
collectives are outside the compiled blocks, tensor-parallel collectives inside them are custom operators).

Backends: inductor (C++ code generated and compiled on the CPU, the costly part: 12 cases all under inductor
took 200 s from a cold cache on 2 cores; these 15, most on 2 ranks, take 130 s cold) for the two cases that
exercise what only it does with paratrain's pieces, the custom collectives inside generated code (`tp2_sp`) and the min-cut partitioner under selective recomputation
and ZeRO-3 (`dp2_zero3_ac-selective`); `aot_eager` (dynamo and AOTAutograd's forward and backward
graphs, run by eager kernels) for the rest of the matrix, which is where paratrain's hooks, buckets, gathers
and transfers meet the compiled regions.

Every case runs a rank's blocks on micro-batches of the same shape (2 × 16 tokens), so the cases share a
few graphs: the whole block, the tp=2 block, the tp=2 block under sequence parallelism, Hugging Face's
decoder layer.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paratrain import DataParallel, PipelineParallel, TensorParallel, parallelize
from paratrain.mesh import build_mesh
from paratrain.models import Transformer
from paratrain.train import train_step
from paratrain.error_model import FP32_ADAMW
from parallel_cases import TINY, Layout, adamw, assert_matches_reference, batches, launch_once, model_difference, variant

STEPS, ROWS, SEQ, LR = 3, 2, 16, 1e-2  # ROWS: sequences per micro-batch on every rank
# Two blocks, as the Hugging Face case's two decoder layers: a block hands its output and its gradient to another
# (ZeRO-3 prefetches the next one's unit while one runs) and each pipeline stage holds one.
MODEL = dataclasses.replace(TINY, n_layers=2)


@dataclasses.dataclass(frozen=True)
class Case(Layout):
    builder: str = "reference"
    backend: str = "aot_eager"

    @property
    def tolerance(self) -> float:
        return {"bf16": 2e-2, "fp16": 5e-3}[self.precision]  # fp32: paratrain.error_model.FP32_ADAMW


def _cases(*names: str, **extra) -> dict[str, Case]:
    prefix = f"{extra['builder']}_" if "builder" in extra else ""
    return {prefix + name: variant(Case, name, **extra) for name in names}


CASES = {
    # Two ranks: each strategy alone (on 2 cores a 4-rank launch compiles every graph twice as slowly).
    # (ZeRO-1's backward launches its buckets' reductions as DDP's does: `dp2` is where they meet compiled blocks)
    **_cases("dp2", "dp2_zero2", "dp2_zero3", "pp2_1f1b_m2", "dp2_zero3_ac-full", "tp2_zero1_bf16",
             "dp2_zero2_ac-full_fp16"),
    **_cases("tp2_sp", "dp2_zero3_ac-selective", backend="inductor"),
    **_cases("dp2_zero3", builder="hf_llama"),
    # Four ranks: what needs two axes.
    **_cases("hsdp2x2_zero3", "dp2_tp2", "pp2_1f1b_m2_tp2_sp", "pp2_1f1b_m2_dp2_zero1"),
}


def _reference_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(MODEL)


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY.vocab_size, hidden_size=TINY.dim, intermediate_size=TINY.ffn_dim,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def _train(case: Case, mesh, compiled: bool) -> dict:
    model = _hf_llama() if case.builder == "hf_llama" else _reference_model()
    init = (lambda name, shape: model.param_init(name, shape, 0)) if case.builder == "reference" else None
    model, optimizer = parallelize(
        model, mesh, optimizer=functools.partial(adamw, lr=LR), init=init, compile=compiled and case.backend,
        activation_checkpointing=case.recompute, precision=case.precision,
        data=DataParallel(zero=case.zero, grad_reduction="sum", prefetch=True),
        tensor=TensorParallel(sequence_parallel=case.sp) if case.tp > 1 else None,
        pipeline=PipelineParallel(schedule="1f1b") if case.pp > 1 else None)
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    rows = ROWS * case.microbatches
    stats = torch._dynamo.utils.counters
    breaks_before = sum(stats["graph_break"].values())
    graphs, losses = [stats["stats"]["unique_graphs"]], []
    for x, y in batches(steps=STEPS, batch=rows * dp, seq=SEQ):
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        model.comm.reset()
        outcome = train_step(model, optimizer, [(x[i:i + ROWS], y[i:i + ROWS]) for i in range(0, rows, ROWS)],
                             1.0)
        losses.append(outcome.loss)
        graphs.append(stats["stats"]["unique_graphs"])
    return {"losses": losses, "params": model.full_state_dict(), "graphs": graphs, "comm": model.comm.summary(),
            "graph_breaks": sum(stats["graph_break"].values()) - breaks_before}


def _all_cases(rank, world):  # noqa: ARG001
    torch._inductor.config.compile_threads = 1  # compile in the rank's process: no pool of workers per rank
    results = {}
    for name, case in CASES.items():
        if case.world != world:
            continue
        mesh = build_mesh(case.mesh_shape())
        eager = _train(case, mesh, compiled=False)
        torch._dynamo.reset()  # each case compiles its own blocks (from inductor's caches when it can)
        results[name] = eager, _train(case, mesh, compiled=True)
    return results


_RESULTS: dict = {}


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_blocks_match_eager_compile_once_and_never_break(name):
    case = CASES[name]
    for per_rank in launch_once(_RESULTS, case.world, _all_cases, timeout=900):
        eager, compiled = per_rank[name]
        if case.precision == "fp32":
            assert_matches_reference(compiled["losses"], compiled["params"], eager["losses"], eager["params"],
                                     FP32_ADAMW, name)
        else:  # 16-bit: the compiled graph rounds its fused operations once where eager rounds each
            assert compiled["losses"] == pytest.approx(eager["losses"], rel=case.tolerance)
            assert model_difference(compiled["params"], eager["params"]) <= case.tolerance
        before, after_first, *later = compiled["graphs"]
        assert after_first > before, "the first step compiles the blocks"
        assert later == [after_first] * len(later), f"recompiled after the first step: {compiled['graphs']}"
        assert compiled["graph_breaks"] == 0
        assert compiled["comm"] == eager["comm"], "the same collectives, through Comm, in the last step"
