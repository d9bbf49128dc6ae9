"""The planner's mixture of experts: total vs active parameters, expert memory per rank by ep, the all-to-all
volume per MoE layer and its time, the assumed load imbalance, the layout search over ep.

Each number is the formula of `paratrain.plan.moe` written out again here from the model's shape, or
a published one (Mixtral 8x7B: 46.7B parameters, 12.9B active per token, Jiang et al. 2024 §2.1).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from paratrain.models import Transformer
from paratrain.models.configs import get_model_config
from paratrain.plan import GB, Layout, PlanError, Workload, comm_bytes_per_rank, estimate_memory, get_hardware, \
    search, step_flops, step_time
from paratrain.plan import moe
from paratrain.plan.collectives import Collective, ep_collectives
from paratrain.plan.memory import stage_dense_params, stage_expert_params
from paratrain.plan.search import SearchSpace

MIXTRAL = get_model_config("mixtral-8x7b")


def moe_active(model) -> int:
    return model.num_active_params()

TINY_MOE = get_model_config("tiny-moe")


def _expert(model) -> int:
    return 3 * model.dim * model.expert_hidden_dim


def test_mixtral_total_and_active_parameters_are_the_published_ones():
    assert MIXTRAL.num_params() / 1e9 == pytest.approx(46.7, abs=0.05)
    assert moe_active(MIXTRAL) / 1e9 == pytest.approx(12.9, abs=0.05)
    assert moe.inactive_params(MIXTRAL) == 32 * (8 - 2) * _expert(MIXTRAL)


def test_active_parameters_count_a_live_model():
    """N from the module's own parameters; N_a = N less the (E − k) experts per layer that a token skips."""
    with torch.device("meta"):
        model = Transformer(TINY_MOE)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert total == TINY_MOE.num_params()
    assert experts == TINY_MOE.n_layers * moe.routed_params_per_layer(TINY_MOE)
    assert moe_active(TINY_MOE) == total - experts * (TINY_MOE.n_experts - TINY_MOE.top_k) // TINY_MOE.n_experts


def test_model_flops_use_the_active_parameters():
    work = Workload.for_model(MIXTRAL, seq_len=4096, global_batch=8)
    tokens = 8 * 4096
    matmul_active = moe_active(MIXTRAL) - MIXTRAL.vocab_size * MIXTRAL.dim  # the lookup does no arithmetic
    expected = (6 * matmul_active + 12 * MIXTRAL.n_layers * MIXTRAL.dim * 4096) * tokens
    assert step_flops(work, Layout(dp=8)).model == pytest.approx(expected)
    every_expert = (6 * (MIXTRAL.num_params() - MIXTRAL.vocab_size * MIXTRAL.dim)
                    + 12 * MIXTRAL.n_layers * MIXTRAL.dim * 4096) * tokens
    assert every_expert / expected > 3  # counting all experts would overstate a step's work 3.5 times


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_state_is_divided_by_ep_and_zero_shards_it_within_its_replica_group(ep, zero):
    """Dense state over dp (ZeRO as usual), expert state E/ep per layer, ZeRO-sharded over the dp/ep ranks
    holding the same experts: bf16 params 2, grads 2, fp32 master 4 and moments 8 bytes (ZeRO-3: fp32 shard)."""
    dp = 16
    work = Workload.for_model(MIXTRAL, seq_len=4096, global_batch=dp)
    mem = estimate_memory(work, Layout(dp=dp, ep=ep, zero=zero))
    experts = MIXTRAL.n_layers * MIXTRAL.n_experts // ep * _expert(MIXTRAL)
    dense = MIXTRAL.num_params() - MIXTRAL.n_layers * MIXTRAL.n_experts * _expert(MIXTRAL)
    assert stage_expert_params(work, Layout(dp=dp, ep=ep), 0) == experts
    assert stage_dense_params(work, Layout(dp=dp, ep=ep), 0) == dense
    n, n_e = dp, dp // ep

    def states(psi, ranks):
        if zero == 3:
            return 16 * psi / ranks
        return (2 * psi + 2 * psi / (ranks if zero >= 2 else 1) + 12 * psi / (ranks if zero >= 1 else 1))

    assert mem.params + mem.grads + mem.optimizer_state == pytest.approx(states(dense, n) + states(experts, n_e))


def test_more_ep_needs_less_memory_and_the_search_finds_mixtral_a_layout_on_64_gpus():
    work = Workload.for_model(MIXTRAL, seq_len=4096, global_batch=256)
    totals = [estimate_memory(work, Layout(dp=64, ep=ep, zero=1, recompute="full")).total for ep in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] > 80 * GB > totals[-1]  # ep 1 holds all 45B expert parameters on every rank: no fit
    result = search(work, 64, get_hardware("h100-80gb"), SearchSpace(micro_batch=(1,), sequence_parallel=(False,)),
                    top=5)
    assert result.best is not None and result.best.layout.ep > 1
    assert {e.layout.ep for e in result.ranked} <= {1, 2, 4, 8}


