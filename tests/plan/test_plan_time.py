"""The planner's time model: the matmul curve, per-operation compute, boundaries, overlap, token budgets.

Pure arithmetic, no processes. What the model predicts against published runs is in
test_plan_published.py; against this machine, in benchmarks/bench_plan.py.
"""

import dataclasses
import json
import math

import pytest

from paratrain.cli import main as cli_main
from paratrain.models import get_model_config
from paratrain.plan import (
    HARDWARE_PRESETS,
    Collective,
    GemmCurve,
    Layout,
    LinkCost,
    PipelineBoundary,
    PlanError,
    Recompute,
    Workload,
    comm_bytes_per_rank,
    estimate,
    get_hardware,
    step_time,
)
from paratrain.plan import ops
from paratrain.plan.budget import budget
from paratrain.plan.collectives import boundary_crossings, collective_seconds, tp_collectives

A100 = HARDWARE_PRESETS["a100-80gb"]
H100 = HARDWARE_PRESETS["h100-80gb"]
LLAMA_7B = get_model_config("llama2-7b")


# -- the matmul efficiency curve ------------------------------------------------------------------


def test_gemm_efficiency_rises_with_size_and_saturates():
    curve = GemmCurve(0.8, 256.0)
    sizes = [64, 256, 1024, 4096, 16384]
    values = [curve.efficiency(s, s, s) for s in sizes]
    assert values == sorted(values) and values[-1] < 0.8
    assert curve.efficiency(256, 256, 256) == pytest.approx(0.4)  # x = x_half: half of the plateau
    assert curve.efficiency(1e9, 1e9, 1e9) == pytest.approx(0.8, rel=1e-6)
    # a skinny matmul is as efficient as a cube of its harmonic-mean size
    x = 3 / (2 / 8192 + 1 / 128)
    assert curve.efficiency(8192, 128, 8192) == pytest.approx(curve.efficiency(x, x, x))


def test_gemm_time_is_a_roofline_of_compute_plus_operand_traffic():
    """flops/(peak·e(x)) = 2mnk/(peak·e_max) + (2·x_half/3)(mn + nk + mk)/(peak·e_max)."""
    hw = dataclasses.replace(A100, gemm_bf16=GemmCurve(0.8, 300.0))
    m, n, k = 2048, 512, 4096
    rate = 312e12 * 0.8
    assert hw.gemm_seconds(m, n, k, "bf16") == pytest.approx(
        2 * m * n * k / rate + 2 * 300.0 / 3 * (m * n + n * k + m * k) / rate)


def test_measured_curves_interpolate_log_linearly_and_fall_back_to_bandwidth():
    hw = dataclasses.replace(A100, elementwise={"binary": ((1e3, 1e9), (1e5, 4e9))})
    assert hw.elementwise_seconds("binary", 1e3, 4) == pytest.approx(1e3 / 1e9)
    assert hw.elementwise_seconds("binary", 1e4, 4) == pytest.approx(1e4 / 2e9)  # halfway in log size: √(1·4)
    assert hw.elementwise_seconds("binary", 1e7, 4) == pytest.approx(1e7 / 4e9)  # flat beyond the last point
    # an unmeasured kind moves its accesses through the achieved bandwidth: a product reads 2, writes 1
    assert hw.elementwise_seconds("unary", 1e6, 2) == pytest.approx(2 * 1e6 * 2 / (2.039e12 * 0.8))


# -- per-operation compute --------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_the_operations_add_up_to_the_published_flop_count(tp):
    """Forward matmuls × 3 (forward + input and weight gradients) = 6·P·T/t, the attention core 12·h·s·T/t."""
    model, seq, mb = LLAMA_7B, 4096, 2
    x = ops.Shape.of(model, mb, seq, tp, False, "bf16", flash=False)
    tokens = mb * seq
    matmul_params = 4 * model.dim * model.dim + 3 * model.dim * model.ffn_dim  # MHA (kv = heads) + SwiGLU
    forward = sum(g.flops for g in ops.block_gemms(x))
    backward = sum(b.flops for g in ops.block_gemms(x) for b in ops.backward_gemms(g))
    assert forward + backward == pytest.approx(6 * matmul_params * tokens / tp)
    attention = sum(g.flops for g in ops.attention_gemms(x))
    assert attention * (1 + ops.DENSE_BACKWARD_MATMULS / 2) == pytest.approx(12 * model.dim * seq * tokens / tp)


