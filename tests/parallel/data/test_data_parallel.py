"""DDP and ZeRO-1/2/3 against one process: losses, parameters, memory, communication, overlap."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from torch import nn

from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, parallelize, parallelize_run
from paratrain.testing import RankFailure, run_on_ranks
from paratrain.error_model import FP32_ADAMW
from parallel_cases import (TINY, OpRecorder, OverlapTrace, adamw, assert_matches_reference, batches, launch_once,
                             loss_sum, make_model, parallel_run, reference_run)


# AdamW steps of every parity case: a misplaced reduction moves the second step's loss, and the parameters, by far
# more than 1e-5; the third step's update reads moments two steps built.
STEPS = 3


def _parity(rank, world, zero, micro, precision, reduction="sum"):
    """Under the mean reduction each rank's loss is N× its share of the global one (the engine divides by N)."""
    mesh = build_mesh(MeshShape(dp=world))
    model, optimizer = parallelize(make_model(), mesh, optimizer=adamw, precision=precision,
                                   data=DataParallel(zero=zero, grad_reduction=reduction))
    comm = model.comm
    losses = parallel_run(model, optimizer, batches(steps=STEPS), rank, world, lambda t: comm.all_reduce(t, "dp"), micro=micro,
                          loss_scale=world if reduction == "mean" else 1)
    return losses, {k: v.float() for k, v in model.full_state_dict().items()}


STAGES = [0, 1, 2, 3]
# The runs of `_parity` each world size makes, (zero, rows per micro-batch, precision, reduction): one launch each.
PARITY_RUNS = {
    1: [(zero, None, "fp32", "sum") for zero in STAGES],
    2: [(zero, micro, precision, reduction) for zero in STAGES for micro, precision, reduction in (
        (None, "fp32", "sum"), (1, "fp32", "sum"), (1, "fp32", "mean"), (1, "bf16", "mean"), (1, "bf16", "sum"),
        (None, "bf16", "sum"))],
    4: [(zero, None, "fp32", "sum") for zero in STAGES],
}


def _parity_runs(rank, world):
    return {run: _parity(rank, world, *run) for run in PARITY_RUNS[world]}


_RUNS: dict = {}


def parity(world, zero, micro, precision, reduction="sum"):
    """Every rank's (losses, parameters) of one `_parity` run: all the runs of a world size share one launch."""
    return [per_rank[zero, micro, precision, reduction]
            for per_rank in launch_once(_RUNS, world, _parity_runs, timeout=300)]


_REFERENCE = {}


def _each_stage(rank, world, fn, zeros):
    """`fn(rank, world, zero)` for each ZeRO stage of `zeros`, one after the other on these ranks."""
    return {zero: fn(rank, world, zero) for zero in zeros}


_STAGES: dict = {}


def per_stage(fn, zero: int, zeros=tuple(STAGES), world: int = 2) -> list:
    """Every rank's `fn(rank, world, zero)`; the runs of all `zeros` share one launch per `fn` and world (a
    launch costs more than these runs)."""
    cache = _STAGES.setdefault((fn.__name__, world), {})
    return [per_rank[zero] for per_rank in launch_once(cache, world, _each_stage, fn, tuple(zeros), timeout=300)]


def reference():
    if not _REFERENCE:
        _REFERENCE["fp32"] = reference_run(make_model(), batches(steps=STEPS))
    return _REFERENCE["fp32"]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("zero", STAGES)
def test_equivalence_with_one_process(world, zero):
    ref_losses, ref_params = reference()
    for losses, params in parity(world, zero, None, "fp32"):
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


@pytest.mark.parametrize("zero", [s for s in STAGES if s != 1])
def test_gradient_accumulation_equals_one_big_batch(zero):
    """k micro-batches of b rows on N ranks equal one process with batch k·b·N."""
    ref_losses, ref_params = reference()
    losses, params = parity(2, zero, 1, "fp32")[0]
    assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


