"""ZeRO-3: parity with one process, communication and memory against the formulas, meta materialization.

Multi-rank checks run on 2 and 4 gloo ranks. Each dp degree runs its scenarios
in one launch (`suite` fixture) and the tests below assert on the results: a
rank's first optimizer step imports torch._dynamo (≈3.5 s of CPU per process),
which a launch per scenario would pay again and again on this 2-core machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import Mesh, MeshShape, build_mesh
from paratrain.models import ModelConfig, Transformer
from paratrain.models.llama import Attention, FeedForward
from paratrain.parallel.data.shard import row_range, row_tiles, rows_per_rank
from paratrain.parallel.data.zero3 import FullyShardedEngine, ZeroConfigError
from paratrain.parallel.data.units import row_shape
from paratrain.peak_memory import ProcessPeak, return_freed_memory
from paratrain.precision import Precision, precision_policy
from paratrain.testing import run_on_ranks
from paratrain.error_model import FP32_ADAMW, FP64_PARITY, ErrorModel
from parallel_cases import assert_matches_reference

SEED = 3
STEPS = 5
LR = 1e-2
MAX_NORM = 1.0  # clips some steps of the transformers, every step of the plain net
BATCH, SEQ = 8, 8  # global batch: 8 sequences of 8 predicted tokens, split over the dp ranks
UNTIED = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
# 66 rows of embedding pad to 17 per rank at dp=4 (the last rank holds 15): padding on a tied table.
TIED = dataclasses.replace(UNTIED, vocab_size=66, n_layers=3, tie_embeddings=True)
# Every dim 0 divisible by 4: no padding, so bytes and memory meet the formulas exactly.
MEASURED = UNTIED
FP32, BF16, FP64 = precision_policy("fp32"), precision_policy("bf16", "bf16"), Precision(
    "fp64", torch.float64, torch.float64, torch.float64)
# fp32 parity after STEPS AdamW steps at lr 1e-2 (a misplaced shard or reduction shows from the second step on): the
# error model of every parity test (paratrain.error_model.FP32_ADAMW: losses per step, parameters per tensor by its
# norm; over 20 steps, element by element, they moved by up to 3.3e-5, dp4 tied, which measures the CPU's rounding,
# not the engine; fewer steps drift less). The engine adds no error of its own: in fp64 it agrees
# to 1e-15 (FP64_PARITY). Global grad norms drift with the parameters, by up to 7e-5 relative: 1e-3 in fp32.
FP32_TOLERANCES = {"model": FP32_ADAMW, "norm_rtol": 1e-3}
# Losses are computed from fp32 logits in both precisions: the bound of one fp32 loss (a sum of n ≤ 10³ token
# losses rounds by √n·ε32 ≈ 4e-6; measured 1.7e-7) for fp64 runs too.
FP64_TOLERANCES = {"model": dataclasses.replace(FP64_PARITY, loss_rtol=1e-5), "norm_rtol": 1e-10}
# bf16 compute and bf16 gradient reduction vs the fp32 single-process losses, per step (relative):
# measured at most 1.0% over 20 steps (dp 2 and 4), the drift of bf16 rounding at lr 1e-2 (fewer steps drift less).
BF16_LOSS_RTOL = 2.5e-2


# -- models, batches, losses ------------------------------------------------------------------

def _meta_transformer(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def _reference_transformer(cfg: ModelConfig) -> Transformer:
    model = _meta_transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    return model


def _tokens(step: int, cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))


def _transformer_loss(model: nn.Module, cfg: ModelConfig, step: int, rows: slice) -> torch.Tensor:
    """This process's share of the global loss: summed over its rows, divided by the global token count."""
    tokens = _tokens(step, cfg)[rows]
    logits = model(tokens[:, :-1]).float()
    loss_sum = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1), reduction="sum")
    return loss_sum / (BATCH * SEQ)


