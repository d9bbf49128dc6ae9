"""Pipeline-parallel benchmark: paratrain's schedules against torch.distributed.pipelining, pp=2 on CPU.

    python benchmarks/bench_pp.py                       # defaults: 8-layer Transformer, pp=2, 4 micro-batches of 2
    python benchmarks/bench_pp.py --steps 3 --warmup 1 --variants 1f1b

Rows (paratrain `parallelize(..., schedule=...)` <-> torch.distributed.pipelining, the same stages):
    single       one process, the whole batch: the reference the losses are checked against
    gpipe        schedule="gpipe"                  <-> ScheduleGPipe
    1f1b         schedule="1f1b"                   <-> Schedule1F1B
    interleaved  schedule="interleaved", v stages  <-> ScheduleInterleaved1F1B, v stages per rank
    zb-h1        schedule="zb-h1"                  <-> ScheduleInterleavedZeroBubble, 1 stage per rank (ZB-H1)
    zb-v         (torch only)                          ScheduleInterleavedZeroBubble, v stages per rank (ZB1P)

Every row runs in its own `run_on_ranks` launch (fresh processes, one thread per rank) on the
same model, init, batches (m micro-batches of b sequences) and number of steps. Each pipeline
action is timed from outside (paratrain: its PipelineRunner methods, minus the time blocked in
receives; torch: its stage's forward/backward methods), which gives the measured idle fraction
per rank and the f, b, w costs fed to paratrain's schedule simulator. Last, one process times a
stage's split backward three ways (full, paratrain's zb-h1 B + W, torch's). See benchmarks/README.md.
"""

from __future__ import annotations

import datetime
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F

from common import (
    MB, adamw_factory, add_common_args, build_model, doc_parser, failure_notes, fmt, fmt_load, fmt_spread,
    global_batch, model_config, optimizer_tensors, proc_status_kb, ratio_cell, rss_start_note, run_meta, run_rounds,
    set_time_ratio, storage_bytes, write_results,
)
from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.api import DataParallel, PipelineParallel, parallelize
from paratrain.parallel.pipeline.runner import PipelineRunner
from paratrain.parallel.pipeline.split_backward import input_backward, weight_backward
from paratrain.parallel.pipeline.stages import split_for_pipeline
from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.parallel.pipeline.simulator import simulate
from paratrain.peak_memory import reset_peak_rss
from paratrain.ranks import RankError, run_on_ranks


@dataclass(frozen=True)
class Spec:
    """One benchmarked row: which framework, which schedule, how many stages per rank."""

    variant: str  # single | gpipe | 1f1b | interleaved | zb-h1 | zb-v
    framework: str  # single | paratrain | pytorch
    label: str
    schedule: str = ""  # paratrain's schedule of the same shape (also the simulator's); "" if none
    torch_class: str = ""  # class name in torch.distributed.pipelining
    virtual_stages: int = 1


def make_variants(v: int) -> dict[str, tuple[Spec, ...]]:
    return {
        "gpipe": (Spec("gpipe", "paratrain", "paratrain gpipe", "gpipe"),
                  Spec("gpipe", "pytorch", "torch ScheduleGPipe", "gpipe", "ScheduleGPipe")),
        "1f1b": (Spec("1f1b", "paratrain", "paratrain 1f1b", "1f1b"),
                 Spec("1f1b", "pytorch", "torch Schedule1F1B", "1f1b", "Schedule1F1B")),
        "interleaved": (Spec("interleaved", "paratrain", f"paratrain interleaved v={v}", "interleaved", "", v),
                        Spec("interleaved", "pytorch", f"torch ScheduleInterleaved1F1B v={v}", "interleaved",
                             "ScheduleInterleaved1F1B", v)),
        "zb-h1": (Spec("zb-h1", "paratrain", "paratrain zb-h1", "zb-h1"),
                  Spec("zb-h1", "pytorch", "torch ScheduleInterleavedZeroBubble v=1", "zb-h1",
                       "ScheduleInterleavedZeroBubble")),
        "zb-v": (Spec("zb-v", "pytorch", f"torch ScheduleInterleavedZeroBubble v={v}", "",
                      "ScheduleInterleavedZeroBubble", v),),
    }


SINGLE = Spec("single", "single", "one process (reference)")


