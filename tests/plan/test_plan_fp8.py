"""The planner's FP8 (`plan --fp8`): the blocks' linears at the hardware's FP8 rate plus the bytes of their casts;
a MoE's router and experts, the attention core and the head stay in the compute dtype; refused where the hardware
has no FP8 matmuls."""

import dataclasses

import pytest

from paratrain.cli import main
from paratrain.models import get_model_config
from paratrain.plan import HARDWARE_PRESETS, Layout, PlanError, Workload, estimate
from paratrain.plan.hardware import KernelStack
from paratrain.plan.memory import Recompute
from paratrain.plan.ops import (
    ROWWISE_FP8_RATE, Shape, _gemm_seconds, backward_gemms, block_gemms, block_times, fp8_gemms, fp8_times,
)

H200 = HARDWARE_PRESETS["h200"]


def _shape(model: str, fp8: str | None) -> Shape:
    return Shape.of(get_model_config(model), 2, 2048, 1, False, "bf16", True, KernelStack.FUSED, fp8=fp8)


def test_the_linears_run_at_twice_the_rate_plus_their_casts():
    x = _shape("llama2-7b", "tensorwise")
    gemms = block_gemms(x)
    assert fp8_gemms(x) == gemms  # a dense block: every matmul is a linear's
    matmuls, casts = fp8_times(H200, x, gemms)
    assert matmuls.forward == pytest.approx(_gemm_seconds(H200, gemms, "bf16") / 2)
    assert matmuls.backward == pytest.approx(_gemm_seconds(H200, [b for g in gemms for b in backward_gemms(g)],
                                                           "bf16") / 2)
    # x and W read twice in bf16 and written once in e4m3: 5 bytes per element forward; the gradient backward
    forward_elements = sum(g.count * (g.m * g.k + g.n * g.k) for g in gemms)
    assert casts.forward == pytest.approx(H200.memory_seconds(5 * forward_elements))
    assert casts.backward == pytest.approx(H200.memory_seconds(5 * sum(g.count * g.m * g.n for g in gemms)))
    rowwise, _ = fp8_times(H200, _shape("llama2-7b", "rowwise"), gemms)
    assert rowwise.forward == pytest.approx(matmuls.forward / ROWWISE_FP8_RATE)
    plain = block_times(H200, _shape("llama2-7b", None), Recompute.NONE)
    fast = block_times(H200, x, Recompute.NONE)
    saved = _gemm_seconds(H200, gemms, "bf16") / 2
    assert plain.forward - fast.forward == pytest.approx(saved - casts.forward)


def test_a_mixture_of_experts_keeps_its_router_and_experts_in_bf16():
    moe = get_model_config("tiny-moe")
    x = Shape.of(moe, 2, 256, 1, False, "bf16", True, KernelStack.FUSED, fp8="tensorwise")
    gemms, low = block_gemms(x), fp8_gemms(x)
    assert low == gemms[:3] + gemms[6:] and len(gemms) - len(low) == 3  # router, w1/w3 and w2 of the experts


def test_llama2_7b_on_an_h200_gains_what_fp8_training_reports():
    """Published FP8 speed-ups for 7-8B Llamas on H100s: 1.25x (torchao tensorwise) to 1.28x (torchtitan)."""
    workload = Workload.for_model(get_model_config("llama2-7b"), seq_len=4096, global_batch=64, precision="bf16")
    layout = Layout(dp=8, zero=1, micro_batch=2)
    bf16 = estimate(workload, layout, H200).time.total
    fp8 = estimate(dataclasses.replace(workload, fp8="tensorwise"), layout, H200).time.total
    rowwise = estimate(dataclasses.replace(workload, fp8="rowwise"), layout, H200).time.total
    assert 1.15 < bf16 / fp8 < 1.5 and fp8 < rowwise < bf16


