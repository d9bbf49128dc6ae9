"""The planner under context parallelism: activations ∝ 1/cp, the ring's K/V traffic, the search at 128K.

Pure arithmetic (no processes), against the formulas the ring states (`paratrain.parallel.context.ring`):
per attention call, forward cp − 1 sends of one K/V block of 2·B·Hk·2c·E·s bytes, backward cp − 1 K/V
sends and cp fp32 dK/dV sends. The measured side (peak activation bytes per rank, K/V bytes sent) is
`tests/parallel/context/test_context_parallel.py` and `tests/plan/test_plan_vs_measured.py`.
"""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.models.configs import get_model_config
from paratrain.plan import Layout, Recompute, Workload, comm_bytes_per_rank, estimate, get_hardware, search
from paratrain.plan.activations import layer_activation_bytes
from paratrain.plan.memory import stage_activation_bytes
from paratrain.plan.model_states import DTYPE_BYTES
from paratrain.plan.ring import ring_attention_saved_bytes
from paratrain.plan.search import SearchSpace

LLAMA3_8B = get_model_config("llama3-8b")
H100 = get_hardware("h100-80gb")


def _kv_block(model, batch: int, seq: int, cp: int, tp: int, itemsize: int) -> int:
    """2·B·Hk·2c·E·s with 2c = seq/cp tokens on a rank and Hk/tp kv heads on a tp rank (ring.py's docstring)."""
    return 2 * batch * (model.n_kv_heads // tp) * (seq // cp) * model.head_dim * itemsize


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("tp, sp", [(1, False), (8, True), (4, False)])
def test_layer_activations_are_the_tokens_of_one_rank_without_the_scores(precision, tp, sp):
    """cp 2 and 4 against cp 1: every term at s/cp tokens, the scores (5·a·s/h) replaced by what the ring saves."""
    s, b, h, a = 32768, 1, LLAMA3_8B.dim, LLAMA3_8B.n_heads
    itemsize = DTYPE_BYTES[precision]
    one = layer_activation_bytes(s, b, h, a, tp, sp, Recompute.NONE, precision)
    for cp in (2, 4):
        local = s // cp
        scores = 5 * a * local / h * local * b * h / tp * itemsize / 2
        without = layer_activation_bytes(local, b, h, a, tp, sp, Recompute.NONE, precision) - scores
        ring = 4 * b * a * local / tp + (4 * b * local * h / tp if itemsize < 4 else 0)  # fp32 lse, fp32 output copy
        assert layer_activation_bytes(s, b, h, a, tp, sp, Recompute.NONE, precision, cp=cp) == pytest.approx(
            without + ring, rel=1e-12)
        assert ring_attention_saved_bytes(local, b, h, a, tp, precision) == ring
        assert without == pytest.approx((one - 5 * a * s / h * s * b * h / tp * itemsize / 2) / cp, rel=1e-12)
    cp2, cp4 = (layer_activation_bytes(s, b, h, a, tp, sp, Recompute.NONE, precision, cp=cp) for cp in (2, 4))
    assert cp4 == pytest.approx(cp2 / 2, rel=1e-12)  # ∝ 1/cp
    for mode in (Recompute.FULL, Recompute.SELECTIVE):
        cp2, cp4 = (layer_activation_bytes(s, b, h, a, tp, sp, mode, precision, kv_heads=8, ffn_dim=14336, cp=cp)
                    for cp in (2, 4))
        assert cp4 == pytest.approx(cp2 / 2, rel=1e-12)


def test_a_stage_holds_its_tokens_logits_and_one_ring_in_flight():
    work = Workload.for_model(LLAMA3_8B, seq_len=65536, global_batch=4, precision="bf16")
    base = stage_activation_bytes(work, Layout(dp=4, tp=8, sequence_parallel=True), 0)
    s, local, tp = 65536, 65536 // 4, 8
    lay = Layout(dp=1, cp=4, tp=tp, sequence_parallel=True)
    per_layer = layer_activation_bytes(s, 1, LLAMA3_8B.dim, LLAMA3_8B.n_heads, tp, True, precision="bf16", cp=4)
    logits = local * LLAMA3_8B.vocab_size * 4 / tp
    kv, dkv = (_kv_block(LLAMA3_8B, 1, s, 4, tp, size) for size in (2, 4))
    expanded = kv * LLAMA3_8B.n_heads // LLAMA3_8B.n_kv_heads  # the computed block at query heads, and its grads
    expected = per_layer * LLAMA3_8B.n_layers + logits + 2 * kv + 2 * dkv + 2 * expanded
    assert stage_activation_bytes(work, lay, 0) == pytest.approx(expected, rel=1e-12)
    assert stage_activation_bytes(work, lay, 0) < 1.15 * base / 4  # ∝ 1/cp, plus the ring's fp32 output copy
    explicit = dataclasses.replace(work, flash_attention=False)  # the ring's fallback: fp32 block scores instead
    scores = 3 * 4 * (LLAMA3_8B.n_heads // tp) * local * local
    assert stage_activation_bytes(explicit, lay, 0) - stage_activation_bytes(work, lay, 0) == pytest.approx(
        scores - 2 * expanded, rel=1e-12)


def test_a_flash_kernel_at_cp_1_stores_its_lse_not_the_scores():
    """Korthikanti's 5·a·s/h scores term where the kernel materializes them (bytes per token growing with s);
    a flash kernel's block keeps the same bytes per token at any length, its fp32 lse (4·a/t) among them."""
    s, b, h, a, tp = 8192, 2, 4096, 32, 4
    for sp in (False, True):
        dense = [layer_activation_bytes(n, b, h, a, tp, sp, Recompute.NONE, "bf16") for n in (s, 2 * s)]
        flash = [layer_activation_bytes(n, b, h, a, tp, sp, Recompute.NONE, "bf16", flash=True) for n in (s, 2 * s)]
        assert dense[1] - 2 * dense[0] == pytest.approx(5 * a * s / h * 2 * s * b * h / tp, rel=1e-12)
        assert flash[1] == 2 * flash[0]
        fewer_heads = layer_activation_bytes(s, b, h, a // 2, tp, sp, Recompute.NONE, "bf16", flash=True)
        assert flash[0] - fewer_heads == pytest.approx(4 * b * (a // 2) * s / tp, rel=1e-12)
    work = Workload.for_model(LLAMA3_8B, seq_len=131072, global_batch=8, precision="bf16")
    lay = Layout(dp=8, tp=8, sequence_parallel=True, recompute=Recompute.FULL)
    assert estimate(work, lay, H100).memory.total < 0.5 * estimate(
        dataclasses.replace(work, flash_attention=False), lay, H100).memory.total


def test_the_planned_ring_work_is_the_ring_kernels_calls():
    """The planner's attention core at cp is the causal half of s/cp queries × s keys: exactly what the ring's
    calls compute (`Part`: the own block causal, then one unmasked half-block per step), summed over steps."""
    from paratrain.parallel.context.ring import Part
    from paratrain.plan.ops import Shape, attention_gemms

    seq, cp = 131072, 8
    c = seq // (2 * cp)
    for rank in range(cp):
        calls = [Part.of(rank, (rank - step) % cp) for step in range(cp)]
        pairs = sum((2 * c) ** 2 / 2 if p is Part.OWN else
                    len(range(2 * c)[p.queries(c)]) * len(range(2 * c)[p.keys(c)]) for p in calls)
        x = Shape.of(LLAMA3_8B, 1, seq, 1, False, "bf16", True, cp=cp)
        qk = attention_gemms(x)[0]
        assert x.flash and x.ring_steps == cp
        assert 0.5 * qk.m * qk.n == pairs  # per head: the causal half of the rank's queries × all keys


@pytest.mark.parametrize("cp, tp, precision, recompute", [
    (2, 1, "fp32", Recompute.NONE), (4, 8, "bf16", Recompute.NONE), (8, 2, "bf16", Recompute.FULL)])
def test_ring_bytes_per_step_are_the_formula(cp, tp, precision, recompute):
    """Per layer and micro-batch: forward cp − 1 K/V blocks, backward cp − 1 K/V blocks + cp fp32 dK/dV blocks;
    full recomputation runs the forward's ring again."""
    seq, batch, mb = 16384, 16, 2
    work = Workload.for_model(LLAMA3_8B, seq_len=seq, global_batch=batch, precision=precision)
    lay = Layout(dp=2, cp=cp, tp=tp, micro_batch=mb, recompute=recompute, zero=1)
    kv = _kv_block(LLAMA3_8B, mb, seq, cp, tp, DTYPE_BYTES[precision])
    dkv = _kv_block(LLAMA3_8B, mb, seq, cp, tp, 4)
    forwards = 2 if recompute is Recompute.FULL else 1
    per_layer = forwards * (cp - 1) * kv + (cp - 1) * kv + cp * dkv
    microbatches = batch // (2 * mb)
    sent = comm_bytes_per_rank(work, lay)
    assert sent["cp"] == per_layer * LLAMA3_8B.n_layers * microbatches
    # gradients are reduced (and ZeRO shards) over dp × cp: the runtime's "dp_cp" axis
    assert "dp" not in sent and sent["dp_cp"] > 0
    assert lay.shard_ranks == 2 * cp and lay.world_size == 2 * cp * tp


def test_gradients_reduce_over_dp_times_cp():
    """cp ranks see other tokens of the same sequences: DDP all-reduces over the dp × cp ranks, 2·Ψ·(n−1)/n."""
    work = Workload.for_model(LLAMA3_8B, seq_len=32768, global_batch=2, precision="fp32")
    sent = comm_bytes_per_rank(work, Layout(dp=1, cp=2, bucket_mb=1e6))
    assert sent["dp_cp"] == pytest.approx(2 * 4 * LLAMA3_8B.num_params() / 2, rel=1e-9)
    zero3 = estimate(work, Layout(dp=2, cp=4, zero=3), H100).memory
    assert zero3.params == pytest.approx(4 * LLAMA3_8B.num_params() / 8, rel=1e-9)


def test_the_ring_hides_behind_its_blocks_until_the_link_is_slow():
    work = Workload.for_model(LLAMA3_8B, seq_len=131072, global_batch=1, precision="bf16")
    lay = Layout(cp=8, tp=8, sequence_parallel=True)
    fast = estimate(work, lay, H100).time
    slow = estimate(work, lay, dataclasses.replace(H100, intra_node_bytes_per_s=H100.intra_node_bytes_per_s / 1000,
                                                   inter_node_bytes_per_s=H100.inter_node_bytes_per_s / 1000)).time
    seconds = comm_bytes_per_rank(work, lay)["cp"] / (H100.inter_node_bytes_per_s / 1000 * H100.link_efficiency)
    assert 0 < fast.cp_comm < 0.05 * fast.total
    assert slow.cp_comm == pytest.approx(seconds, rel=0.5) and slow.cp_comm > 10 * fast.cp_comm
    assert estimate(work, Layout(dp=64), H100).time.cp_comm == 0.0


def test_the_128k_search_picks_context_parallelism_because_it_avoids_recomputation():
    """llama3-8b, 131072 tokens, 64 H100s (ZeRO-3, micro-batch 1 to keep the search small), flash attention
    everywhere: cp 1 fits only with full recomputation or pipelining; the best layout has cp > 1 and recomputes
    nothing, and is faster than the best without cp."""
    work = Workload.for_model(LLAMA3_8B, seq_len=131072, global_batch=32, precision="bf16")
    result = search(work, 64, H100, SearchSpace(zero=(3,), micro_batch=(1,)))
    best = result.best
    assert best is not None and best.layout.cp > 1 and best.layout.recompute is Recompute.NONE
    no_cp = [e for e in result.ranked if e.layout.cp == 1]
    assert no_cp and all(e.layout.recompute is not Recompute.NONE or e.layout.pp > 1 for e in no_cp)
    assert best.time.total < min(e.time.total for e in no_cp)
    short = search(dataclasses.replace(work, seq_len=4096, global_batch=512), 64, H100,
                   SearchSpace(zero=(3,), micro_batch=(1,)))
    assert {e.layout.cp for e in short.ranked} == {1}  # cp is tried for long sequences only


def test_the_issues_command_picks_cp_and_a_fixed_cp_is_estimated(capsys):
    """`paratrain plan --model llama3-8b --seq 131072 --gpus 64`, as the issue spells it (no --global-batch: 4M
    tokens per step), picks cp > 1; `--cp` fixes the degree of one estimate, whose step time shows the ring."""
    import json

    from paratrain.cli import main

    assert main(["plan", "--model", "llama3-8b", "--seq", "131072", "--gpus", "64", "--json", "--top", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["global_batch"] == 32 and doc["layouts"][0]["cp"] > 1
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "131072", "--cp", "8", "--tp", "8",
                 "--sequence-parallel", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "layout: dp=1 cp=8 tp=8" in out and "cp comm (exposed)" in out and "fits in 80 GB" in out