class _Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _PlainNet(nn.Module):
    """A model nobody here wrote: a weight tied across two units, a unit called twice, a weight used
    twice in the root, a parameter never used, a 0-d parameter and a bias of fewer rows than ranks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(_Block(10) for _ in range(3))
        self.blocks[2].fc.weight = self.blocks[0].fc.weight
        self.head = nn.Linear(10, 3)
        self.unused = nn.Parameter(torch.randn(5, 2))
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[1](h)
        reconstruction = F.linear(h, self.inp.weight.t())
        return self.head(h) * self.temperature, reconstruction


def _plain_net() -> _PlainNet:
    torch.manual_seed(SEED)  # every rank builds the same replica
    return _PlainNet()


def _plain_loss(model: nn.Module, step: int, rows: slice) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(BATCH, 6, generator=g)[rows], torch.randn(BATCH, 3, generator=g)[rows]
    out, reconstruction = model(x)
    return (((out - y) ** 2).sum() + 0.1 * ((reconstruction - x) ** 2).sum()) / BATCH


# -- one training loop for the reference and the sharded runs ---------------------------------

def _adamw(params) -> torch.optim.AdamW:
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR)


def finish(engine) -> None:
    """The engine's end of a step's backward passes, as ParallelModel runs it: reduce, sum the used flags over
    the data ranks, then drop the gradients no rank produced."""
    used = engine.finish_gradients().clone()
    if torch.distributed.is_initialized():  # the model's agreement does this (not counted as the engine's)
        torch.distributed.all_reduce(used)
    used = used.tolist()
    engine.drop_gradients([i for i, count in enumerate(used) if count == 0])


def _train(params, loss_of_step, grad_norm, after_step=lambda: None,
           finish_step=lambda: None) -> tuple[list[float], list[float]]:
    """STEPS of loss, backward, clip to MAX_NORM, AdamW; this process's losses and the global grad norms."""
    optimizer = _adamw(params)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of_step(step)
        loss.backward()
        finish_step()
        norm = grad_norm()
        for p in params:
            if p.grad is not None:
                p.grad.mul_((MAX_NORM / (norm + 1e-6)).clamp(max=1.0))  # clip_grad_norm_'s formula
        optimizer.step()
        after_step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def _reference_norm(params):
    return lambda: torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build and run in `dtype` (fp64 runs: parameters, init values, batches)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@functools.cache
def _reference(name: str):
    """Single-process run over the global batch: (losses, grad norms, final state_dict)."""
    with _default_dtype(torch.float64 if name == "tied_fp64" else torch.float32):
        model = _plain_net() if name == "plain" else _reference_transformer(UNTIED if name == "untied" else TIED)
        params = list(model.parameters())
        if name == "plain":
            step_loss = lambda step: _plain_loss(model, step, slice(None))  # noqa: E731
        else:
            step_loss = lambda step: _transformer_loss(model, model.config, step, slice(None))  # noqa: E731
        losses, norms = _train(params, step_loss, _reference_norm(params))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- rank bodies --------------------------------------------------------------------------------

def _shard(model: nn.Module, mesh: Mesh, precision: Precision = FP32, **kwargs):
    comm = Comm(mesh)
    kwargs.setdefault("grad_reduction", "sum")
    engine = FullyShardedEngine(model, comm, precision, **kwargs)
    return engine, comm


def _rows(mesh: Mesh) -> slice:
    per_rank = BATCH // mesh.size("dp")
    return slice(mesh.coord("dp") * per_rank, (mesh.coord("dp") + 1) * per_rank)


def _sharded_norm(engine: FullyShardedEngine):
    def norm():
        sq = engine.local_grad_sq_sum()
        dist.all_reduce(sq)
        return sq.sqrt()
    return norm


