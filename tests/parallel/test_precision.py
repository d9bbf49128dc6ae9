"""Mixed precision: floating-point inputs cast, loss scaling, skipped steps agreed by all ranks; activation
checkpointing is exact."""

import collections
import copy
import functools
import math

import pytest
import torch
from torch import nn

from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, parallelize
from paratrain.precision import DTYPES, LossScaler, PrecisionError, precision_policy
from paratrain.testing import run_on_ranks
from paratrain.error_model import FP32_ADAMW
from parallel_cases import (adamw, assert_matches_reference, batches, launch_once, loss_sum, make_model, parallel_run,
                             reference_run)


def test_policies():
    assert precision_policy("fp32").mixed is False
    bf16 = precision_policy("bf16", "bf16")
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.bfloat16 and bf16.mixed
    assert precision_policy("fp16").needs_loss_scaling
    with pytest.raises(PrecisionError, match="--precision 'fp8'"):
        precision_policy("fp8")


def test_cast_inputs_casts_floating_point_tensors_only():
    bf16 = precision_policy("bf16")
    x, ids, mask = torch.randn(2, 3), torch.arange(3), torch.ones(3, dtype=torch.bool)
    pair = collections.namedtuple("Pair", "a b")
    args, kwargs = bf16.cast_inputs(((x, [ids, pair(x.double(), mask)]), {"h": x, "n": 3}))
    assert torch.equal(args[0], x.to(torch.bfloat16)) and args[1][0] is ids
    assert isinstance(args[1][1], pair) and args[1][1].a.dtype == torch.bfloat16 and args[1][1].b is mask
    assert kwargs["h"].dtype == torch.bfloat16 and kwargs["n"] == 3
    assert precision_policy("fp32").cast_inputs(x) is x


def _float_inputs(rank, world):
    """An nn.Sequential fed fp32 inputs (the same rows on every rank) in bf16 and fp16 on every engine, and
    torch's autocast on the same weights: outputs, input gradients (the loss scaled alike), the weights after
    one AdamW step. Also an embedding's token ids, which stay integers."""
    mesh = build_mesh(MeshShape(dp=world))
    results = {}
    for precision in ("bf16", "fp16"):
        dtype = DTYPES[precision]
        for zero in range(4):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
            reference = copy.deepcopy(net)
            model, optimizer = parallelize(net, mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                                           precision=precision, data=DataParallel(zero=zero))
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            out = model(x)
            model.scale_loss(out.float().square().mean()).backward()
            optimizer.step()
            with torch.autocast("cpu", dtype=dtype):
                out_ref = reference(x_ref)
            (out_ref.float().square().mean() * model.scaler.scale).backward()
            for p in reference.parameters():
                p.grad /= model.scaler.scale  # a power of two: exact
            torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
            results[precision, zero] = {
                "out": out.detach(), "out_ref": out_ref.detach(), "x_grad": x.grad, "x_grad_ref": x_ref.grad,
                "params": {n: v.to(dtype) for n, v in model.full_state_dict().items()},
                "params_ref": {n: p.detach().to(dtype) for n, p in reference.named_parameters()}}
        seen = []
        embedded, _ = parallelize(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)), mesh, precision=precision)
        embedded.module[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        ids = torch.arange(10).view(2, 5)
        results[precision, "ids"] = (embedded(ids).dtype, seen[0].dtype, torch.equal(seen[0], ids))
    return results


_FLOAT_INPUTS: dict = {}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_floating_point_inputs_are_cast_to_the_compute_dtype(precision, zero):
    for result in launch_once(_FLOAT_INPUTS, 2, _float_inputs, timeout=120):
        r = result[precision, zero]
        assert r["out"].dtype == DTYPES[precision] and torch.equal(r["out"], r["out_ref"])
        assert r["x_grad"].dtype == torch.float32 and torch.equal(r["x_grad"], r["x_grad_ref"])
        assert r["params"].keys() == r["params_ref"].keys()
        for name, value in r["params_ref"].items():
            assert torch.equal(r["params"][name], value), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_integer_inputs_are_left_alone(precision):
    for result in launch_once(_FLOAT_INPUTS, 2, _float_inputs, timeout=120):
        assert result[precision, "ids"] == (DTYPES[precision], torch.int64, True)


def test_loss_scaler_backs_off_and_grows():
    scaler = LossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    state = scaler.state_dict()
    fresh = LossScaler(enabled=True)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def _overflow_on_rank_1(rank, world, zero):
    mesh = build_mesh(MeshShape(dp=world))
    model, optimizer = parallelize(make_model(), mesh, optimizer=adamw, precision="fp16",
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    x, y = batches(steps=1)[0]
    history = []
    for step in range(3):
        before = {k: v.clone() for k, v in model.full_state_dict().items()}
        loss = loss_sum(model, x[rank::world], y[rank::world]) / (y != -100).sum()
        if step == 1 and rank == 1:
            loss = loss * math.inf  # one rank overflows: every rank must skip this step
        model.scale_loss(loss).backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        after = model.full_state_dict()
        moved = any(not torch.equal(before[k], after[k]) for k in before)
        history.append((moved, model.scaler.scale, model.scaler.skipped_steps))
    return history


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(zero):
    for history in run_on_ranks(_overflow_on_rank_1, 2, zero, timeout=120):
        (moved0, scale0, _), (moved1, scale1, skipped1), (moved2, _, skipped2) = history
        assert moved0 and not moved1 and moved2
        assert scale1 == scale0 / 2 and skipped1 == 1 and skipped2 == 1


def _checkpointed(rank, world, zero, every):
    mesh = build_mesh(MeshShape(dp=world))
    model, optimizer = parallelize(make_model(), mesh, optimizer=adamw, activation_checkpointing=every,
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    names = [n for n, _ in model.module.named_parameters()]
    losses = parallel_run(model, optimizer, batches(steps=5), rank, world, lambda t: model.comm.all_reduce(t, "dp"))
    saved = _saved_tensors(model)
    return losses, {k: v.clone() for k, v in model.full_state_dict().items()}, names, saved


def _saved_tensors(model) -> int:
    """How many tensors autograd keeps for backward in one forward."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    x, y = batches(steps=1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum(model, x, y)
    return count


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_activation_checkpointing_is_exact_and_saves_less(zero):
    ref_losses, ref_params = reference_run(make_model(), batches(steps=5))
    losses, params, names, saved_every = run_on_ranks(_checkpointed, 2, zero, 1, timeout=120)[0]
    _, _, _, saved_half = run_on_ranks(_checkpointed, 2, zero, 2, timeout=120)[0]
    assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)
    assert names == [n for n, _ in make_model().named_parameters()], "parameter names are unchanged"
    if zero != 3:  # ZeRO-3 keeps its own saved-tensor hooks innermost, hiding what this count sees
        reference_saved = _saved_tensors(make_model())
        assert saved_every < saved_half < reference_saved