@pytest.mark.parametrize("zero", STAGES)
def test_mean_reduction_with_accumulation_equals_one_process(zero):
    """The default reduction averages over data ranks: every micro-batch's gradient is divided once, whether
    it is the first written into a bucket or added to it (each rank's loss is N× its share of the global one)."""
    ref_losses, ref_params = reference()
    losses, params = parity(2, zero, 1, "fp32", "mean")[0]
    assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


@pytest.mark.parametrize("zero", STAGES)
def test_mean_reduction_of_bf16_gradients_equals_the_sum(zero):
    """bf16 gradients reduced in fp32: widened before they are divided, and a division by 2 of a loss made
    2× larger is exact, so averaging gives the summed run's numbers exactly."""
    mean_losses, mean_params = parity(2, zero, 1, "bf16", "mean")[0]
    sum_losses, sum_params = parity(2, zero, 1, "bf16")[0]
    assert mean_losses == sum_losses
    for name, value in sum_params.items():
        torch.testing.assert_close(mean_params[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("zero", STAGES)
def test_bf16_tracks_fp32(zero):
    ref_losses, _ = reference()
    losses, _ = parity(2, zero, None, "bf16")[0]
    # bf16 keeps 8 bits of mantissa: step by step the loss stays within 2% of fp32.
    assert losses == pytest.approx(ref_losses, rel=2e-2)


class PlainModel(torch.nn.Module):
    """Not paratrain's: a tied weight, a layer used twice, and a parameter that never gets a gradient."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.proj = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight
        self.unused = torch.nn.Parameter(torch.ones(6, 4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, x):
        h = self.emb(x)
        h = torch.tanh(self.proj(h))
        h = torch.tanh(self.proj(h))
        return self.head(h)


def _plain_parity(rank, world, zero):
    mesh = build_mesh(MeshShape(dp=world))
    model, optimizer = parallelize(PlainModel(), mesh, optimizer=adamw,
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    losses = parallel_run(model, optimizer, batches(steps=STEPS), rank, world, lambda t: model.comm.all_reduce(t, "dp"))
    return losses, {k: v.clone() for k, v in model.full_state_dict().items()}


@pytest.mark.parametrize("zero", STAGES)
def test_a_model_that_is_not_paratrains(zero):
    ref_losses, ref_params = reference_run(PlainModel(), batches(steps=STEPS))
    losses, params = per_stage(_plain_parity, zero)[0]
    assert torch.equal(params["unused"], ref_params["unused"]), "no gradient anywhere: never updated"
    assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


class BranchModel(PlainModel):
    """A branch taken only for batches holding some row that needs it: on some steps one rank's backward
    reaches `extra` and the other's does not."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(32, 32)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in self.extra.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.taken: list[bool] = []

    def forward(self, x):
        h = torch.tanh(self.proj(self.emb(x)))
        needs = (x[:, :1] < 12).float()[..., None]  # rows whose first token is small
        self.taken.append(bool(needs.any()))
        if self.taken[-1]:  # a row that does not need it gets nothing from it either way
            h = h + needs * self.extra(h)
        return self.head(h)


def _branch_parity(rank, world, zero):
    mesh = build_mesh(MeshShape(dp=world))
    module = BranchModel()
    model, optimizer = parallelize(module, mesh, optimizer=adamw, data=DataParallel(zero=zero, grad_reduction="sum"))
    losses = parallel_run(model, optimizer, batches(steps=STEPS), rank, world, lambda t: model.comm.all_reduce(t, "dp"))
    return losses, {k: v.clone() for k, v in model.full_state_dict().items()}, module.taken


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_parameter_one_rank_reached_is_updated_on_every_rank(zero):
    """The used flags are summed over the data ranks: a rank whose backward did not reach a parameter still
    applies the gradient the other rank's backward made (and drops nothing another rank needs)."""
    ref_losses, ref_params = reference_run(BranchModel(), batches(steps=STEPS))
    results = per_stage(_branch_parity, zero, zeros=(0, 1, 2))
    taken = [r[2] for r in results]
    assert any(a != b for a, b in zip(*taken)), "some step must take the branch on one rank only"
    for losses, params, _ in results:
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


def _hf_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _hf_parity(rank, world, zero):
    mesh = build_mesh(MeshShape(dp=world))
    model, optimizer = parallelize(_hf_model(), mesh, optimizer=adamw,
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    losses = parallel_run(model, optimizer, batches(steps=STEPS), rank, world, lambda t: model.comm.all_reduce(t, "dp"))
    return losses, {k: v.clone() for k, v in model.full_state_dict().items()}


@pytest.mark.parametrize("zero", [s for s in STAGES if s in (0, 3)])
def test_a_hugging_face_model(zero):
    ref_losses, ref_params = reference_run(_hf_model(), batches(steps=STEPS))
    losses, params = per_stage(_hf_parity, zero, zeros=(0, 3))[0]
    assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)


def _one_measured_step(rank, world, zero, precision, reduce_dtype):
    """Bytes sent and resident model state of one step, read as the optimizer step begins: the moment every
    kind of state exists at once (ZeRO-2's gradient shards and mixed precision's fp32 grads live only for
    the step)."""
    mesh = build_mesh(MeshShape(dp=world))
    model, optimizer = parallelize(make_model(), mesh, optimizer=adamw, precision=precision,
                                   reduce_dtype=reduce_dtype, data=DataParallel(zero=zero, grad_reduction="sum"))
    (x0, y0), (x, y) = batches(steps=2)
    parallel_run(model, optimizer, [(x0, y0)], rank, world, lambda t: None)  # warm-up: optimizer state exists
    model.comm.reset()
    per_rank = x.shape[0] // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    (loss_sum(model, x[rows], y[rows]) / (y != -100).sum()).backward()
    model.clip_grad_norm_(1.0)
    resident = {}
    optimizer.register_step_pre_hook(lambda *_: resident.update(model.resident_bytes(optimizer)))
    optimizer.step()
    return model.comm.bytes_by_axis().get("dp", 0), resident


def _one_fp32_step(rank, world, zero):
    return _one_measured_step(rank, world, zero, "fp32", None)


PSI = TINY.num_params()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("zero", STAGES)
def test_communication_bytes_match_theory(world, zero):
    """2Ψ (N−1)/N; ZeRO-3 3Ψ (N−1)/N less the tables its backward does not gather: the embedding (its
    backward reads only the indices) and the output head (still gathered from its forward)."""
    sent, _ = per_stage(_one_fp32_step, zero, world=world)[0]
    elements = (3 * PSI - 2 * TINY.vocab_size * TINY.dim if zero == 3 else 2 * PSI) * (world - 1) / world
    assert sent == pytest.approx(elements * 4, rel=0.05)


def _overlap(rank, world):
    mesh = build_mesh(MeshShape(dp=world))
    model, _ = parallelize(make_model(), mesh, data=DataParallel(zero=0, bucket_mb=0.01))
    x, y = batches(steps=1)[0]
    loss_sum(model, x, y).backward()
    backward_finished_at = time.perf_counter()
    buckets = model.engine.buckets
    model.finish_gradients()
    return len(buckets), buckets[0].launched_in_backward, buckets[0].launched_at < backward_finished_at


def test_first_bucket_is_in_flight_before_backward_ends():
    count, in_backward, earlier = run_on_ranks(_overlap, 2, timeout=60)[0]
    assert count > 3
    assert in_backward and earlier


def _zero2_under_cuda_policy(rank, world):
    """One backward of ZeRO-2 with one reduce-scatter left in flight, as on CUDA: the trace of gradients
    computed (per bucket), reduce-scatters launched and landed; and the reduced rows."""
    mesh = build_mesh(MeshShape(dp=world))
    comm, net = OverlapTrace(mesh), _small_net()
    two_layers_mb = 2 * (SMALL_WIDTH * SMALL_WIDTH + SMALL_WIDTH) * 4 / 2**20
    model, _ = parallelize_run(net, mesh, data=DataParallel(zero=2, bucket_mb=two_layers_mb), comm=comm)
    bucket_of = {id(s.param): i for i, b in enumerate(model.engine.buckets) for s in b.slots}
    for p in net.parameters():  # a tensor hook: it runs as the gradient is computed, before the engine's hook
        p.register_hook(lambda grad, i=bucket_of[id(p)]: comm.mark("gradient", i))
    x, y = _small_rows(rank, 0)
    ((model(x) - y) ** 2).sum().backward()
    return comm.events, len(model.engine.buckets), _reduced_rows(model)


def test_zero2_reduce_scatter_overlaps_the_next_buckets_backward_under_the_cuda_policy():
    """On CUDA a wait makes the compute stream wait: bucket k's reduce-scatter must land only once the
    gradients of bucket k+1 are computed (when k+1 launches), or backward stops for every reduction.
    The reduced gradients are still one process's mean."""
    world = 2
    reference = _small_net()
    for rank in range(world):
        x, y = _small_rows(rank, 0)
        (((reference(x) - y) ** 2).sum() / world).backward()
    for events, count, grads in run_on_ranks(_zero2_under_cuda_policy, world, timeout=120):
        assert count > 3
        for k in range(count - 1):
            launched = events.index(("launch", "reduce_scatter", k))
            landed = events.index(("land", "reduce_scatter", k))
            next_gradients = [i for i, e in enumerate(events) if e == ("gradient", k + 1)]
            assert len(next_gradients) > 1  # the bucket's first gradient is not its last
            assert launched < next_gradients[0] and landed > next_gradients[-1], (k, events)
        _assert_rows_match(grads, reference)


def _lbfgs(rank, world):
    mesh = build_mesh(MeshShape(dp=world))
    parallelize(make_model(), mesh, optimizer=lambda p: torch.optim.LBFGS(p), data=DataParallel(zero=1))


def test_non_elementwise_optimizer_is_refused():
    with pytest.raises(RankFailure, match="ParallelConfigError: ZeRO shards optimizer state .*LBFGS"):
        run_on_ranks(_lbfgs, 1, timeout=60)


def _grads_during_accumulation(rank, world, zero):
    mesh = build_mesh(MeshShape(dp=world))
    model, optimizer = parallelize(make_model(), mesh, optimizer=adamw,
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    x, y = batches(steps=1)[0]
    with model.no_sync():
        loss_sum(model, x[:2], y[:2]).backward()
    in_grad = [n for n, p in model.module.named_parameters() if p.grad is not None]
    return in_grad, model.resident_bytes(optimizer)["grads"]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_accumulation_holds_each_gradient_once(zero):
    """Under no_sync DDP / ZeRO-1 add every micro-batch into the buckets: no .grad beside them (one copy,
    Ψ·4 bytes). ZeRO-2 reduces each backward as the context exits and keeps only its shard (Ψ·4/N)."""
    psi = sum(p.numel() for p in make_model().parameters())
    for in_grad, grad_bytes in per_stage(_grads_during_accumulation, zero, zeros=(0, 1, 2)):
        assert in_grad == []
        expected = psi * 4 / (2 if zero == 2 else 1)
        assert grad_bytes == pytest.approx(expected, rel=0.05)  # padding of row chunks only


SMALL_LAYERS, SMALL_WIDTH = 32, 8
# The ops by which the engine writes gradients into its buckets (autograd's own backward makes none of them).
BUCKET_WRITES = ("aten.copy_.default", "aten.add_.Tensor", "aten.mul.out", "aten.mul_.Scalar",
                 "aten._foreach_copy_.default", "aten._foreach_mul_.Scalar", "aten._foreach_add_.List")


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(SMALL_WIDTH, SMALL_WIDTH) for _ in range(SMALL_LAYERS)))


def _small_rows(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(3, SMALL_WIDTH, generator=g), torch.randn(3, SMALL_WIDTH, generator=g)


def _reduced_rows(model) -> dict[str, tuple[tuple[int, int], torch.Tensor]]:
    """After the reduction, per parameter: the rows this rank holds and their gradient."""
    model.finish_gradients()
    return {name: (rows, master.grad.clone()) for (name, rows, _), master
            in zip(model.engine.master_rows(), model.engine.masters())}


def _assert_rows_match(grads, reference: nn.Module) -> None:
    expected = dict(reference.named_parameters())
    for name, ((lo, hi), grad) in grads.items():
        torch.testing.assert_close(grad, expected[name].grad[lo:hi], rtol=1e-5, atol=1e-6, msg=name)


def _small_gradient_writes(rank, world, zero):
    mesh = build_mesh(MeshShape(dp=world))
    model, _ = parallelize(_small_net(), mesh, optimizer=adamw, data=DataParallel(zero=zero, grad_reduction="mean"))
    with OpRecorder() as ops:
        for micro in range(2):  # the first accumulates, the second reduces
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                x, y = _small_rows(rank, micro)
                ((model(x) - y) ** 2).sum().backward()
    return {op: ops.counts[op] for op in BUCKET_WRITES if ops.counts[op]}, _reduced_rows(model)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_small_gradients_are_written_a_batch_at_a_time(zero):
    """64 small parameters, two backward passes: the engine writes their gradients into its buckets with a
    few foreach kernels (copies, their division by N, adds), not one or two launched from Python for each
    parameter; the reduced gradients are one process's mean of the ranks' (each rank's rows under ZeRO)."""
    world = 2
    reference = _small_net()
    for rank in range(world):
        for micro in range(2):
            x, y = _small_rows(rank, micro)
            (((reference(x) - y) ** 2).sum() / world).backward()
    for writes, grads in per_stage(_small_gradient_writes, zero, zeros=(0, 1, 2), world=world):
        # A handful per backward (ZeRO-2's own copies and adds of the reduced shard included): one per
        # parameter would be 64 in each.
        assert sum(writes.values()) <= 4 * 2, writes
        _assert_rows_match(grads, reference)


class _Interrupted(Exception):
    pass


def _interrupt(_grad):
    raise _Interrupted


def _small_backward(model, net, rank, micro, interrupt_at=None):
    """One micro-batch's backward (under no_sync, for a parallel model). With interrupt_at it raises when it
    reaches that layer's output: the layers after it have their gradients by then, as a real error midway
    leaves them."""
    def arm(_module, _inputs, out):
        out.register_hook(_interrupt)

    handle = None if interrupt_at is None else net[interrupt_at].register_forward_hook(arm)
    try:
        with getattr(model, "no_sync", contextlib.nullcontext)():
            x, y = _small_rows(rank, micro)
            ((model(x) - y) ** 2).sum().backward()
    finally:
        if handle is not None:
            handle.remove()


def _after_an_interrupted_backward(rank, world, zero):
    net = _small_net()
    model, optimizer = parallelize(net, build_mesh(MeshShape(dp=world)), optimizer=adamw,
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    with pytest.raises(_Interrupted):
        _small_backward(model, net, rank, 0, interrupt_at=SMALL_LAYERS // 2)
    _small_backward(model, net, rank, 1)
    return model.resident_bytes(optimizer)["grads"], _reduced_rows(model)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_backward_that_raises_leaves_no_gradient_waiting_after_the_next(zero):
    """A backward interrupted by an error never reaches its end, where the gradients that wait for their
    bucket are written. The next backward still writes them all when it ends: after it each gradient exists
    once (Ψ·4 bytes, Ψ·4/N under ZeRO-2, not a copy waiting beside its bucket), and the reduced gradients are
    what one process has after the same two backward passes (the interrupted one's included, as in .grad)."""
    world = 2
    reference = _small_net()
    for rank in range(world):
        with pytest.raises(_Interrupted):
            _small_backward(reference, reference, rank, 0, interrupt_at=SMALL_LAYERS // 2)
        _small_backward(reference, reference, rank, 1)
    psi = sum(p.numel() for p in reference.parameters())
    for grad_bytes, grads in run_on_ranks(_after_an_interrupted_backward, world, zero, timeout=120):
        assert grad_bytes == pytest.approx(psi * 4 / (world if zero == 2 else 1), rel=0.05)
        _assert_rows_match(grads, reference)