def _train_sharded(mesh: Mesh, model: nn.Module, step_loss, **kwargs) -> dict:
    engine, _ = _shard(model, mesh, **kwargs)
    losses, norms = _train(engine.masters(), step_loss, _sharded_norm(engine), engine.after_step,
                           lambda: finish(engine))
    global_losses = torch.tensor(losses)
    dist.all_reduce(global_losses)
    step_loss(STEPS).backward()  # one more backward: which masters got no gradient anywhere
    finish(engine)
    no_grad = [name for name, m in zip(engine.master_names(), engine.masters()) if m.grad is None]
    return {"losses": global_losses.tolist(), "norms": norms, "state": engine.full_state_dict(), "no_grad": no_grad}


def _train_transformer(mesh: Mesh, cfg: ModelConfig, precision: Precision = FP32) -> dict:
    with _default_dtype(precision.master_dtype):
        model = _meta_transformer(cfg)
        step_loss = lambda step: _transformer_loss(model, cfg, step, _rows(mesh))  # noqa: E731
        init = functools.partial(model.param_init, seed=SEED)
        return _train_sharded(mesh, model, step_loss, precision=precision, init=init)


def _train_plain(mesh: Mesh) -> dict:
    model = _plain_net()  # its root reads inp.weight: "blocks" keeps the loose parameters in the root unit
    return _train_sharded(mesh, model, lambda step: _plain_loss(model, step, _rows(mesh)), units="blocks")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(mesh: Mesh, precision: Precision) -> dict:
    """Bytes sent in one step after a warm-up step, and the model state resident after it."""
    model = _meta_transformer(MEASURED)
    engine, comm = _shard(model, mesh, precision=precision, init=functools.partial(model.param_init, seed=SEED))
    optimizer = _adamw(engine.masters())
    for step in range(2):
        comm.reset()
        loss = _transformer_loss(model, MEASURED, step, _rows(mesh))
        forward_bytes = comm.bytes_by_axis().get("dp", 0)
        loss.backward()
        finish(engine)
        optimizer.step()
        engine.after_step()
        if step == 0:
            engine.zero_grad()
    moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    masters = engine.masters()
    return {
        "forward_bytes": forward_bytes,
        "summary": comm.summary()["dp"],
        "state_bytes": _nbytes(masters) + _nbytes(m.grad for m in masters) + _nbytes(moments),
        "resident": engine.resident_bytes(),
        "shard_bytes": _nbytes(masters),
    }


def _accumulation(mesh: Mesh) -> float:
    """Largest |grad| difference: two micro-batches (first under no_sync) vs their union in one backward."""
    model = _meta_transformer(UNTIED)
    engine, _ = _shard(model, mesh, init=functools.partial(model.param_init, seed=SEED))
    rows = _rows(mesh)
    half = (rows.stop - rows.start) // 2
    with engine.no_sync():
        _transformer_loss(model, UNTIED, 0, slice(rows.start, rows.start + half)).backward()
    _transformer_loss(model, UNTIED, 0, slice(rows.start + half, rows.stop)).backward()
    finish(engine)
    accumulated = [m.grad.clone() for m in engine.masters()]
    engine.zero_grad()
    _transformer_loss(model, UNTIED, 0, rows).backward()
    finish(engine)
    return max((a - m.grad).abs().max().item() for a, m in zip(accumulated, engine.masters()) if a.numel())


def _suite(rank: int, world_size: int) -> dict:
    mesh = build_mesh(MeshShape(dp=world_size))
    return {
        "untied": _train_transformer(mesh, UNTIED),
        "tied": _train_transformer(mesh, TIED),
        "tied_fp64": _train_transformer(mesh, TIED, precision=FP64),
        "bf16": _train_transformer(mesh, UNTIED, precision=BF16),
        "plain": _train_plain(mesh),
        "measure_fp32": _measure(mesh, FP32),
        "measure_bf16": _measure(mesh, precision_policy("bf16")),
        "accumulation": _accumulation(mesh),
    }


# -- multi-rank tests ---------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def suite(request):
    return request.param, run_on_ranks(_suite, request.param, timeout=120)


