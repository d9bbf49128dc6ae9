"""Shared pieces of the multi-rank parity tests: the layout matrix, a tiny model, a fixed global batch, a reference run.

`LAYOUTS` names every strategy combination × precision the parity tests prove, once; each test file takes the
entries it proves (`layouts`). The distributed side of every parity test runs `train_steps` on its slice of
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
from paratrain.error_model import ErrorModel
# A dispatch mode: the one way to see every op, and every tensor it creates.
from paratrain.compat import TorchDispatchMode
from paratrain.models import ModelConfig, Transformer
from paratrain.testing import run_on_ranks

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
STEPS, BATCH, SEQ, LR = 20, 8, 16, 1e-2


@dataclasses.dataclass(frozen=True)
class Layout:
    """One entry of the layout matrix: each strategy's degree and options, and the precision.

    `dp_shard`: ZeRO shards over groups of this many data ranks (hybrid sharding; 0: all); `ep` divides `dp`;
    `microbatches`: per data rank and step; `recompute`: activation checkpointing ("full", "selective", every n-th
    block, 0: none)."""

    dp: int = 1
    dp_shard: int = 0
    zero: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    cp: int = 1
    ep: int = 1
    recompute: str | int = 0
    precision: str = "fp32"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def name(self) -> str:
        """The matrix's key, e.g. `pp2_interleaved_v2_m4_dp2_tp2_sp_zero1_fp64`: degrees above 1, options set."""
        parts = []
        if self.pp > 1:
            parts += [f"pp{self.pp}", self.schedule] + ([f"v{self.virtual_stages}"] if self.virtual_stages > 1 else [])
        parts += [f"m{self.microbatches}"] if self.microbatches > 1 else []
        if self.dp > 1:
            parts += [f"hsdp{self.dp // self.dp_shard}x{self.dp_shard}" if self.dp_shard else f"dp{self.dp}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += ["sp"] if self.sp else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"zero{self.zero}"] if self.zero else []
        parts += [f"ac-{self.recompute}"] if self.recompute else []
        parts += [self.precision] if self.precision != "fp32" else []
        return "_".join(parts) or "one_rank"

    def mesh_shape(self):
        from paratrain.mesh import MeshShape

        return MeshShape(dp=self.dp, dp_shard=self.dp_shard, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)


def _matrix(*entries: Layout) -> dict[str, Layout]:
    named = {layout.name: layout for layout in entries}
    assert len(named) == len(entries), "a layout is listed twice"
    return named


def _pipelines(pp: int, precision: str) -> list[Layout]:
    """Every schedule on `pp` stages, over 1 to 8 micro-batches (fp64) or 8 (fp32)."""
    counts = (1, 2, 4, 8) if precision == "fp64" else (8,)
    flat = [Layout(pp=pp, schedule=s, microbatches=m, precision=precision)
            for s in ("gpipe", "1f1b", "zb-h1") for m in counts]
    return flat + [Layout(pp=pp, schedule="interleaved", virtual_stages=2, microbatches=m, precision=precision)
                   for m in counts if m % pp == 0 and m > 1]


LAYOUTS = _matrix(
    # data parallelism alone, and hybrid sharding
    *[Layout(dp=2, zero=z) for z in (0, 1, 2, 3)],
    *[Layout(dp=4, dp_shard=2, zero=z) for z in (1, 2, 3)], Layout(dp=4, dp_shard=2, zero=2, microbatches=2),
    *[Layout(dp=8, dp_shard=4, zero=z) for z in (1, 2, 3)],
    Layout(dp=2, zero=3, recompute="full"), Layout(dp=2, zero=3, recompute="selective"),
    Layout(dp=2, zero=2, recompute="full", precision="fp16"),
    # tensor parallelism, alone and inside data parallelism
    Layout(tp=2), Layout(tp=2, sp=True), Layout(tp=4), Layout(tp=4, sp=True), Layout(tp=2, zero=1, precision="bf16"),
    Layout(dp=2, tp=2), *[Layout(dp=2, tp=2, sp=True, zero=z) for z in (0, 1, 3)],
    *[Layout(dp=2, tp=2, zero=z, precision="fp64") for z in (0, 1, 3)],
    *[Layout(dp=2, tp=2, sp=True, zero=z, precision="fp64") for z in (1, 2, 3)],
    *[Layout(dp=4, dp_shard=2, tp=2, zero=z) for z in (1, 2, 3)],
    # pipelines, alone and in 3D
    *_pipelines(2, "fp64"), *_pipelines(4, "fp64"), *_pipelines(2, "fp32"), *_pipelines(4, "fp32"),
    Layout(pp=2, microbatches=2), Layout(pp=2, microbatches=2, tp=2, sp=True), Layout(pp=2, microbatches=2, dp=2, zero=1),
    Layout(pp=2, schedule="interleaved", virtual_stages=2, microbatches=4, tp=2, sp=True, precision="fp64"),
    Layout(pp=2, microbatches=2, dp=2, tp=2, zero=1), Layout(pp=2, microbatches=2, dp=2, tp=2, zero=1, precision="fp64"),
    Layout(pp=2, schedule="interleaved", virtual_stages=2, microbatches=2, dp=2, tp=2, zero=2, precision="fp64"),
    Layout(pp=2, schedule="zb-h1", microbatches=2, dp=2, tp=2, sp=True, zero=1, precision="fp64"),
    *[Layout(pp=2, microbatches=2, dp=4, dp_shard=2, zero=z) for z in (1, 2)],
    # models the project did not write (test_your_own_model): pipelines of 4 micro-batches, tp by the user's plan
    *[Layout(pp=2, schedule=s, microbatches=4) for s in ("gpipe", "1f1b", "zb-h1")],
    Layout(pp=2, schedule="interleaved", virtual_stages=2, microbatches=4), Layout(pp=2, microbatches=4, dp=2, zero=1),
    Layout(pp=2, microbatches=4, tp=2), *[Layout(dp=2, tp=2, zero=z) for z in (1, 3)],
    # context parallelism, alone, with recomputation, under ZeRO-3 and in pipelines
    Layout(cp=2), *[Layout(cp=2, recompute=r) for r in ("full", "selective", 2)], Layout(dp=2, cp=2, zero=3),
    *[Layout(pp=2, schedule=s, virtual_stages=2 if s == "interleaved" else 1, microbatches=4, cp=2,
             recompute="full" if s == "zb-h1" else 0) for s in ("gpipe", "interleaved", "zb-h1")],
    # experts, and experts composed with the other strategies
    *[Layout(microbatches=2, dp=2, ep=2, recompute=r) for r in ("full", "selective")],
    Layout(microbatches=2, dp=2, ep=2, precision="bf16"), Layout(microbatches=2, dp=2, ep=2, zero=3),
    Layout(microbatches=2, dp=4, ep=2, zero=3),
    *[Layout(pp=2, schedule=s, microbatches=2, dp=2, ep=2) for s in ("gpipe", "zb-h1")],
    Layout(pp=2, schedule="interleaved", virtual_stages=2, microbatches=2, dp=2, ep=2),
)


def layouts(*names: str) -> dict[str, Layout]:
    """The entries of `LAYOUTS` a test file proves, by name (a name the matrix lacks is an error at collection)."""
    missing = [name for name in names if name not in LAYOUTS]
    assert not missing, f"not in parallel_cases.LAYOUTS: {missing}"
    return {name: LAYOUTS[name] for name in names}


def pipelines(pp: int, precision: str) -> list[str]:
    """The names of every schedule's entries on `pp` stages at `precision` (fp64: 1 to 8 micro-batches; fp32: 8)."""
    return [layout.name for layout in _pipelines(pp, precision)]


def variant(case_type: type, name: str, /, **extra):
    """`LAYOUTS[name]` as a test file's own case (`case_type`: a subclass of `Layout` adding what the file varies
    besides the layout: the model, a backend...)."""
    return case_type(**dataclasses.asdict(LAYOUTS[name]), **extra)


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
                  optimizers: list | None = None, norms: list | None = None):
    """Single process, whole global batch: per-step losses and final parameters. `optimizers`: what steps the model,
    in order (default: AdamW over every parameter); `norms`, given, gets each step's gradient norm before clipping."""
    optimizers = optimizers or [adamw(list(model.parameters()), lr=lr)]
    losses = []
    for x, y in data:
        tokens = (y != -100).sum()
        loss = loss_sum(model, x, y) / tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if norms is not None:
            norms.append(norm.item())
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