def test_flash_attention_skips_the_causal_half_and_the_softmax_traffic():
    plain = ops.Shape.of(LLAMA_7B, 1, 4096, 1, False, "bf16", flash=False)
    flash = dataclasses.replace(plain, flash=True)
    # half the score matmuls, plus the kernel's own operands once (no s×s scores) and its per-pass overhead
    operands = ops.FLASH_ACCESSES[0] * flash.tokens * (flash.q_width + flash.kv_width) * flash.itemsize
    assert ops.attention_seconds(H100, flash, 2) == pytest.approx(
        ops.attention_seconds(H100, plain, 2) / 2 + H100.memory_seconds(operands) + H100.attention_overhead_s)
    assert ops.block_elementwise_times(H100, plain).forward > ops.block_elementwise_times(H100, flash).forward


def test_recomputation_costs_a_forward_or_the_attention_core():
    x = ops.Shape.of(LLAMA_7B, 1, 4096, 1, False, "bf16", flash=False)
    none, full = ops.block_times(A100, x, Recompute.NONE), ops.block_times(A100, x, Recompute.FULL)
    selective = ops.block_times(A100, x, Recompute.SELECTIVE)
    assert full.backward == pytest.approx(none.backward + none.forward)
    assert none.backward < selective.backward < full.backward


def test_per_gpu_throughput_rises_with_model_size_at_a_fixed_recipe():
    """The reason for a size-dependent curve: tp 8, SP, selective recompute, 1 micro-batch of 2048 tokens."""
    sizes = [(48, 6144, 64), (96, 12288, 96), (128, 25600, 160)]
    mfu = []
    for layers, hidden, heads in sizes:
        model = dataclasses.replace(LLAMA_7B, n_layers=layers, dim=hidden, n_heads=heads, n_kv_heads=heads,
                                    ffn_dim=round(8 * hidden / 3), vocab_size=51200)
        est = estimate(Workload.for_model(model, seq_len=2048, global_batch=64, flash_attention=False),
                       Layout(tp=8, sequence_parallel=True, recompute="selective"), A100)
        mfu.append(est.mfu(A100))
    assert mfu == sorted(mfu) and mfu[-1] - mfu[0] > 0.05


def test_a_cpu_profile_shares_its_cores_between_extra_ranks():
    cpu = dataclasses.replace(A100, host_cores=2, gpus_per_node=2,
                              collectives={"all_reduce": LinkCost(1e-3, 1e9)},
                              collectives_shared={"all_reduce": LinkCost(3e-3, 5e8)})
    work = Workload.for_model(get_model_config("tiny"), seq_len=128, global_batch=16, precision="fp32")
    two = step_time(work, Layout(tp=2, micro_batch=4), cpu)
    four = step_time(work, Layout(dp=2, tp=2, micro_batch=4), cpu)
    assert four.compute == pytest.approx(two.compute)  # half the micro-batches at half a core each
    assert four.tp_comm > two.tp_comm / 2 * 1.9  # time-shared collectives cost more than half as many
    assert cpu.compute_share(4) == 0.5 and cpu.compute_share(2) == 1.0 and A100.compute_share(4096) == 1.0


# -- communication -------------------------------------------------------------------------------


def test_small_all_reduces_over_many_ranks_take_the_tree():
    c = Collective("all_reduce", 64.0, 16384)
    assert c.seconds(50e9, 10e-6) == pytest.approx(2 * 14 * 10e-6 + 2 * 64 / 50e9)
    big = Collective("all_reduce", 1e9, 8)  # bandwidth-bound: the ring
    assert big.seconds(300e9, 5e-6) == pytest.approx(14 * 5e-6 + 2 * 1e9 * 7 / 8 / 300e9)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("boundary", list(PipelineBoundary))
