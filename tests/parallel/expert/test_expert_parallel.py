"""Expert parallelism: the ep axis's groups, its rules, and ep2 on 2 ranks against one process.

Parity: AdamW steps with clipping on the same global batches as one process (the MoE's auxiliary
loss included), losses and final parameters within 1e-5, DDP and ZeRO-1, gradients summed over
the data ranks (the trainer's convention: the token-loss sum over the global token count, the
auxiliary loss averaged over the global batch's sequences, `MoE.aux_rows`). The all-to-all bytes
are counted where they reach torch.distributed (`Collectives`) and equal the bytes of the routed
rows. All 2-rank cases share one launch.
"""

from __future__ import annotations

import re
import dataclasses
import functools

import pytest
import torch

from paratrain.mesh import MeshError, MeshShape, build_mesh, replicated_over
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel import rules
from paratrain.parallel.api import DataParallel, parallelize
from paratrain.parallel.expert import moe_layers
from paratrain.testing import Collectives
from paratrain.error_model import FP32_ADAMW
from parallel_cases import (adamw, assert_matches_reference, batches, launch_once, make_model, parallel_run,
                             reference_run)

MOE = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32,
                  n_experts=4, top_k=2, expert_ffn_dim=16, aux_loss_coef=0.1, z_loss_coef=0.01)
STEPS, BATCH, LR = 6, 8, 1e-2


# -- the axis and the rules, without processes ---------------------------------------------------------

def test_ep_groups_are_neighbouring_data_ranks_and_replicas_every_ep_th():
    shape = MeshShape(dp=4, tp=2, ep=2)
    assert shape.groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert shape.groups("ep_replicate") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert shape.coords(6)["ep"] == 1 and shape.coords(6)["ep_replicate"] == 1
    assert "ep" in shape.axes and "ep" not in MeshShape(dp=4).axes
    with pytest.raises(MeshError, match="--ep 3 must divide the data-parallel degree 4"):
        MeshShape(dp=4, ep=3)


def test_expert_tensors_are_copies_only_along_their_replicas():
    assert replicated_over(False, False, expert=True) == ("ep_replicate", "tp")
    assert replicated_over(True, False, expert=True) == ("tp",)
    assert replicated_over(False, False) == ("dp", "cp", "tp")


@pytest.mark.parametrize("changes, message", [
    ({"ep": 3}, "--ep 3 does not divide dp = 4"),
    ({"model": ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)},
     "--ep 2 needs a mixture-of-experts model"),
    ({"model": dataclasses.replace(MOE, n_experts=6), "dp": 4, "ep": 4}, "--ep 4 does not divide the model's 6 "
                                                                        "experts; choose --ep among [1, 2]"),
    ({"dp_shard": 2, "zero": 1}, "--ep 2 with --dp-shard 2 is not supported yet"),
])
def test_bad_expert_layouts_end_in_one_line(changes, message):
    spec = rules.LayoutSpec(**{"dp": 4, "ep": 2, "model": MOE, **changes})
    with pytest.raises(rules.LayoutRuleError, match=re.escape(message)) as info:
        rules.check_layout(spec)
    assert "\n" not in str(info.value)


# -- 2 ranks ----------------------------------------------------------------------------------------

def _parallel(mesh, zero: int, data, one_expert: bool = False, reduction: str = "sum"):
    with torch.device("meta"):
        model = Transformer(MOE)
    init = functools.partial(_init, one_expert)
    model, optimizer = parallelize(model, mesh, optimizer=functools.partial(adamw, lr=LR), init=init,
                                   data=DataParallel(zero=zero, grad_reduction=reduction))
    for layer in moe_layers(model.module):  # the auxiliary loss averaged over the global batch, as `train_step` sets
        layer.aux_rows = BATCH if reduction == "sum" else BATCH // 2  # it; a mean: over this rank's own rows
    sizes = {n: tuple(p.shape) for n, p in model.module.named_parameters() if ".experts." in n}
    losses = parallel_run(model, optimizer, data, mesh.rank, 2, lambda t: model.comm_sum(t),
                          loss_scale=2.0 if reduction == "mean" else 1.0)
    return losses, model.full_state_dict(), sizes


def _init(one_expert: bool, name: str, shape) -> torch.Tensor:
    value = Transformer(MOE).param_init(name, shape, 0)
    if one_expert and name.endswith("router.weight"):  # expert 3 then 1 first for every token (inputs normed > 0)
        value = torch.zeros(shape)
    return value