def step_window(model, optimizer, step, warm_up: int = 2):
    """`TensorMemory`'s window over one call of `step` after `warm_up` calls (after two, the optimizer state exists
    and compiled code is compiled; an eager step's second peak is its every later one's): the peak of live tensor
    bytes of a whole step, and what made it up."""
    from paratrain.peak_memory import TensorMemory

    for _ in range(warm_up):
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


def model_difference(params: dict, ref_params: dict, set_aside: int = 0) -> float:
    """‖θ − θ_ref‖ / ‖θ_ref‖ over the whole model in fp64, as `paratrain verify` judges a layout; `set_aside`: that
    many elements, the farthest apart, left out of the difference (`ErrorModel.stray`)."""
    diff = torch.cat([(params[k].double() - v.double()).flatten() for k, v in ref_params.items()])
    if set_aside:
        diff[diff.abs().topk(min(set_aside, diff.numel())).indices] = 0
    norm = sum(float(v.double().square().sum()) for v in ref_params.values())
    return float(diff.norm()) / norm ** 0.5 if norm else float(diff.norm())


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
        error = model_difference(params, ref_params, set_aside=model.stray)
        if model.stray:  # for the record only (bound 0: none), what the set-aside elements weigh
            _record(test, f"{what} model, nothing set aside".strip(), model_difference(params, ref_params), 0.0)
        _record(test, f"{what} model".strip(), error, param_bound)
        assert error <= param_bound, \
            f"{what} the model off by {error:.2e} of its norm (> {param_bound:g}, {model.name}: {model.why})"
        return
    errors = {name: relative_difference(params[name], value) for name, value in ref_params.items()}
    name = max(errors, key=errors.get)
    _record(test, f"{what} params".strip(), errors[name], param_bound)
    assert errors[name] <= param_bound, \
        f"{what} {name} off by {errors[name]:.2e} of its norm (> {param_bound:g}, {model.name}: {model.why})"
