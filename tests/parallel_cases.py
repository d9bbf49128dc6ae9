"""Shared pieces of the multi-rank parity tests: a tiny model, a fixed global batch, a reference run.

The distributed side of every parity test runs `train_steps` on its slice of
the same global batch that the single-process reference sees whole; the loss
is the sum of token losses over the global token count on both sides.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm import Comm
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


# -- the error model of every parity test ------------------------------------------------------------------------
#
# A layout runs the same algorithm as one process, but its sums run in another order (over ranks, buckets,
# micro-batches, ring steps, shards), and a CPU's kernels round by their vector width: PyTorch dispatches on the
# processor (`ATEN_CPU_CAPABILITY`: default, avx2, avx512), so the same code gives other roundings on another
# machine. What a parity test may compare is therefore what those roundings cannot push across, written here
# once, with the reason; `tests/other_machines.sh` runs the parity tests under every capability this machine
# offers and reports each bound's measured worst against it (PARATRAIN_ERROR_REPORT). Every bound is at least
# 10x the worst measured on AVX-512, AVX2 and the default path, and below what a wrong gradient gives
# (tests/test_parity_faults.py injects one per strategy).

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7
FP64_EPS = torch.finfo(torch.float64).eps  # 2.2e-16


@dataclasses.dataclass(frozen=True)
class ErrorModel:
    """How far a layout's losses and parameters may be from one process's, and why."""

    name: str
    loss_rtol: float  # |loss − loss_ref| / |loss_ref|, each step
    param_rtol: float  # ‖θ − θ_ref‖ / ‖θ_ref‖ after the last step, per parameter tensor or over the model
    why: str
    scope: str = "tensor"  # "tensor": the worst parameter tensor; "model": all parameters as one vector
    per_step: bool = False  # both bounds are per optimizer step, times the steps compared

    def bounds(self, steps: int) -> tuple[float, float]:
        """(loss bound, parameter bound) for a run of `steps` optimizer steps."""
        scale = steps if self.per_step else 1
        return self.loss_rtol * scale, self.param_rtol * scale


# The same algorithm in fp64: the only difference is summation order, n·ε64 relative for a sum of n terms
# (n ≤ 10⁴ here: 2e-12), carried through 20 optimizer steps.
FP64_PARITY = ErrorModel("fp64", 1e-10, 1e-10, "summation order only, in fp64: n·ε64 ≤ 2e-12 per sum")

# fp32 with AdamW, bounds per optimizer step: each step's sums round differently in another order, and Adam
# carries what it moved into every later step, so the two runs drift apart about linearly over these short runs.
# Losses: a token-loss sum of n ≤ 10³ terms rounds by ≤ √n·ε32 ≈ 4e-6 typically; measured worst 1.1e-7 after 3
# steps and 1.7e-6 after 20 (ZeRO-3, tied, dp4, AVX2): 1e-6 per step. Parameters, per tensor and never element by
# element: Adam divides each gradient by its own running magnitude, so an element whose gradient is at rounding
# level steps by about lr whichever way the rounding goes (element-wise differences after 3 steps reach 1.1e-5 on
# AVX-512 and 2.4e-6 on AVX2: they measure the vector width, not the layout). Over a tensor those few elements add
# to the many whose gradients are well above rounding, whose steps differ by lr·O(√n·ε32); the worst tensor
# measured is 1.1e-5 after 3 steps (context parallel), 4.2e-5 after 4 (compiled against eager, ZeRO-3 with
# selective recomputation) and 1.6e-4 after 20 (ZeRO-3, tied, dp4, AVX2): 1.5e-4 per step. A gradient counted
# twice moves its worst tensor by 15-120% of its norm (tests/test_parity_faults.py).
FP32_ADAMW = ErrorModel("fp32 AdamW", 1e-6, 1.5e-4, "reduction order under fp32 rounding, amplified by Adam's "
                                                  "per-element normalization; compared per tensor", per_step=True)

# fp32 AdamW on a model with parameters whose gradient is zero in exact arithmetic (GPT-2's key biases: softmax
# does not change when every score of a query moves by the same amount): Adam normalizes pure rounding noise
# there, so such a tensor follows the processor's rounding (3.1e-4 of its norm after 5 steps on the default path)
# and only the model as a whole, as `paratrain verify` judges a layout, has a bound rounding cannot cross:
# measured 4.7e-6 after 5 steps (AVX-512), 2e-5 per step.
FP32_ADAMW_MODEL = dataclasses.replace(FP32_ADAMW, name="fp32 AdamW, whole model", param_rtol=2e-5, scope="model",
                                       why="Adam steps on rounding where a gradient is exactly zero; compared over "
                                           "the whole model")

# A chaotic fp32 run (lr 1e-2, tiny vocabulary, 20 AdamW steps) against the fp64 run of the same model: one fp32
# process itself drifts from it by up to 1e-4 in loss and 1e-3 in parameters by step 20, and any reordering of
# the sums by as much again; measured worst 1.9e-4 in loss (tp2 + sp, default path). So 2e-3 and 5e-2: the fp64
# parity tests hold such layouts to 1e-10; this bound says only that fp32 stays as close as fp32 can.
FP32_CHAOTIC = ErrorModel("fp32 against fp64, chaotic run", 2e-3, 5e-2, "fp32 rounding grows through a chaotic run")


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
