"""Shared pieces of the multi-rank parity tests: a tiny model, a fixed global batch, a reference run.

The distributed side of every parity test runs `train_steps` on its slice of
the same global batch that the single-process reference sees whole; the loss
is the sum of token losses over the global token count on both sides.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm import Comm
from paratrain.error_model import ErrorModel
# A dispatch mode: the one way to see every op, and every tensor it creates.
from paratrain.compat import TorchDispatchMode
from paratrain.models import ModelConfig, Transformer
from paratrain.testing import run_on_ranks

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
STEPS, BATCH, SEQ, LR = 20, 8, 16, 1e-2


class OpRecorder(TorchDispatchMode):
    """Records every op that runs (forward, loss, backward, collectives): how often each runs, by name,
    and the shape of every tensor it creates."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


class OverlapTrace(Comm):
    """CUDA's overlap policy on the CPU, and the order in which things happen under it.

    A `Comm` that leaves one gradient reduction in flight while backward goes on, as on CUDA
    (`reductions_in_flight`; the CPU's policy lands each at once), and records in `events`, in
    order: ("launch", kind, n) as collective n starts, ("land", kind, n) when a wait on it returns,
    and whatever the test marks (`mark`: gradients computed, a forward done...). On CUDA a wait
    holds up the compute stream, so what is queued after a "land" waits for that collective.
    """

    def __init__(self, mesh):
        super().__init__(mesh)
        self.events: list[tuple] = []

    def reductions_in_flight(self) -> int:
        return 1

    def mark(self, *event) -> None:
        self.events.append(event)

    def reduce_scatter(self, *args, **kwargs):
        return self._traced("reduce_scatter", super().reduce_scatter(*args, **kwargs), kwargs.get("async_op", False))

    def all_gather(self, *args, **kwargs):
        return self._traced("all_gather", super().all_gather(*args, **kwargs), kwargs.get("async_op", False))

    def _traced(self, kind: str, work, async_op: bool):
        n = sum(1 for e in self.events if e[:2] == ("launch", kind))
        self.events.append(("launch", kind, n))
        if not async_op or work is None:
            self.events.append(("land", kind, n))
            return work
        return _TracedWork(work, self.events, ("land", kind, n))


class _TracedWork:
    def __init__(self, work, events: list, landed: tuple):
        self.work, self.events, self.landed = work, events, landed

    def wait(self):
        self.work.wait()
        self.events.append(self.landed)


def launch_once(cache: dict, world: int, fn, *args, timeout: float = 600):
    """Every rank's return value of `fn(rank, world, *args)`, launched once per world size and cached.

    Parity tests train many cases in one launch (each rank process pays seconds of start-up),
    then each test reads its case; a failure is cached too and re-raised by every test.
    """
    if world not in cache:
        try:
            cache[world] = run_on_ranks(fn, world, *args, timeout=timeout)
        except Exception as error:  # noqa: BLE001 - reported by every test of this world size
            cache[world] = error
    if isinstance(cache[world], Exception):
        raise cache[world]
    return cache[world]


def make_model(cfg: ModelConfig = TINY, seed: int = 0) -> Transformer:
    """Built on the meta device, then materialized and initialized (as the trainer does)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def batches(vocab: int = 64, steps: int = STEPS, batch: int = BATCH, seq: int = SEQ, uneven: bool = True):
    """Deterministic global batches; with `uneven`, rows keep very different numbers of target tokens."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        if uneven:
            keep = torch.randint(1, seq + 1, (batch,), generator=g)
            y[torch.arange(seq)[None, :] >= keep[:, None]] = -100
        out.append((x, y))
    return out


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum of token losses, in at least fp32; through the model's own loss when it has one (vocab-parallel)."""
    logits = model(x)
    logits = getattr(logits, "logits", logits)  # Hugging Face models return an output object
    if hasattr(model, "loss_fn"):
        return model.loss_fn(logits, y)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def adamw(params, lr: float = LR, **options):
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, **options)