def _assert_matches_reference(result: dict, name: str, model: ErrorModel, norm_rtol: float) -> None:
    losses, norms, state = _reference(name)
    torch.testing.assert_close(torch.tensor(result["norms"], dtype=torch.float64),
                               torch.tensor(norms, dtype=torch.float64), rtol=norm_rtol, atol=0)
    assert result["state"].keys() == state.keys()
    assert_matches_reference(result["losses"], result["state"], losses, state, model, name)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_transformer_matches_single_process(suite, name):
    _, ranks = suite
    for result in ranks:
        _assert_matches_reference(result[name], name, **FP32_TOLERANCES)


def test_transformer_in_fp64_matches_single_process_exactly(suite):
    """Same run in fp64: agreement to rounding, so any error of the engine's own would show."""
    _, ranks = suite
    for result in ranks:
        _assert_matches_reference(result["tied_fp64"], "tied_fp64", **FP64_TOLERANCES)


def test_foreign_model_with_tied_and_unused_parameters_matches_single_process(suite):
    _, ranks = suite
    for result in ranks:
        _assert_matches_reference(result["plain"], "plain", **FP32_TOLERANCES)
        assert result["plain"]["no_grad"] == ["unused"]


def test_bf16_tracks_fp32(suite):
    _, ranks = suite
    losses, _, _ = _reference("untied")
    torch.testing.assert_close(torch.tensor(ranks[0]["bf16"]["losses"]), torch.tensor(losses),
                               rtol=BF16_LOSS_RTOL, atol=0)


def test_gradient_accumulation_under_no_sync(suite):
    _, ranks = suite
    assert max(r["accumulation"] for r in ranks) < 1e-6