# ---------------------------------------------------------------- timing the actions
class ActionClock:
    """Compute seconds of each pipeline action this rank ran: (kind, micro-batch, stage, seconds).

    Kinds: F forward, B backward (input-grad only under a split backward), W weight-grad, L torch's
    loss (paratrain computes it inside F; counted as forward).
    """

    def __init__(self):
        self.actions: list[tuple[str, int, int, float]] = []
        self.blocked = 0.0  # seconds spent waiting in receives (paratrain), subtracted from its action

    def add(self, kind: str, microbatch: int, stage: int, seconds: float) -> None:
        self.actions.append((kind, microbatch, stage, seconds))

    def take(self) -> list[tuple[str, int, int, float]]:
        out, self.actions = self.actions, []
        return out


_PARATRAIN_CLOCK: list[ActionClock] = []  # the clock the patched PipelineRunner methods report to


def instrument_paratrain(clock: ActionClock) -> None:
    """Time PipelineRunner's F/B/W actions, minus the blocking transfers inside them, on `clock`.

    Private methods of paratrain's runtime, patched on the class in this rank's process only
    (a fresh fork per row), once; later calls only switch the clock. `_forward`/`_backward`/
    `_weight_backward` run one schedule action each (a forward includes the loss on the last
    stage); `_exchange` (a group of sends and receives) blocks on the neighbours.
    """
    first = not _PARATRAIN_CLOCK
    _PARATRAIN_CLOCK[:] = [clock]
    if not first:
        return
    receive = PipelineRunner._exchange

    def timed_receive(model, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return receive(model, *args, **kwargs)
        finally:
            _PARATRAIN_CLOCK[0].blocked += time.perf_counter() - t0

    def timed(method, kind):
        @functools.wraps(method)
        def wrapper(model, action, *args, **kwargs):
            c = _PARATRAIN_CLOCK[0]
            blocked0, t0 = c.blocked, time.perf_counter()
            out = method(model, action, *args, **kwargs)
            c.add(kind, action.microbatch, action.stage, time.perf_counter() - t0 - (c.blocked - blocked0))
            return out
        return wrapper

    PipelineRunner._exchange = timed_receive
    PipelineRunner._forward = timed(PipelineRunner._forward, "F")
    PipelineRunner._backward = timed(PipelineRunner._backward, "B")
    PipelineRunner._weight_backward = timed(PipelineRunner._weight_backward, "W")


def instrument_torch_stage(stage, clock: ActionClock, sent: list[float]) -> None:
    """Time a torch PipelineStage's compute methods and add up the bytes of the sends it posts.

    The schedules receive before and send after these methods, so they time compute alone.
    `get_fwd_send_ops` / `get_bwd_send_ops` return the P2POps the schedule then posts.
    """
    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        method = getattr(stage, name)

        def wrapper(chunk, *args, _method=method, _kind=kind, **kwargs):
            t0 = time.perf_counter()
            out = _method(chunk, *args, **kwargs)
            clock.add(_kind, chunk, stage.stage_index, time.perf_counter() - t0)
            return out
        setattr(stage, name, wrapper)
    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        method = getattr(stage, name)

        def counting(chunk, _method=method):
            ops = _method(chunk)
            sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return ops
        setattr(stage, name, counting)


# ---------------------------------------------------------------- single process, paratrain, PyTorch
@dataclass
class Runner:
    """What the training loop needs from one implementation."""

    train: object  # train(x, y) -> global mean loss (None on a rank without the last stage): forward + backward
    clip: object  # clip(max_norm)
    optimizer: torch.optim.Optimizer
    params: list  # this rank's parameters
    p2p_reset: object = lambda: None
    p2p_read: object = lambda: 0.0  # bytes this rank sent point-to-point since the reset
    buffers: object = lambda: []  # engine-owned gradient buffers (paratrain's buckets)


def token_sum_loss(tokens: int, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-sum cross-entropy over the global token count (every target counts here)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / tokens


def setup_single(cfg: ModelConfig, spec: Spec, args, clock: ActionClock) -> Runner:
    model = build_model(cfg, args.seed)

    def train(x, y):
        loss = token_sum_loss(y.numel(), model(x), y)
        loss.backward()
        return loss.item()

    params = list(model.parameters())
    return Runner(train, lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm),
                  adamw_factory(args)(params), params)


def setup_paratrain(cfg: ModelConfig, spec: Spec, args, clock: ActionClock) -> Runner:
    instrument_paratrain(clock)
    with torch.device("meta"):
        model = Transformer(cfg)
    mesh = build_mesh(MeshShape(pp=args.pp))
    pmodel, opt = parallelize(model, mesh, optimizer=adamw_factory(args), init=lambda name,
                              shape: model.param_init(name, shape, args.seed),
                              data=DataParallel(grad_reduction="sum"),
                              pipeline=PipelineParallel(schedule=spec.schedule, virtual_stages=spec.virtual_stages))

    def train(x, y):
        micro = list(zip(x.split(args.micro_batch), y.split(args.micro_batch)))  # torch's step splits the same way
        return pmodel.train_step(micro, float(y.numel())).loss_sum.item() / y.numel()

    def sent():
        return pmodel.comm.summary().get("pp", {}).get("send", {}).get("bytes", 0)

    buckets = lambda: [b.buffer for b in pmodel.engine.buckets]  # noqa: E731
    return Runner(train, pmodel.clip_grad_norm_, opt, list(pmodel.module.parameters()), pmodel.comm.reset, sent,
                  buckets)


def setup_pytorch(cfg: ModelConfig, spec: Spec, args, clock: ActionClock) -> Runner:
    """torch's stages from the same Transformer, pruned by paratrain's split (same layers per stage)."""
    rank, v = dist.get_rank(), spec.virtual_stages
    with torch.device("meta"):
        model = Transformer(cfg)
    split = split_for_pipeline(model, args.pp, rank, v)
    model.to_empty(device="cpu")
    model.init_weights(args.seed)
    sent = [0.0]
    stages = []
    for s in split.stages:
        stage = pipelining.PipelineStage(split.shell(s), s, split.num_stages, torch.device("cpu"))
        instrument_torch_stage(stage, clock, sent)
        stages.append(stage)
    last = split.num_stages - 1 in split.stages
    tokens = args.microbatches * args.micro_batch * args.seq

    def loss_fn(logits, targets):
        t0 = time.perf_counter()
        loss = token_sum_loss(tokens, logits, targets)
        clock.add("L", -1, split.num_stages - 1, time.perf_counter() - t0)  # counted in the last stage's forward
        return loss

    cls = getattr(pipelining, spec.torch_class)
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    # scale_grads=False: the loss is already divided by the global token count.
    schedule = cls(stages[0] if single else stages, args.microbatches, loss_fn=loss_fn, scale_grads=False)

    def train(x, y):
        losses: list[torch.Tensor] = []
        inputs = (x,) if rank == 0 else ()
        targets = {"target": y, "losses": losses} if last else {}
        schedule.step(*inputs, return_outputs=False, **targets)
        return float(sum(loss.item() for loss in losses)) if last else None

    params = list(model.parameters())
    return Runner(train, lambda max_norm: clip_pipeline_(params, max_norm), adamw_factory(args)(params), params,
                  lambda: sent.__setitem__(0, 0.0), lambda: sent[0])


@torch.no_grad()
def clip_pipeline_(params, max_norm: float) -> float:
    """Global-norm clipping over the stages of all ranks (torch.nn.utils' rule, the norm summed over ranks)."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.float().pow(2).sum()
    dist.all_reduce(sq)  # each rank holds other layers
    norm = sq.sqrt().item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


SETUPS = {"single": setup_single, "paratrain": setup_paratrain, "pytorch": setup_pytorch}


# ---------------------------------------------------------------- one rank
def warm_process(spec: Spec, args) -> None:
    """One step of a tiny model through this row's own setup, so the RSS peak measures data, not code."""
    tiny = ModelConfig(vocab_size=args.vocab, dim=32, n_layers=args.pp * max(spec.virtual_stages, 1), n_heads=2,
                       n_kv_heads=2, ffn_dim=32, max_seq_len=args.seq)
    run = SETUPS[spec.framework](tiny, spec, args, ActionClock())
    x, y = global_batch(0, args.microbatches, args)  # a whole step's m micro-batches, as the measured steps
    run.train(x, y)
    run.optimizer.step()


def bench_rank(rank: int, world: int, spec: Spec, args) -> dict:
    """One rank of one row: warm-up + measured steps, each action timed."""
    warm_process(spec, args)
    reset_ok = reset_peak_rss()
    rss0 = proc_status_kb("VmRSS")
    clock = ActionClock()
    run = SETUPS[spec.framework](model_config(args), spec, args, clock)
    times, windows, losses, sent, actions, state = [], [], [], [], [], {}
    for step in range(args.warmup + args.steps):
        x, y = global_batch(step, args.microbatches, args)  # m·b rows, the same for every row
        dist.barrier()
        run.p2p_reset()
        clock.take()
        t0 = time.perf_counter()
        loss = run.train(x, y)
        window = time.perf_counter() - t0
        if args.clip > 0:
            run.clip(args.clip)
        run.optimizer.step()
        elapsed = time.perf_counter() - t0
        if step == args.warmup + args.steps - 1:
            state = {"after_step": state_bytes(run)}  # before gradients are released
        run.optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        if step >= args.warmup:
            times.append(elapsed)
            windows.append(window)
            sent.append(run.p2p_read())
            actions.append(clock.take())
    state["between_steps"] = state_bytes(run)
    return {"times": times, "windows": windows, "losses": losses, "sent": sent, "actions": actions, "state": state,
            "params_bytes": storage_bytes(run.params), "rss0_kb": rss0, "hwm_kb": proc_status_kb("VmHWM"),
            "rss_end_kb": proc_status_kb("VmRSS"), "hwm_reset": reset_ok}


def state_bytes(run: Runner) -> int:
    """Bytes of this rank's parameters, gradients, Adam moments and engine gradient buffers (distinct storages)."""
    grads = [p.grad for p in run.params]
    return storage_bytes(run.params + grads + optimizer_tensors(run.optimizer) + run.buffers())


# ---------------------------------------------------------------- the split backward alone
def torch_split_backward(out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, params: list) -> float:
    """torch's ZB input-grad then weight-grad backward of one stage; returns the seconds of the second.

    Private torch functions (torch.distributed.pipelining._backward), the ones its PipelineStage
    calls for a split backward: the first keeps the intermediate gradients the second starts from.
    """
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    _, groups = stage_backward_input([out], [grad], [x], iter(params))
    t0 = time.perf_counter()
    stage_backward_weight(iter(params), groups)
    return time.perf_counter() - t0


def paratrain_split_backward(out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, params: list) -> float:
    """paratrain's B and W under zb-h1 (`paratrain.parallel.pipeline.runner`): W starts where B left off."""
    work = input_backward(out, grad, x, params)
    t0 = time.perf_counter()
    weight_backward(work)
    return time.perf_counter() - t0


def full_backward(out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, params: list) -> float:
    torch.autograd.backward(out, grad)
    return 0.0


def split_backward_rank(rank: int, world: int, args) -> dict:
    """Median ms (B+W, W) of one middle stage's backward three ways, interleaved in one process.

    The stage is 1/pp of the layers, without embedding or head, on one micro-batch. Running the
    three ways in turn in one process exposes them to the same load, unlike the rows above.
    """
    model = build_model(model_config(args), args.seed)
    for key in list(model.layers)[args.layers // args.pp:]:
        del model.layers[key]
    model.tok_embeddings = model.norm = model.output = None
    params, ways = list(model.parameters()), (full_backward, paratrain_split_backward, torch_split_backward)
    grad = torch.randn(args.micro_batch, args.seq, args.dim)
    times: dict[str, list[tuple[float, float]]] = {way.__name__: [] for way in ways}
    for i in range(args.split_repeats + 2):
        for way in ways:
            model.zero_grad(set_to_none=True)
            x = torch.randn(args.micro_batch, args.seq, args.dim, requires_grad=True)
            out = model(x)
            t0 = time.perf_counter()
            w = way(out, grad, x, params)
            if i >= 2:  # two rounds of warm-up
                times[way.__name__].append((time.perf_counter() - t0, w))
    return {name: {"bw_ms": 1e3 * statistics.median(t for t, _ in v), "w_ms": 1e3 * statistics.median(w for _, w in v)}
            for name, v in times.items()}


def split_backward_table(result: dict) -> list[str]:
    full = result["full_backward"]["bw_ms"]
    names = {"full_backward": "one full backward (1F1B's B)",
             "paratrain_split_backward": "paratrain zb-h1: B = backward(inputs=[x], retain_graph), W = backward("
                                         "inputs=params)",
             "torch_split_backward": "torch zero-bubble: stage_backward_input, then stage_backward_weight"}
    lines = ["", "Split backward of one middle stage (1/pp of the layers, one micro-batch), the three ways run in "
                 "turn in one process, so under the same load; median ms:", "",
             "| backward | B + W ms | W ms | B + W ÷ full backward |", "|---|---|---|---|"]
    for name, label in names.items():
        r = result[name]
        w = "—" if name == "full_backward" else f"{r['w_ms']:.1f}"
        lines.append(f"| {label} | {r['bw_ms']:.1f} | {w} | {r['bw_ms'] / full:.2f} |")
    return lines


# ---------------------------------------------------------------- reducing a row
def action_costs(result: dict, m: int) -> dict:
    """This rank's median per-step busy fraction and per-micro-batch costs f, b (= B + W), w (= W), in s."""
    per_step = []
    for window, actions in zip(result["windows"], result["actions"]):
        by_kind = {k: sum(s for kind, _, _, s in actions if kind == k) for k in "FBWL"}
        per_step.append({"idle": 1.0 - sum(by_kind.values()) / window, "f": (by_kind["F"] + by_kind["L"]) / m,
                         "b": (by_kind["B"] + by_kind["W"]) / m, "w": by_kind["W"] / m})
    return {k: statistics.median(step[k] for step in per_step) for k in ("idle", "f", "b", "w")}


def simulated(spec: Spec, costs: list[dict], args) -> dict | None:
    """paratrain's simulator on the same schedule shape, fed the measured costs (mean over ranks)."""
    if not spec.schedule:
        return None
    f, b = (statistics.mean(c[k] for c in costs) for k in ("f", "b"))
    w = statistics.mean(c["w"] for c in costs) if spec.schedule == "zb-h1" else None
    schedule = build_schedule(spec.schedule, args.pp, args.microbatches, spec.virtual_stages)
    sim = simulate(schedule, f=f, b=b, w=w)
    return {"f": f, "b": b, "w": w, "makespan_s": sim.makespan, "rank_bubble_fraction": list(sim.rank_bubble_fraction),
            "bubble_fraction": sim.bubble_fraction}


def run_row(spec: Spec, args) -> dict:
    """Launch one row on fresh ranks and reduce the per-rank results."""
    world = 1 if spec.framework == "single" else args.pp
    row = {"variant": spec.variant, "label": spec.label, "framework": spec.framework, "ranks": world,
           "virtual_stages": spec.virtual_stages}
    print(f"  {spec.label} on {world} rank(s) ...", file=sys.stderr, flush=True)
    try:
        results = run_on_ranks(bench_rank, world, spec, args, timeout=args.timeout)
    except RankError as exc:
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "detail": str(exc)}
    steps = [max(r["times"][i] for r in results) for i in range(args.steps)]  # a step ends on its last rank
    windows = [max(r["windows"][i] for r in results) for i in range(args.steps)]
    step = statistics.median(steps)
    costs = [action_costs(r, args.microbatches) for r in results] if world > 1 else []
    return {**row, "step_s": step, "step_times_s": steps, "window_s": statistics.median(windows),
            "tokens_per_s": args.microbatches * args.micro_batch * args.seq / step,
            "losses": results[-1]["losses"],  # the last rank holds the last stage
            "peak_rss_delta_mb": [(r["hwm_kb"] - r["rss0_kb"]) / 1024 for r in results],
            "rss_start_mb": [r["rss0_kb"] / 1024 for r in results],
            "rss_end_mb": [r["rss_end_kb"] / 1024 for r in results],
            "hwm_reset": all(r["hwm_reset"] for r in results),
            "params_mb": [r["params_bytes"] / MB for r in results],
            "state_mb": {k: [r["state"][k] / MB for r in results] for k in ("after_step", "between_steps")},
            "p2p_mb_per_step": [statistics.mean(r["sent"]) / MB for r in results],
            "costs": costs, "idle_measured": [c["idle"] for c in costs],
            "simulated": simulated(spec, costs, args) if costs else None,
            "actions_last_step": [r["actions"][-1] for r in results] if world > 1 else []}


def compare(rows: list[dict]) -> None:
    """Losses against the single process; paratrain rows get paratrain ÷ the PyTorch row of the same variant."""
    ok = [r for r in rows if "error" not in r]
    single = next((r for r in ok if r["framework"] == "single"), None)
    torch_rows = {r["variant"]: r for r in ok if r["framework"] == "pytorch"}
    for r in ok:
        if single is not None and r is not single:
            r["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], single["losses"]))
        ref = torch_rows.get(r["variant"])
        if r["framework"] != "paratrain" or ref is None:
            continue
        set_time_ratio(r, ref)
        r["rss_ratio"] = max(r["peak_rss_delta_mb"]) / max(ref["peak_rss_delta_mb"])
        r["p2p_ratio"] = sum(r["p2p_mb_per_step"]) / sum(ref["p2p_mb_per_step"])
        r["same_order_as_torch"] = action_order(r) == action_order(ref)


def action_order(row: dict) -> list[list[tuple[str, int, int]]]:
    """Per rank, the (kind, micro-batch, stage) of every action of the last measured step (torch's loss left out)."""
    return [[(kind, mb, stage) for kind, mb, stage, _ in actions if kind != "L"]
            for actions in row["actions_last_step"]]


# ---------------------------------------------------------------- report
def per_rank(values, spec: str) -> str:
    return " / ".join(format(v, spec) for v in values) if values else "—"


def markdown(rows: list[dict], meta: dict) -> str:
    head = ["variant", "step ms median (min–max)", "tokens/s", "peak RSS Δ MB per rank", "p2p MB/step per rank",
            "idle measured per rank", "idle simulated per rank", "time ratio", "RSS ratio", "p2p ratio",
            "loss max rel diff vs 1 process"]
    lines = [f"# Pipeline-parallel benchmark, {meta['date']}", "",
             f"- machine: {meta['platform']}, {meta['cpu_count']} CPUs ({meta['cpu_model']}), torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- model: {meta['model']} — {meta['params']:,} parameters ({meta['params'] * 4 / MB:.1f} MB fp32)",
             f"- pp={meta['pp']}; one step = {meta['microbatches']} micro-batches × {meta['micro_batch']} sequences"
             f" × seq {meta['seq']}; fp32; loss = token-sum cross-entropy / global token count; AdamW lr "
             f"{meta['lr']}, clip {meta['clip']}; {meta['warmup']} warm-up + {meta['steps']} measured steps; "
             f"{meta.get('rounds', 1)} round(s) per variant, its rows alternating which runs first (step ms: the median "
             "of the rounds' medians, min–max over every step; costs and memory from the first round)",
             "- step time: forward + backward + clipping + AdamW step, each step's slowest rank; per-rank cells read "
             "rank 0 / rank 1 / …",
             "- ratios sit on the paratrain rows: paratrain ÷ the torch row below it (RSS: max over ranks; p2p: sum "
             "over ranks); ≤ 1.0 means paratrain is faster / smaller",
             "- idle measured: 1 − (compute of the rank's actions) / (its forward+backward window), median over "
             "steps; idle simulated: paratrain's simulator on the same schedule with the measured f, b, w (mean over "
             "ranks, table below)",
             "- timings come from a 2-core machine shared with other jobs: they are noisy (a compute time includes "
             "time the rank was preempted); p2p bytes and losses are exact. Load average (1, 5, 15 min) at start "
             f"{fmt_load(meta['load_avg_start'])}, at end {fmt_load(meta['load_avg_end'])}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['error']} |" + " |" * (len(head) - 2))
            continue
        spread = fmt_spread(r, ".1f")
        sim = r["simulated"]
        cells = [r["label"], spread, fmt(r["tokens_per_s"], ",.0f"), per_rank(r["peak_rss_delta_mb"], ".1f"),
                 per_rank(r["p2p_mb_per_step"], ".2f") if r["ranks"] > 1 else "—",
                 per_rank(r["idle_measured"], ".0%"), per_rank(sim["rank_bubble_fraction"], ".0%") if sim else "—",
                 ratio_cell(r), fmt(r.get("rss_ratio"), ".2f"), fmt(r.get("p2p_ratio"), ".2f"),
                 fmt(r.get("loss_max_rel_diff"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += cost_table(rows)
    if meta.get("split_backward"):
        lines += split_backward_table(meta["split_backward"])
    lines += footnotes(rows)
    return "\n".join(lines) + "\n"


def cost_table(rows: list[dict]) -> list[str]:
    """Measured per-micro-batch costs per rank and the simulator's step against the measured window."""
    head = ["variant", "f ms per rank", "b ms per rank (B+W)", "w ms per rank", "b/f per rank",
            "params MB per rank", "model state MB per rank after step", "model state MB per rank between steps",
            "fwd+bwd window ms (measured)", "simulated makespan ms", "simulated bubble (all ranks)"]
    lines = ["", "Measured costs of one micro-batch through a rank's share of the model (all its chunks), median "
                 "over steps; the simulator takes their mean over ranks:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r or not r["costs"]:
            continue
        sim, costs = r["simulated"], r["costs"]
        cells = [r["label"], per_rank([c["f"] * 1e3 for c in costs], ".1f"),
                 per_rank([c["b"] * 1e3 for c in costs], ".1f"), per_rank([c["w"] * 1e3 for c in costs], ".1f"),
                 per_rank([c["b"] / c["f"] for c in costs], ".2f"),
                 per_rank(r["params_mb"], ".2f"),
                 per_rank(r["state_mb"]["after_step"], ".1f"), per_rank(r["state_mb"]["between_steps"], ".1f"),
                 f"{r['window_s'] * 1e3:.1f}",
                 fmt(sim and sim["makespan_s"] * 1e3, ".1f"), fmt(sim and sim["bubble_fraction"], ".0%")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def footnotes(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if "error" not in r]
    same = [f"{r['variant']}: {'yes' if r['same_order_as_torch'] else 'NO'}" for r in ok if "same_order_as_torch" in r]
    lines = ["", "Each rank runs its F/B/W actions in the same order in paratrain and in torch (from the recorded "
                 "actions of the last step): " + ("; ".join(same) or "no pair ran") + "."]
    if ok:
        lines += rss_start_note([v for r in ok for v in r["rss_start_mb"]], all(r["hwm_reset"] for r in ok),
                                "after a warm-up step of a tiny model through the same setup")
    return lines + failure_notes(rows, lambda r: r["label"])


def parse_args(argv=None):
    p = doc_parser(__doc__)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (m)")
    p.add_argument("--virtual-stages", type=int, default=2, help="stages per rank of the interleaved / zb-v rows")
    p.add_argument("--variants", nargs="+", choices=list(make_variants(2)), default=list(make_variants(2)),
                   help="rows to run besides the single-process reference")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per variant, its rows alternating which runs first; the time ratio is the median "
                        "of the rounds' ratios")
    p.add_argument("--split-repeats", type=int, default=20,
                   help="measured rounds of the split-backward comparison (0: skip it)")
    add_common_args(p, micro_batch_default=2, micro_batch_help="sequences per micro-batch (b)")
    p.set_defaults(layers=8)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for pp-<time>.md and .json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.pp < 2 or args.virtual_stages < 2 or args.rounds < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --pp >= 2, --virtual-stages >= 2, --rounds >= 1")
    if args.microbatches % args.pp or args.layers < args.pp * args.virtual_stages:
        p.error("--microbatches must be a multiple of --pp (interleaved), --layers >= pp × virtual stages")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    meta = {**run_meta(args, now), "pp": args.pp, "microbatches": args.microbatches,
            "virtual_stages": args.virtual_stages}
    variants = make_variants(args.virtual_stages)
    rows = [run_row(SINGLE, args)]
    for variant in args.variants:
        rows += run_rounds(list(variants[variant]), args.rounds, lambda spec: run_row(spec, args))
    if args.split_repeats > 0:
        print("  split backward of one stage, three ways ...", file=sys.stderr, flush=True)
        meta["split_backward"] = run_on_ranks(split_backward_rank, 1, args, timeout=args.timeout)[0]
    meta["load_avg_end"] = os.getloadavg()
    compare(rows)
    text = markdown(rows, meta)
    print(text)
    write_results(args.out, "pp", now, text, {"meta": meta, "args": vars(args), "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