def reference_run(model: nn.Module, data, clip: float = 1.0, micro: int | None = None, lr: float = LR,
                  optimizers: list | None = None):
    """Single process, whole global batch: per-step losses and final parameters. `optimizers`: what steps the model,
    in order (default: AdamW over every parameter)."""
    optimizers = optimizers or [adamw(list(model.parameters()), lr=lr)]
    losses = []
    for x, y in data:
        tokens = (y != -100).sum()
        loss = loss_sum(model, x, y) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def parallel_run(model, optimizer, data, rank: int, world: int, comm_axis_all_reduce, clip: float = 1.0,
                 micro: int | None = None, loss_scale: float = 1.0):
    """This rank's share of each global batch (split in `micro`-row micro-batches): losses per step.

    Each backward is of the micro-batch's token-loss sum over the global token count, times
    `loss_scale` (the number of data ranks when the engine averages gradients over them)."""
    losses = []
    for x, y in data:
        per_rank = x.shape[0] // world
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        tokens = (y != -100).sum()  # global count: every rank sees the global batch here
        micro = micro or per_rank
        total = torch.zeros((), dtype=torch.float64)  # exact for fp64 runs, harmless for fp32
        pieces = range(0, per_rank, micro)
        for i in pieces:
            last = i + micro >= per_rank
            ctx = model.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                part = loss_sum(model, xs[i:i + micro], ys[i:i + micro])
                (part / tokens * loss_scale).backward()
            total += part.detach()
        model.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        comm_axis_all_reduce(total)
        losses.append((total / tokens).item())
    return losses


# -- judging a layout against one process under `paratrain.error_model` ---------------------------------------------


def _record(test: str, what: str, measured: float, bound: float) -> None:
    import json
    import os

    path = os.environ.get("PARATRAIN_ERROR_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "measured": measured, "bound": bound}) + "\n")


def _current_test() -> str:
    import os

    return os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]


def third_step_window(model, optimizer, step):
    """`TensorMemory`'s window over the third call of `step` (after two, the optimizer state exists and compiled
    code is compiled): the peak of live tensor bytes of a whole step, and what made it up."""
    from paratrain.peak_memory import TensorMemory

    step()
    step()
    meter = TensorMemory()
    with meter:
        meter.begin(model, optimizer)
        step()
        return meter.end(model, optimizer)


def plain_step(model, optimizer, x, y):
    """One step of a parallelized model on (x, y): loss backward, clipping at 1, optimizer step."""
    def step():
        model.loss_fn(model(x), y).backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in fp64 (‖got‖ for a zero `want`)."""
    got, want = got.double(), want.double()
    norm = want.norm().item()
    diff = (got - want).norm().item()
    return diff / norm if norm else diff


def model_difference(params: dict, ref_params: dict) -> float:
    """‖θ − θ_ref‖ / ‖θ_ref‖ over the whole model in fp64, as `paratrain verify` judges a layout."""
    diff = sum(float((params[k].double() - v.double()).square().sum()) for k, v in ref_params.items())
    norm = sum(float(v.double().square().sum()) for v in ref_params.values())
    return (diff / norm) ** 0.5 if norm else diff ** 0.5


def assert_matches_reference(losses, params: dict, ref_losses, ref_params: dict, model: ErrorModel,
                             what: str = "") -> None:
    """A layout's per-step losses and final parameters against one process's, under `model`'s bounds.

    Each comparison's measured error goes to PARATRAIN_ERROR_REPORT when that is set (other_machines.sh)."""
    test = _current_test()
    loss_bound, param_bound = model.bounds(len(ref_losses))
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
    worst_loss = max(loss_errors)
    _record(test, f"{what} loss".strip(), worst_loss, loss_bound)
    assert worst_loss <= loss_bound, \
        f"{what} step {loss_errors.index(worst_loss)} loss off by {worst_loss:.2e} (> {loss_bound:g}, {model.name})"
    if not ref_params:
        return
    assert set(params) >= set(ref_params), f"{what} parameters missing: {sorted(set(ref_params) - set(params))}"
    if model.scope == "model":
        error = model_difference(params, ref_params)
        _record(test, f"{what} model".strip(), error, param_bound)
        assert error <= param_bound, \
            f"{what} the model off by {error:.2e} of its norm (> {param_bound:g}, {model.name}: {model.why})"
        return
    errors = {name: relative_difference(params[name], value) for name, value in ref_params.items()}
    name = max(errors, key=errors.get)
    _record(test, f"{what} params".strip(), errors[name], param_bound)
    assert errors[name] <= param_bound, \
        f"{what} {name} off by {errors[name]:.2e} of its norm (> {param_bound:g}, {model.name}: {model.why})"
