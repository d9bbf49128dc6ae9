"""The planner under hybrid sharding (HSDP, --dp-shard): memory, bytes and time per axis, the search, CLI, report.

dp = dp_replicate × dp_shard: ZeRO shards over a group of S = dp_shard neighbouring data ranks and
keeps R = dp / S replicas of the shards. Model state follows 1/S; the reduce-scatters and
all-gathers run within the shard group (axis dp_shard), and each reduce-scatter's 1/S shard is
all-reduced over the R replicas (axis dp_replicate).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from paratrain.cli import main as cli_main
from paratrain.commands.report import format_summary, load_run
from paratrain.commands.report_plan import planned_comm, predicted_step
from paratrain.config import Config
from paratrain.models import get_model_config
from paratrain.plan import (
    Collective,
    Layout,
    SearchSpace,
    Workload,
    comm_bytes_per_rank,
    estimate,
    estimate_memory,
    get_hardware,
    layout_violations,
    model_state_bytes,
    search,
    step_time,
)
from paratrain.plan.collectives import axis_is_intra_node

LLAMA_7B = get_model_config("llama2-7b")
H100 = get_hardware("h100-80gb")  # 8 GPUs per node; NVLink 450 GB/s, InfiniBand 50 GB/s per GPU
SLOW = dataclasses.replace(H100, inter_node_bytes_per_s=25e9)  # HDR InfiniBand: 200 Gb/s per GPU
FAST = dataclasses.replace(H100, inter_node_bytes_per_s=H100.intra_node_bytes_per_s)  # as fast as NVLink


def run_plan(capsys, *argv):
    code = cli_main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- memory -----------------------------------------------------------------------------------


@pytest.mark.parametrize("precision, reduce_dtype", [("bf16", None), ("bf16", "fp32"), ("fp32", None)])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_model_states_of_a_shard_group_are_plain_zero_over_the_group(zero, precision, reduce_dtype):
    """dp 32 in shard groups of 8 holds per rank what ZeRO over 8 ranks holds, whatever the replicas."""
    work = Workload.for_model(LLAMA_7B, seq_len=4096, precision=precision, reduce_dtype=reduce_dtype)
    hybrid = estimate_memory(work, Layout(dp=32, dp_shard=8, zero=zero))
    plain = estimate_memory(work, Layout(dp=8, zero=zero))
    for kind in ("params", "grads", "master_weights", "adam_moments", "activations"):
        assert getattr(hybrid, kind) == getattr(plain, kind), kind
    states = model_state_bytes(LLAMA_7B.num_params(), 8, zero, precision, reduce_dtype)
    assert hybrid.params + hybrid.grads + hybrid.optimizer_state == pytest.approx(
        states.params + states.grads + states.optimizer_state)
    assert hybrid.total > estimate_memory(work, Layout(dp=32, zero=zero)).total  # the price of replicas


def test_a_reduced_shard_on_its_way_between_replicas_is_one_more_buffer():
    """ZeRO-3: 1/S of the largest unit's gradients (the root: embedding + head + final norm here); ZeRO-2:
    1/S of a bucket; ZeRO-1 sums its shard in place in the bucket."""
    work = Workload.for_model(LLAMA_7B, seq_len=4096, reduce_dtype="fp32")
    root = 2 * LLAMA_7B.vocab_size * LLAMA_7B.dim + LLAMA_7B.dim
    extra = {1: 0.0, 2: 25 * 2**20 / 8, 3: root * 4 / 8}
    for zero, more in extra.items():
        hybrid = estimate_memory(work, Layout(dp=32, dp_shard=8, zero=zero)).comm_buffers
        assert hybrid == pytest.approx(estimate_memory(work, Layout(dp=8, zero=zero)).comm_buffers + more), zero


def test_a_shard_group_of_the_whole_data_axis_is_the_plain_layout():
    work = Workload.for_model(LLAMA_7B, seq_len=4096, global_batch=64)
    plain, whole = Layout(dp=32, zero=3), Layout(dp=32, zero=3, dp_shard=32)
    assert estimate(work, whole, H100).to_dict(H100) == estimate(work, plain, H100).to_dict(H100)
    assert list(comm_bytes_per_rank(work, whole)) == ["dp", "tp", "pp"]
    assert whole.label() == plain.label() == "dp=32 tp=1 pp=1 zero=3 mb=1 recompute=none"
    assert Layout(dp=32, zero=3, dp_shard=8).label().startswith("dp=32 dp_shard=8 tp=1")


# -- communication per axis ------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bytes_per_axis_are_the_theory(zero):
    """Ψ parameters, bf16 parameters P = 2Ψ bytes, fp32 gradients G = 4Ψ, m = 2 micro-batches, S = 8, R = 4.

    dp_shard: ZeRO's reduce-scatter (per micro-batch from ZeRO-2) and all-gather (ZeRO-3: before
    forward and again before backward, per micro-batch) of the full model, (S−1)/S each;
    dp_replicate: 2·(G/S)·(R−1)/R after every reduce-scatter.
    """
    psi, s, r, m = 1e9, 8, 4, 2
    work = Workload.for_params(psi, precision="bf16", reduce_dtype="fp32", global_batch=32 * m)
    params, grads = 2 * psi, 4 * psi
    reductions = 1 if zero == 1 else m
    gathers = 2 * m if zero == 3 else 1
    comm = comm_bytes_per_rank(work, Layout(dp=32, dp_shard=s, zero=zero))
    assert set(comm) == {"dp_shard", "dp_replicate", "tp", "pp"}
    assert comm["dp_shard"] == pytest.approx((reductions * grads + gathers * params) * (s - 1) / s)
    assert comm["dp_replicate"] == pytest.approx(reductions * 2 * (grads / s) * (r - 1) / r)
    plain = comm_bytes_per_rank(work, Layout(dp=32, zero=zero))["dp"]
    assert plain == pytest.approx((reductions * grads + gathers * params) * 31 / 32)


def test_shard_groups_run_on_nvlink_and_replicas_on_the_links_between_nodes():
    """Ranks pp × dp × tp, tp innermost: a shard group is dp_shard × tp neighbours, a replica group strides
    over the whole data axis."""
    assert axis_is_intra_node(Layout(dp=32, dp_shard=8, zero=3), "dp_shard", 8)
    assert not axis_is_intra_node(Layout(dp=32, dp_shard=8, zero=3), "dp_replicate", 8)
    assert not axis_is_intra_node(Layout(dp=16, tp=2, dp_shard=8, zero=3), "dp_shard", 8)  # 16 ranks: 2 nodes
    assert axis_is_intra_node(Layout(dp=16, tp=2, dp_shard=4, zero=3), "dp_shard", 8)
    assert axis_is_intra_node(Layout(dp=8, dp_shard=2, zero=3), "dp_replicate", 8)  # all 8 in one node


def test_step_time_splits_the_data_axis_and_adds_up():
    """ZeRO-3, Ψ only (one unit), m = 2 long micro-batches: each axis's collectives hide behind the compute
    but for the last of each, the shard group's on NVLink, the replicas' all-reduce of G/S on InfiniBand."""
    psi, s, r, m = 1e9, 8, 4, 2
    work = Workload.for_params(psi, precision="bf16", global_batch=32 * 8 * m)
    lay = Layout(dp=32, dp_shard=s, zero=3, micro_batch=8)
    t = step_time(work, lay, SLOW)
    assert set(t.dp_comm_by_axis) == {"dp_shard", "dp_replicate"}
    inter = (SLOW.inter_node_bytes_per_s * SLOW.link_efficiency, SLOW.inter_node_latency_s)
    intra = (SLOW.intra_node_bytes_per_s * SLOW.link_efficiency, SLOW.intra_node_latency_s)
    last_sum = Collective("all_reduce", 2 * psi / s, r).seconds(*inter)
    assert t.dp_comm_by_axis["dp_replicate"] == pytest.approx(last_sum)
    first_gather_last_reduce = sum(Collective(kind, 2 * psi, s).seconds(*intra)
                                   for kind in ("all_gather", "reduce_scatter"))
    assert t.dp_comm_by_axis["dp_shard"] == pytest.approx(first_gather_last_reduce)
    all_sums = Collective("all_reduce", 2 * psi / s, r, m).seconds(*inter)
    shard_total = sum(Collective(kind, 2 * psi, s, count).seconds(*intra)
                      for kind, count in (("all_gather", 2 * m), ("reduce_scatter", m)))
    assert t.dp_comm_total == pytest.approx(all_sums + shard_total)
    assert t.dp_comm == pytest.approx(sum(t.dp_comm_by_axis.values()))
    assert t.total == pytest.approx(t.compute + t.tp_comm + t.pp_comm + t.dp_comm + t.bubble + t.optimizer + t.sync)
    assert {"dp_shard_comm_s", "dp_replicate_comm_s"} <= set(t.as_dict())
    plain = step_time(work, Layout(dp=32, zero=3, micro_batch=8), SLOW)
    assert set(plain.dp_comm_by_axis) == {"dp"} and plain.dp_comm_by_axis["dp"] == plain.dp_comm
    assert t.dp_comm_total < plain.dp_comm_total / 4  # NVLink for the big collectives, 1/8 of the bytes across nodes


def test_rules_refuse_a_shard_group_that_cannot_run():
    work = Workload.for_model(LLAMA_7B, seq_len=4096, global_batch=64)
    messages = [v.message for v in layout_violations(work, Layout(dp=32, dp_shard=3, zero=3), 32)]
    assert any("--dp-shard 3 does not divide dp = 32" in m for m in messages)
    messages = [v.message for v in layout_violations(work, Layout(dp=32, dp_shard=8, zero=0), 32)]
    assert any("needs --zero 1, 2 or 3" in m for m in messages)
    assert layout_violations(work, Layout(dp=32, dp_shard=8, zero=1), 32) == []


# -- search -------------------------------------------------------------------------------------


def _best_by_shard(result) -> dict[int, float]:
    """The best step time of the tp = 1 layouts, by shard group size."""
    best: dict[int, float] = {}
    for est in result.ranked:
        best.setdefault(est.layout.shard_ranks, est.time.total)
    return best


def test_search_picks_hybrid_sharding_when_the_links_between_nodes_are_slow():
    """Llama 2 7B, ZeRO-3, 4 nodes × 8 H100s, 25 GB/s per GPU between nodes: sharding within a node and
    all-reducing 1/8 of the gradients across nodes beats gathering all 32 shards over InfiniBand."""
    work = Workload.for_model(LLAMA_7B, seq_len=4096, global_batch=64)
    result = search(work, 32, SLOW, SearchSpace(zero=(3,)))
    best = result.best.layout
    assert (best.dp, best.dp_shard, best.dp_replicate, best.tp) == (32, 8, 4, 1)
    tp1 = _best_by_shard(search(work, 32, SLOW, SearchSpace(zero=(3,), tp=1)))
    assert tp1[8] < tp1[32] and tp1[8] == min(tp1.values())


def test_with_links_between_nodes_as_fast_as_nvlink_full_sharding_is_enough():
    work = Workload.for_model(LLAMA_7B, seq_len=4096, global_batch=64)
    assert search(work, 32, FAST, SearchSpace(zero=(3,))).best.layout.dp_replicate == 1
    tp1 = _best_by_shard(search(work, 32, FAST, SearchSpace(zero=(3,), tp=1)))
    assert tp1[32] < tp1[8]


def test_search_enumerates_shard_groups_only_with_zero():
    """Every divisor of dp is a shard group for ZeRO 1-3 (the whole data axis written 0, once); DDP has none."""
    work = Workload.for_model(get_model_config("tiny"), seq_len=128, global_batch=64)
    result = search(work, 32, H100, SearchSpace(tp=1, pp=1, micro_batch=(1,), recompute=("none",),
                                                sequence_parallel=(False,)))
    assert result.searched == result.num_feasible == 1 + 3 * 6
    groups = {zero: sorted(est.layout.shard_ranks for est in result.ranked if est.layout.zero == zero)
              for zero in range(4)}
    assert groups == {0: [32], 1: [1, 2, 4, 8, 16, 32], 2: [1, 2, 4, 8, 16, 32], 3: [1, 2, 4, 8, 16, 32]}
    assert sum(est.layout.dp_shard == 32 for est in result.ranked) == 0  # no split is dp_shard 0


# -- command line -------------------------------------------------------------------------------


SEVEN_B = ("--model", "llama2-7b", "--seq", "4096", "--global-batch", "64")


def test_help_lists_dp_shard(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert "--dp-shard" in help_text and "hybrid sharding" in help_text


def test_cli_search_ranks_the_hybrid_layout_first(capsys):
    code, out, _ = run_plan(capsys, *SEVEN_B, "--gpus", "32", "--zero", "3", "--inter-node-gbps", "25", "--json",
                            "--top", "3")
    assert code == 0
    row = json.loads(out)["layouts"][0]
    assert (row["dp"], row["dp_shard"], row["tp"], row["zero"]) == (32, 8, 1, 3)
    assert set(row["comm_bytes_per_rank"]) == {"dp_shard", "dp_replicate", "tp", "pp"}
    code, out, _ = run_plan(capsys, *SEVEN_B, "--gpus", "32", "--zero", "3", "--inter-node-gbps", "25", "--top", "3")
    assert code == 0
    assert "   #   dp shard  cp  ep  tp  pp zero" in out and "best: dp=32 dp_shard=8 tp=1 pp=1 zero=3" in out
    assert "25 GB/s between nodes" in out


def test_cli_estimates_one_hybrid_layout(capsys):
    code, out, _ = run_plan(capsys, *SEVEN_B, "--dp", "32", "--dp-shard", "8", "--zero", "3",
                            "--inter-node-gbps", "25")
    assert code == 0
    assert "layout: dp=32 dp_shard=8 tp=1" in out
    assert "    dp_shard" in out and "    dp_replicate" in out
    assert "communication per rank per step (GB sent): dp_shard " in out
    code, out, _ = run_plan(capsys, *SEVEN_B, "--dp", "32", "--dp-shard", "8", "--zero", "3", "--json")
    row = json.loads(out)["layouts"][0]
    assert row["dp_shard"] == 8 and {"dp_shard_comm_s", "dp_replicate_comm_s"} <= set(row["breakdown"])


def test_cli_search_with_a_fixed_shard_group(capsys):
    code, out, _ = run_plan(capsys, *SEVEN_B, "--gpus", "32", "--zero", "3", "--dp-shard", "8", "--json",
                            "--top", "50")
    assert code == 0
    rows = json.loads(out)["layouts"]
    assert rows and all(row["dp_shard"] == 8 for row in rows)


@pytest.mark.parametrize("argv, message", [
    (["--dp", "8", "--dp-shard", "3", "--zero", "3"], "--dp-shard 3 does not divide dp = 8"),
    (["--dp", "8", "--dp-shard", "2"], "needs --zero 1, 2 or 3"),
    (["--dp", "8", "--dp-shard", "-1", "--zero", "1"], "--dp-shard must be 0 (the whole data axis) or a positive"),
])
def test_bad_shard_groups_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_plan(capsys, "--model", "tiny", *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


# -- paratrain report ------------------------------------------------------------------------------


def write_hybrid_run(path, steps=3):
    """A dp4 = 2 replicas × 2 shards ZeRO-3 fp32 run of `tiny`, one micro-batch per step, as the runtime
    records it: bytes and exposed seconds per axis, dp_shard and dp_replicate (dp: the loss sums)."""
    path.mkdir(parents=True)
    config = Config().to_dict()
    config["parallel"].update(dp=4, dp_shard=2, zero=3)
    config["train"].update(global_batch=8, micro_batch=2)
    (path / "config.json").write_text(json.dumps(config))
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            breakdown = {"compute_s": 0.30, "optimizer_s": 0.02, "data_s": 0.001, "checkpoint_s": 0.0,
                         "comm_exposed_s": {"dp": 0.001, "dp_shard": 0.05, "dp_replicate": 0.04, "world": 0.002},
                         "pipeline_wait_s": 0.0, "other_s": 0.004}
            f.write(json.dumps({"step": step, "loss": 4.0, "step_time_s": 0.42, "time_breakdown_s": breakdown,
                                "comm_bytes": {"dp": 48, "dp_shard": 18_720_000, "dp_replicate": 6_330_000}})
                    + "\n")
    return path


def test_report_sets_plan_numbers_beside_each_axis_of_a_hybrid_run(tmp_path):
    run = load_run(write_hybrid_run(tmp_path / "hsdp"))
    assert run.layout == "dp4,shard2,zero3"
    tiny = get_model_config("tiny")
    full, table = 4 * tiny.num_params(), 4 * tiny.vocab_size * tiny.dim  # fp32 bytes of the model, of one table
    planned = planned_comm(run)
    # 2 gathers + 1 reduce-scatter, (S−1)/S; the embedding's and the head's backward gather nothing
    assert planned["dp_shard"] == pytest.approx((3 * full - 2 * table) / 2, abs=1)
    assert planned["dp_replicate"] == pytest.approx(2 * (full / 2) / 2, abs=1)  # 2·(G/S)·(R−1)/R
    hardware = get_hardware("a100-80gb")
    text = format_summary([run], hardware)
    assert (f"comm MB/step: dp 0.00, dp_replicate 6.33 (plan {planned['dp_replicate'] / 1e6:.2f}), "
            f"dp_shard 18.72 (plan {planned['dp_shard'] / 1e6:.2f})") in text
    predicted = predicted_step(run, hardware)
    assert f"exposed comm dp_shard                   0.050{predicted.dp_comm_by_axis['dp_shard']:>12.3f}" in text
    assert f"exposed comm dp_replicate               0.040{predicted.dp_comm_by_axis['dp_replicate']:>12.3f}" in text
    assert "hsdp (dp4,shard2,zero3)" in text