def test_bytes_per_step_are_three_psi(suite):
    """fp32: all-gather forward + all-gather backward + reduce-scatter = 3·Ψ·(N−1)/N·4 bytes, less the two
    tables backward does not gather: the embedding (its backward reads only the indices) and the output
    head (the forward's last unit, still gathered when its backward begins).

    The engine issues no all-reduce: which parameters a rank's backward reached travels in the
    model's agreement (here the test's own all-reduce, not counted, as are its loss / grad-norm ones).
    """
    n, ranks = suite
    # units with parameters: each block, and tok_embeddings, norm and output (the root holds none)
    psi, units = MEASURED.num_params(), MEASURED.n_layers + 3
    backward_psi = psi - 2 * MEASURED.vocab_size * MEASURED.dim
    for result in ranks:
        summary = result["measure_fp32"]["summary"]
        assert result["measure_fp32"]["forward_bytes"] == pytest.approx(psi * (n - 1) / n * 4, rel=0.05)
        assert summary["all_gather"]["bytes"] + summary["reduce_scatter"]["bytes"] == pytest.approx(
            (2 * psi + backward_psi) * (n - 1) / n * 4, rel=0.05)
        assert summary["all_gather"]["calls"] == 2 * units - 2 and summary["reduce_scatter"]["calls"] == units
        assert "all_reduce" not in summary
        # bf16: both all-gathers move bf16 params, the reduce-scatter fp32 grads.
        bf16 = result["measure_bf16"]["summary"]
        assert bf16["all_gather"]["bytes"] + bf16["reduce_scatter"]["bytes"] == pytest.approx(
            (2 * (psi + backward_psi) + 4 * psi) * (n - 1) / n, rel=0.05)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resident_model_state_is_16_psi_over_n(suite, precision):
    """Shards + master grads + Adam moments = 16Ψ/N bytes: the fp32 shard is the master in both precisions."""
    n, ranks = suite
    psi = MEASURED.num_params()
    for result in ranks:
        measured = result[f"measure_{precision}"]
        assert measured["state_bytes"] == pytest.approx(16 * psi / n, rel=0.05)
        # nothing gathered is left alive after the step, and the engine's own account agrees
        assert measured["resident"] == {"params": measured["shard_bytes"], "grads": 4 * psi // n, "master": 0}


def _materialize(rank: int, world_size: int) -> dict:
    mesh = build_mesh(MeshShape(dp=world_size))
    model = _meta_transformer(TIED)
    engine, _ = _shard(model, mesh, init=functools.partial(model.param_init, seed=SEED))
    shapes = dict(_meta_transformer(TIED).named_parameters())
    for name, master in zip(engine.master_names(), engine.masters()):
        rows = row_shape(shapes[name].shape)
        lo, hi = row_range(rows[0], world_size, rank)
        full = model.param_init(name, shapes[name].shape, SEED)
        assert torch.equal(master, full.reshape(rows)[lo:hi]), name
        assert model.get_parameter(name) is master
    return _materialization_peak(mesh)


BIG = ModelConfig(vocab_size=1024, dim=1024, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=2816)


def _materialization_peak(mesh: Mesh) -> dict:
    """Peak RSS growth while materializing BIG (204 MiB in fp32) from meta into shards."""
    # Built before the window: the first meta construction of a process imports ≈75 MB of modules.
    model = _meta_transformer(BIG)
    return_freed_memory()  # every tensor its own mapping: RSS follows the tensors alive
    gc.collect()
    peak = ProcessPeak(torch.device("cpu"))
    peak.reset()
    engine, _ = _shard(model, mesh, init=functools.partial(model.param_init, seed=SEED))
    return {"peak_growth": peak.read().peak_bytes - peak.start_bytes, "shard_bytes": _nbytes(engine.masters())}


def test_meta_materialization_keeps_only_the_shard():
    """Shards equal slices of the single-process init; peak RSS grows by ≈ the shard, not the model."""
    full_bytes = BIG.num_params() * 4
    largest = BIG.ffn_dim * BIG.dim * 4
    for result in run_on_ranks(_materialize, 2, timeout=60):
        assert result["shard_bytes"] == pytest.approx(full_bytes / 2, rel=0.01)
        # the shards plus one full init value at a time (measured: shard + 12 MiB, the largest being 11 MiB)
        assert result["peak_growth"] < result["shard_bytes"] + largest + 8 * 2**20
        assert result["peak_growth"] < 0.6 * full_bytes


# -- single-process tests (a one-rank mesh needs no process group) ------------------------------


def _assert_grads_match(engine: FullyShardedEngine, reference: nn.Module) -> None:
    """The engine's step ends; each master's gradient is the reference's (None where it has none)."""
    finish(engine)
    for name, master in zip(engine.master_names(), engine.masters()):
        expected = reference.get_parameter(name).grad
        if expected is None:
            assert master.grad is None, name
        else:
            torch.testing.assert_close(master.grad.reshape(expected.shape), expected, rtol=1e-6, atol=1e-7)


def _gathering(engine: FullyShardedEngine) -> FullyShardedEngine:
    """One rank holds every unit whole and computes on its fp32 shards (`Unit.on_shards`): nothing to gather.
    The tests of the gathers' order and lifetime make each unit gather as it does over several ranks."""
    for unit in engine.units:
        unit.on_shards = False
    return engine

def _solo_mesh() -> Mesh:
    return Mesh(shape=MeshShape(), rank=0, groups={"pp": None, "dp": None, "tp": None})


def test_the_row_split_a_unit_holds_puts_each_ranks_rows_in_its_chunk_and_pads_the_rest():
    """`row_tiles` (computed once per parameter of a unit) against `row_range`: chunk r is rank r's real rows, then
    zeros, every element of the chunks written once, by a tile or as padding (short tensors, empty trailing ranks)."""
    for d0 in range(10):
        for width in (1, 3):
            for n in range(1, 6):
                c = rows_per_rank(d0, n)
                rows = torch.arange(1.0, d0 * width + 1).view(d0, width)
                chunks, writes = torch.full((n, c * width), -1.0), torch.zeros(n, c * width)
                tiles, padding = row_tiles(d0, n, width)
                for part, shape, columns in tiles:
                    chunks[columns] = rows[part].reshape(shape)
                    writes[columns] += 1
                for columns in padding:
                    chunks[columns] = 0.0
                    writes[columns] += 1
                assert (writes == 1).all(), (d0, width, n)
                for rank in range(n):
                    lo, hi = row_range(d0, n, rank)
                    expected = torch.cat([rows[lo:hi].reshape(-1), torch.zeros((c - (hi - lo)) * width)])
                    assert torch.equal(chunks[rank], expected), (d0, width, n, rank)


def test_default_units_are_blocks_and_each_module_with_parameters_outside_them():
    engine, _ = _shard(_meta_transformer(UNTIED), _solo_mesh())
    assert [u.name for u in engine.units] == ["", "tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    assert engine.units[0].params == []  # the root is a unit like the others: nothing is gathered for the whole forward
    engine, _ = _shard(_meta_transformer(UNTIED), _solo_mesh(), units="blocks")
    assert [u.name for u in engine.units] == ["", "layers.0", "layers.1"]
    root_params = {engine.master_names()[fp.index] for fp in engine.units[0].params}
    assert root_params == {"tok_embeddings.weight", "norm.weight", "output.weight"}


def test_default_units_of_a_plain_sequential_are_its_layers():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    engine, _ = _shard(model, _solo_mesh())
    assert [u.name for u in engine.units] == ["", "0", "2"]


def test_a_parameter_read_outside_its_unit_is_named_on_the_first_forward():
    model = _plain_net()  # its root computes F.linear(h, self.inp.weight.t()): inp.weight outside inp's forward
    _shard(model, _solo_mesh())
    with pytest.raises(ZeroConfigError, match=r"'inp.weight' is read outside the forward of its unit \('inp'\).*"
                                              r"units='blocks'"):
        _plain_loss(model, 0, slice(None))


def test_units_from_classes_or_a_predicate():
    engine, _ = _shard(_meta_transformer(UNTIED), _solo_mesh(), units=(Attention, FeedForward))
    assert [u.name for u in engine.units][1:] == ["layers.0.attention", "layers.0.feed_forward",
                                                 "layers.1.attention", "layers.1.feed_forward"]
    engine, _ = _shard(_meta_transformer(UNTIED), _solo_mesh(), units=lambda name, m: name == "layers.1")
    assert [u.name for u in engine.units] == ["", "layers.1"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_one_rank_matches_plain_training_and_frees_gathered_buffers(prefetch):
    reference, sharded = _plain_net(), _plain_net()
    engine, _ = _shard(sharded, _solo_mesh(), prefetch=prefetch, units="blocks")
    _gathering(engine)
    shard_bytes = _nbytes(engine.masters())
    # the root unit (everything outside the blocks) ends the forward: it stays gathered for its backward
    root_bytes = _nbytes(p for name, p in reference.named_parameters() if not name.startswith("blocks."))
    for step in range(3):
        loss = _plain_loss(sharded, step, slice(None))
        # the graph holds the units' saved tensors as references, not their gathered buffers
        assert engine.resident_bytes()["params"] == shard_bytes + root_bytes
        loss.backward()
        assert engine.resident_bytes()["params"] == shard_bytes
        _plain_loss(reference, step, slice(None)).backward()
    _assert_grads_match(engine, reference)


def test_one_rank_computes_on_its_shards():
    """One rank holds every unit whole: in fp32 its modules compute on the shards themselves, nothing gathered at
    any point, with plain training's gradients (a weight tied across units, a unit called twice, a parameter
    never used, a 0-d one)."""
    reference, sharded = _plain_net(), _plain_net()
    engine, _ = _shard(sharded, _solo_mesh(), units="blocks")
    assert all(unit.on_shards for unit in engine.units)
    shard_bytes = _nbytes(engine.masters())
    for step in range(3):
        loss = _plain_loss(sharded, step, slice(None))
        assert engine.resident_bytes()["params"] == shard_bytes
        loss.backward()
        _plain_loss(reference, step, slice(None)).backward()
    _assert_grads_match(engine, reference)


def test_prefetch_gathers_the_next_unit_ahead_in_both_passes():
    model = _meta_transformer(UNTIED)
    engine, _ = _gathering(_shard(model, _solo_mesh())[0]), None
    states = {}

    def record(when):
        states[when] = {u.name: "pending" if u.pending else "gathered"
                        for u in engine.units if u.pending or u.full is not None}

    def between_blocks(module, args, out):  # runs when layers.1's backward is done, before layers.0's
        out.register_hook(lambda grad: record("backward, between"))

    model.layers["0"].attention.register_forward_pre_hook(lambda *_: record("forward, in layers.0"))
    model.layers["0"].register_forward_hook(between_blocks)
    _transformer_loss(model, UNTIED, 0, slice(None)).backward()
    assert states == {"forward, in layers.0": {"layers.0": "gathered", "layers.1": "pending"},
                      "backward, between": {"layers.0": "pending"}}


def test_frozen_parameter_gets_no_gradient():
    model = _plain_net()
    model.head.weight.requires_grad_(False)
    engine, _ = _shard(model, _solo_mesh(), units="blocks")
    _plain_loss(model, 0, slice(None)).backward()
    finish(engine)
    grads = {name: m.grad for name, m in zip(engine.master_names(), engine.masters())}
    assert "head.weight" not in grads and grads["head.bias"] is not None  # no master, no gradient
    assert engine.master_names() == [n for n, p in model.named_parameters() if p.requires_grad]
    assert not model.head.weight.requires_grad and model.head.weight.grad is None


def test_invalid_settings_raise_value_errors():
    with pytest.raises(ZeroConfigError, match="grad_reduction"):
        _shard(_plain_net(), _solo_mesh(), grad_reduction="avg")
    with torch.device("meta"):
        foreign = _PlainNet()
    with pytest.raises(ZeroConfigError, match="init="):
        _shard(foreign, _solo_mesh())


def test_master_names_follow_model_parameter_order():
    names = [n for n, _ in _meta_transformer(TIED).named_parameters()]
    engine, _ = _shard(_meta_transformer(TIED), _solo_mesh())
    assert engine.master_names() == names
    assert math.prod(engine.masters()[0].shape) == TIED.vocab_size * TIED.dim


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_gathers_the_next_unit_before_this_units_backward_ends(recompute):
    """The all-gather of the unit whose backward comes next is launched while this unit's backward
    computes (its reduce-scatter is the end of it), with activation checkpointing as without; only
    for the units whose backward reads their parameters."""
    from paratrain.parallel.api import checkpoint_blocks

    model = _meta_transformer(UNTIED)
    engine, _ = _gathering(_shard(model, _solo_mesh())[0]), None
    if recompute:
        checkpoint_blocks(model)
    events = []
    for unit in engine.units:
        launch = unit.launch_gather
        unit.launch_gather = lambda *a, _u=unit, _launch=launch: (events.append(("gather", _u.name)), _launch(*a))[1]
    reduce_scatter = engine._reduce_scatter
    engine._reduce_scatter = lambda unit, grads: (events.append(("done", unit.name)), reduce_scatter(unit, grads))[1]
    for step in range(2):  # the second forward follows the order the first one recorded
        loss = _transformer_loss(model, UNTIED, step, slice(None))
        events.clear()
        loss.backward()
        finish(engine)
    backward = list(events)
    order = [name for kind, name in backward if kind == "done"]
    assert order == ["output", "norm", "layers.1", "layers.0", "tok_embeddings"]
    # The output head stays gathered from its forward; the embedding's backward reads only the indices.
    assert [name for kind, name in backward if kind == "gather"] == ["norm", "layers.1", "layers.0"], backward
    for this, following in zip(order, order[1:-1]):
        assert backward.index(("gather", following)) < backward.index(("done", this)), (this, following, backward)
    assert len(engine._plan) == len(order)  # recomputation does not grow the recorded order