def _a2a_bytes(mesh):
    """One forward and backward of ep2: (bytes sent on ep per Collectives, bytes of the routed rows, by hand)."""
    with torch.device("meta"):
        model = Transformer(MOE)
    model, _ = parallelize(model, mesh, init=lambda name, shape: Transformer(MOE).param_init(name, shape, 0))
    x = batches(steps=1)[0][0][mesh.rank * 4:(mesh.rank + 1) * 4]
    counted = Collectives()
    with counted:
        model(x).float().pow(2).mean().backward()
    per_layer = [layer.last_tokens_per_expert for layer in moe_layers(model.module)]
    gathered = [torch.zeros_like(c) for c in per_layer for _ in range(2)]
    for i, counts in enumerate(per_layer):
        torch.distributed.all_gather(gathered[2 * i:2 * i + 2], counts)
    return counted.by_axis(mesh).get("ep", 0.0), [c.tolist() for c in gathered]


def _all_cases(rank, world):  # noqa: ARG001
    mesh = build_mesh(MeshShape(dp=2, ep=2))
    data = batches(steps=STEPS, batch=BATCH)
    return {
        "ddp": _parallel(mesh, 0, data),
        "zero1": _parallel(mesh, 1, data),
        # Each rank's loss its own batch's share (× dp), gradients averaged: dense ones over the 2 data ranks, the
        # experts' (held by one rank each, ep_replicate = 1) divided by dp = 2 as well, not by their 1 replica.
        "mean": _parallel(mesh, 0, data, reduction="mean"),
        "one_expert": _parallel(mesh, 0, data[:2], one_expert=True),
        "a2a": _a2a_bytes(mesh),
    }


_CACHE: dict = {}


def _results():
    return launch_once(_CACHE, 2, _all_cases)


def _reference(one_expert: bool = False, steps: int = STEPS):
    model = make_model(MOE)
    if one_expert:
        with torch.no_grad():
            for layer in moe_layers(model):
                layer.router.weight.zero_()
    for layer in moe_layers(model):
        layer.aux_rows = BATCH
    return reference_run(model, batches(steps=steps, batch=BATCH), lr=LR)


@pytest.mark.parametrize("case", ["ddp", "zero1", "mean"])
def test_ep2_trains_like_one_process(case):
    ref_losses, ref_params = _reference()
    for rank, (losses, params, sizes) in enumerate(r[case] for r in _results()):
        assert sizes["layers.0.feed_forward.experts.w1"] == (2, 16, 32)  # each rank holds its 2 of 4 experts
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW, f"rank {rank}")


def test_every_token_to_one_expert_still_equals_one_process():
    """A zero router: every probability equal, top-k takes experts 0 and 1 (rank 0's) for every token; rank 1's
    experts get no token at all, and the result is still one process's."""
    ref_losses, ref_params = _reference(one_expert=True, steps=2)
    for losses, params, _ in (r["one_expert"] for r in _results()):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


def test_all_to_all_bytes_are_the_routed_rows():
    """Per layer and rank: forward sends the rows routed to the other rank's experts and returns the outputs of the
    rows it received; backward the same again; plus E/ep int64 counts. D fp32 elements per row."""
    row = MOE.dim * 4
    for rank, (sent, counts) in enumerate(_results()[i]["a2a"] for i in range(2)):
        expected = 0
        for layer in range(MOE.n_layers):
            mine, other = counts[2 * layer + rank], counts[2 * layer + 1 - rank]
            away = sum(mine[2 * (1 - rank):2 * (1 - rank) + 2])  # my rows to the other rank's experts
            came = sum(other[2 * rank:2 * rank + 2])  # its rows to mine
            expected += 2 * (away + came) * row + 2 * 8
        assert sent == expected, (rank, sent, expected)


def test_ep_token_alone_is_as_many_data_ranks():
    from paratrain.verify import format_layout, num_processes, parse_layout

    assert parse_layout("ep2") == {"ep": 2, "dp": 2} and num_processes(parse_layout("ep2")) == 2
    assert num_processes(parse_layout("ep2,tp2")) == 4 and num_processes(parse_layout("pp2,ep2,1f1b")) == 4
    assert format_layout(parse_layout("dp4,ep2,zero1")) == "dp4,ep2,zero1"