@pytest.mark.parametrize("ep,recompute", [(2, "none"), (4, "none"), (8, "full")])
def test_all_to_all_volume_per_layer(ep, recompute):
    """Per MoE layer and micro-batch: dispatch + combine forward and backward (+ forward again under full
    recompute), each T·k·h·bytes·(ep−1)/ep·c per rank, c the assumed imbalance."""
    c = 1.5
    work = Workload.for_model(MIXTRAL, seq_len=4096, global_batch=64 * 2, moe_imbalance=c)
    lay = Layout(dp=64, ep=ep, zero=1, micro_batch=1, recompute=recompute)
    tokens, m = 4096, 2
    one = tokens * MIXTRAL.top_k * MIXTRAL.dim * 2 * (ep - 1) / ep * c
    assert moe.all_to_all_bytes(tokens, MIXTRAL, ep, 2, c) == pytest.approx(one)
    per_layer = 4 + (2 if recompute == "full" else 0)
    assert comm_bytes_per_rank(work, lay)["ep"] == pytest.approx(m * MIXTRAL.n_layers * per_layer * one, rel=1e-9)
    assert moe.all_to_all_bytes(tokens, MIXTRAL, 1, 2, c) == 0
    assert "ep" not in comm_bytes_per_rank(work, dataclasses.replace(lay, ep=1))


def test_all_to_all_time_is_exposed_on_the_links_its_group_spans():
    """An ep group of ep × tp neighbouring ranks: inside a node up to 8, over InfiniBand beyond; its time
    adds to the step, (n − 1) latencies and the bytes at the link's bandwidth per call."""
    hw = get_hardware("h100-80gb")
    work = Workload.for_model(MIXTRAL, seq_len=4096, global_batch=128)
    times = {ep: step_time(work, Layout(dp=64, ep=ep, zero=1), hw).ep_comm for ep in (1, 8, 16)}
    assert times[1] == 0
    calls = ep_collectives(work, Layout(dp=64, ep=8, zero=1), 0)
    assert calls == [Collective("all_to_all", 4096 * 2 * 4096 * 2 * 1.25, 8, 4 * 32)]
    c = calls[0]
    intra = c.count * 7 * hw.intra_node_latency_s + c.bytes_sent / (hw.intra_node_bytes_per_s * hw.link_efficiency)
    assert times[8] == pytest.approx(2 * intra)  # two micro-batches
    assert times[16] > times[8] * 16 / 8  # crosses nodes: the slower links
    total = step_time(work, Layout(dp=64, ep=8, zero=1), hw)
    assert total.total == pytest.approx(total.compute + total.exposed_comm + total.bubble + total.optimizer)
    assert total.exposed_comm >= total.ep_comm > 0


def test_imbalance_scales_routed_work_and_is_checked():
    work = {c: Workload.for_model(MIXTRAL, seq_len=4096, global_batch=64, moe_imbalance=c) for c in (1.0, 2.0)}
    lay = Layout(dp=64, ep=8, zero=1)
    assert comm_bytes_per_rank(work[2.0], lay)["ep"] == pytest.approx(2 * comm_bytes_per_rank(work[1.0], lay)["ep"])
    assert estimate_memory(work[2.0], lay).activations > estimate_memory(work[1.0], lay).activations
    with pytest.raises(PlanError, match="--moe-imbalance"):
        Workload.for_model(MIXTRAL, moe_imbalance=0.5)


def test_dense_models_search_no_ep():
    work = Workload.for_model(get_model_config("tiny"), seq_len=256, global_batch=8)
    result = search(work, 8, get_hardware("h100-80gb"))
    assert {e.layout.ep for e in result.ranked} == {1}


def test_plan_command_prints_active_parameters_and_the_all_to_all(capsys):
    from paratrain.cli import main

    assert main(["plan", "--model", "mixtral-8x7b", "--dp", "64", "--ep", "8", "--zero", "1", "--seq-len", "4096",
                 "--global-batch", "128", "--moe-imbalance", "1.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["active_params"] == moe_active(MIXTRAL)
    assert doc["workload"]["moe_imbalance"] == 1.5
    row = doc["layouts"][0]
    assert row["ep"] == 8 and row["comm_bytes_per_rank"]["ep"] > 0 and row["breakdown"]["ep_comm_s"] > 0
    assert main(["plan", "--model", "mixtral-8x7b", "--dp", "64", "--ep", "8", "--zero", "1", "--seq-len", "4096",
                 "--global-batch", "128"]) == 0
    out = capsys.readouterr().out
    assert "12.88B active: top-2 of 8 experts; assumed load imbalance 1.25 max/mean" in out
    assert "ep all-to-all" in out