def test_pipeline_boundary_bytes_under_tensor_parallelism(sp, boundary):
    """Scatter/gather: b·s·h/t per rank per crossing point to point, plus an all-gather over tp of b·s·h."""
    work = Workload.for_model(LLAMA_7B, seq_len=2048, global_batch=8)
    lay = Layout(pp=4, tp=4, micro_batch=2, sequence_parallel=sp, boundary=boundary)
    size, m, t = 2 * 2048 * 4096 * 2, 4, 4  # b·s·h in bf16; m = 8 / 2 micro-batches
    assert boundary_crossings(lay, 1) == 2  # a middle stage: its output forward, its input's gradient back
    scatter = boundary is PipelineBoundary.SCATTER_GATHER
    assert comm_bytes_per_rank(work, lay)["pp"] == m * 2 * (size / t if scatter else size)
    gathers = 2 * (int(scatter) + int(sp))  # the receiver's gather of the slices; SP's gather of the shards
    middle = [c for c in tp_collectives(work, lay, 1) if c.kind == "all_gather" and c.count == gathers]
    assert (gathers == 0 and not middle) or middle[0].bytes_sent == gathers * size * (t - 1) / t
    first = [c for c in tp_collectives(work, lay, 0) if c.kind == "all_gather" and c.count == gathers // 2]
    assert (gathers == 0 and not first) or first[0].size == size  # stage 0: one crossing per micro-batch


def test_interleaved_chunks_cross_more_boundaries():
    lay = Layout(pp=2, tp=2, micro_batch=1, schedule="interleaved", virtual_stages=2)
    assert [boundary_crossings(lay, s) for s in range(2)] == [3, 3]  # chunks 0..3 over 2 ranks


def test_scatter_gather_makes_inter_node_pipelines_cheaper():
    work = Workload.for_model(LLAMA_7B, seq_len=4096, global_batch=64)
    full = step_time(work, Layout(pp=4, tp=8, boundary="full"), H100)
    scatter = step_time(work, Layout(pp=4, tp=8), H100)
    assert full.pp_comm / 8 < scatter.pp_comm < full.pp_comm / 6  # 1/t of the bytes; the latency stays


def test_gradient_buckets_hide_all_but_the_last_one():
    work = Workload.for_params(1e9, global_batch=128, precision="fp32")  # one micro-batch of 16 per rank
    hw = dataclasses.replace(H100, comm_overlap=1.0)
    one_bucket = estimate(work, Layout(dp=8, micro_batch=16, bucket_mb=1e9), hw).time
    buckets = estimate(work, Layout(dp=8, micro_batch=16, bucket_mb=25), hw).time
    assert one_bucket.dp_comm == pytest.approx(one_bucket.dp_comm_total)  # after the backward: all exposed
    last = Collective("all_reduce", 25 * 2**20, 8).seconds(450e9 * 0.77, 5e-6)
    assert buckets.dp_comm == pytest.approx(last, rel=0.05)  # only the last bucket is left
    no_overlap = estimate(work, Layout(dp=8, micro_batch=16, bucket_mb=25), dataclasses.replace(hw, comm_overlap=0.0))
    assert no_overlap.time.dp_comm == pytest.approx(no_overlap.time.dp_comm_total)


def test_calibrated_collectives_replace_the_links_inside_a_node():
    hw = dataclasses.replace(H100, collectives={"all_reduce": LinkCost(1e-3, 2e9)})
    lay = Layout(dp=8)
    c = [Collective("all_reduce", 8e6, 8)]
    assert collective_seconds(hw, lay, "dp", c) == pytest.approx(c[0].seconds(2e9, 1e-3))
    assert collective_seconds(H100, lay, "dp", c) == pytest.approx(c[0].seconds(450e9 * 0.77, 5e-6))
    assert collective_seconds(hw, Layout(dp=16), "dp", [Collective("all_reduce", 8e6, 16)]) == pytest.approx(
        Collective("all_reduce", 8e6, 16).seconds(50e9 * 0.77, 10e-6))  # across nodes: the link


# -- time and cost of a token budget ------------------------------------------------------------


def test_budget_arithmetic_and_the_flop_identity():
    work = Workload.for_model(LLAMA_7B, seq_len=4096, global_batch=1024)
    est = estimate(work, Layout(dp=64, zero=1, micro_batch=1, recompute="selective"), H100)
    b = budget(est, 2e12, gpu_hour_price=2.0)
    steps = 2e12 / (1024 * 4096)
    assert b.steps == pytest.approx(steps)
    assert b.days == pytest.approx(steps * est.time.total / 86400)
    assert b.gpu_hours == pytest.approx(64 * steps * est.time.total / 3600)
    assert b.cost == pytest.approx(2.0 * b.gpu_hours)
    # time = T·F/(n·X) with F the model FLOPs per token and X the achieved model FLOP/s per GPU
    assert b.seconds == pytest.approx(2e12 * b.model_flops_per_token / (64 * b.achieved_flops_per_gpu))
    assert b.achieved_flops_per_gpu == pytest.approx(est.mfu(H100) * 989e12)
    with pytest.raises(PlanError, match="--gpu-hour-price"):
        budget(est, 1e9, gpu_hour_price=-1.0)


def run_plan(capsys, *argv):
    code = cli_main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_llama2_70b_on_64_gpus_for_2t_tokens(capsys):
    code, out, _ = run_plan(capsys, "--model", "llama2-70b", "--gpus", "64", "--tokens", "2T")
    assert code == 0
    assert "global batch 1024 (assumed: 4.2M tokens per step, Llama 2's 4M)" in out
    assert "with the best layout (dp=" in out and "training on 2,000,000,000,000 tokens (2T)" in out
    for line in ("steps      = T / tokens per step", " days", "= T · F / (n · X)", "GPU-hours  = n × time = 64 ×",
                 "cost       = GPU-hours × price (give --gpu-hour-price)"):
        assert line in out
    code, out, _ = run_plan(capsys, "--model", "llama2-70b", "--gpus", "64", "--tokens", "2T", "--gpu-hour-price",
                            "2.5", "--json")
    doc = json.loads(out)
    b = doc["budget"]
    assert b["tokens"] == 2e12 and b["gpus"] == 64 and b["cost"] == pytest.approx(2.5 * b["gpu_hours"])
    assert b["days"] == pytest.approx(b["steps"] * doc["layouts"][0]["step_time_s"] / 86400)


def test_cli_budget_of_one_layout_and_token_suffixes(capsys):
    results = {}
    for tokens in ("300B", "300000M", "0.3T", "300_000_000_000"):
        code, out, _ = run_plan(capsys, "--model", "llama2-7b", "--dp", "8", "--zero", "1", "--seq", "4096",
                                "--global-batch", "64", "--tokens", tokens, "--gpu-hour-price", "2", "--json")
        assert code == 0
        results[tokens] = json.loads(out)["budget"]
    assert len({json.dumps(b, sort_keys=True) for b in results.values()}) == 1
    assert results["300B"]["tokens"] == 3e11


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--tokens", "2X"], "--tokens '2X' is not a count"),
    (["--model", "tiny", "--tokens", "0"], "--tokens '0' must be at least 1"),
    (["--model", "tiny", "--tokens", "1B", "--gpu-hour-price", "-1"], "--gpu-hour-price must be a non-negative"),
    (["--model", "tiny", "--gpu-hour-price", "2"], "--gpu-hour-price needs --tokens"),
    (["--model", "tiny", "--out", "x.json"], "--out belongs to --calibrate"),
    (["--model", "tiny", "--hardware", "missing.json"], "hardware profile 'missing.json' does not exist"),
    (["--model", "tiny", "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
])
def test_bad_budget_and_hardware_input_is_one_line(capsys, argv, message):
    code, out, err = run_plan(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_hardware_presets_carry_their_sources():
    for hw in HARDWARE_PRESETS.values():
        assert hw.source and hw.host_cores is None
    assert get_hardware("h100-80gb").gemm("bf16") == get_hardware("h200").gemm("bf16")  # one set per GPU kind
    assert math.isclose(get_hardware("a100-80gb", gemm_bf16=GemmCurve(0.5, 1.0)).gemm("bf16").peak_efficiency, 0.5)