def test_hardware_without_fp8_is_refused_in_one_line(capsys):
    workload = Workload.for_model(get_model_config("llama2-7b"), precision="bf16", global_batch=8, fp8="tensorwise")
    with pytest.raises(PlanError, match="has no FP8 matmuls"):
        estimate(workload, Layout(micro_batch=1), HARDWARE_PRESETS["a100-80gb"])
    assert main(["plan", "--model", "llama2-7b", "--hardware", "a100-80gb", "--fp8", "tensorwise"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no FP8 matmuls" in err and "\n" not in err
    assert main(["plan", "--model", "llama2-7b", "--hardware", "h200", "--fp8", "tensorwise"]) == 0
    assert "bf16 with FP8 tensorwise linears" in capsys.readouterr().out


def test_zero3_gathers_the_tensorwise_linears_weights_in_one_byte():
    """ZeRO-3 with tensorwise FP8 gathers the blocks' linears' weights as their e4m3 casts (the engine:
    `tests/parallel/test_fp8.py`, counted): the gather bytes drop by one byte per such weight; rowwise and tp gather bf16."""
    from paratrain.plan.collectives import dp_collectives

    model = get_model_config("llama2-7b")
    workload = Workload.for_model(model, seq_len=2048, global_batch=16, precision="bf16")

    def gathered(fp8, tp=1):
        layout = Layout(dp=8 // tp, tp=tp, zero=3, micro_batch=2)
        collectives = dp_collectives(dataclasses.replace(workload, fp8=fp8), layout, 0)[layout.data_axes[0]]
        return sum(c.size * c.count for c in collectives.overlapped if c.kind == "all_gather")

    linears = model.n_layers * (4 * model.dim * model.dim + 3 * model.dim * model.ffn_dim)  # MHA: q, k, v, o
    m = 2 * 16 // (8 * 2)  # gathers per unit and step: forward and backward, each micro-batch
    assert gathered(None) - gathered("tensorwise") == pytest.approx(linears * m, rel=1e-9)
    assert gathered("rowwise") == gathered(None) and gathered("tensorwise", tp=2) == gathered(None, tp=2)


def test_the_planner_keeps_in_bf16_the_linears_the_cuda_size_filter_keeps():
    """On CUDA `parallelize` converts only linears with at least 1,024 in and out features (the whole layer's,
    under any tp): the planner prices the same ones in FP8. The 1B's K and V projections (2048 -> 512) stay bf16,
    under tp too; with the filter off (a CPU run, or fp8_min_features=0) they convert."""
    from paratrain.parallel.fp8 import CUDA_MIN_FEATURES

    one_b = get_model_config("llama3.2-1b")
    assert one_b.n_kv_heads * one_b.head_dim < CUDA_MIN_FEATURES <= one_b.dim
    for tp in (1, 2):
        x = Shape.of(one_b, 2, 2048, tp, False, "bf16", True, KernelStack.FUSED, fp8="tensorwise",
                     fp8_min_features=CUDA_MIN_FEATURES)
        q, kv, o, up, down = block_gemms(x)
        assert fp8_gemms(x) == [q, o, up, down]
        unfiltered = Shape.of(one_b, 2, 2048, tp, False, "bf16", True, KernelStack.FUSED, fp8="tensorwise")
        assert fp8_gemms(unfiltered) == [q, kv, o, up, down]
    assert Workload(model=one_b, num_params=one_b.num_params()).fp8_min_features == CUDA_MIN_FEATURES
    workload = Workload.for_model(one_b, seq_len=2048, global_batch=8, precision="bf16", fp8="tensorwise")
    layout = Layout(dp=1, zero=0, micro_batch=2)
    filtered = estimate(workload, layout, H200)
    everything = estimate(dataclasses.replace(workload, fp8_min_features=0), layout, H200)
    assert everything.memory.fp8_casts - filtered.memory.fp8_casts == pytest.approx(
        one_b.n_layers * 2 * one_b.dim * one_b.n_kv_heads * one_b.head_dim)  # K and V's 1-byte casts
    assert everything.time.total != filtered.time.total


def test_plan_prices_the_size_filter_it_is_told(capsys):
    from paratrain.cli import main

    casts = []
    for extra in ([], ["--fp8-min-features", "0"]):
        assert main(["plan", "--model", "llama3.2-1b", "--dp", "1", "--micro-batch", "2", "--global-batch", "2",
                     "--seq-len", "2048", "--fp8", "tensorwise", "--hardware", "h200", *extra]) == 0
        line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("fp8 weight casts"))
        casts.append(float(line.split()[3]))
    one_b = get_model_config("llama3.2-1b")
    kv = one_b.n_layers * 2 * one_b.dim * one_b.n_kv_heads * one_b.head_dim  # K and V's weights: FP8 only at 0
    assert casts[0] > 0 and casts[1] - casts[0] == pytest.approx(kv / 1e9, abs=0.006)  # (the table's 2 decimals)
