"""Tensor-parallel benchmark: paratrain's TP and TP + sequence parallelism against PyTorch's DTensor TP.

    python benchmarks/bench_tp.py                       # defaults: ~3.2M-param Transformer, tp=2
    python benchmarks/bench_tp.py --steps 3 --warmup 1 --variants tp

Rows (paratrain plan <-> PyTorch `parallelize_module` plan):
    single     one process, no parallelism: the reference the losses are checked against
    tp         LLAMA_TP_PLAN  <-> ColwiseParallel (wq wk wv w1 w3), RowwiseParallel (wo w2),
                                  RowwiseParallel(input_layouts=Replicate()) embedding,
                                  ColwiseParallel(output_layouts=Shard(-1)) head + loss_parallel
    tp_region  (PyTorch only)     the tp plan + PrepareModuleInput on attention and feed_forward,
                                  so wq/wk/wv (w1/w3) share one input, as paratrain's TPRegion
    sp         LLAMA_SP_PLAN  <-> the tp plan with SequenceParallel norms, Shard(1) residual stream

Every row runs in its own `run_on_ranks` launch (fresh processes, one thread per rank) on
the same model, init, batches and number of steps; every tp rank sees the whole batch. See
benchmarks/README.md for what each column means and how bytes are counted.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module,
)

from common import (
    MB, adamw_factory, add_common_args, build_model, doc_parser, failure_notes, fmt, fmt_load, fmt_spread,
    global_batch, model_config, optimizer_tensors, proc_status_kb, rss_start_note, run_meta, storage_bytes,
    write_results,
)
from paratrain.comm import Comm
from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import ModelConfig
from paratrain.parallel.tensor import clip_grad_norm_tp_
from paratrain.models.tp_plans import LLAMA_SP_PLAN, LLAMA_TP_PLAN
from paratrain.parallel.tensor import apply_tensor_parallel
from paratrain.peak_memory import reset_peak_rss
from paratrain.ranks import RankError, run_on_ranks


@dataclass(frozen=True)
class Spec:
    """One benchmarked row: which framework, which mode (tp or sp), and PyTorch's input regions."""

    variant: str  # single | tp | tp_region | sp
    framework: str  # single | paratrain | pytorch
    label: str
    sp: bool = False
    region: bool = False  # PyTorch: PrepareModuleInput on attention / feed_forward

    @property
    def mode(self) -> str:
        return "sp" if self.sp else "tp"


SINGLE = Spec("single", "single", "one process (reference)")
VARIANTS = {
    "tp": (Spec("tp", "paratrain", "paratrain TP (LLAMA_TP_PLAN)"),
           Spec("tp", "pytorch", "torch TP (Colwise/Rowwise)")),
    "tp_region": (Spec("tp_region", "pytorch", "torch TP + PrepareModuleInput", region=True),),
    "sp": (Spec("sp", "paratrain", "paratrain TP+SP (LLAMA_SP_PLAN)", sp=True),
           Spec("sp", "pytorch", "torch TP+SP (SequenceParallel)", sp=True)),
}


# ---------------------------------------------------------------- counting PyTorch's collectives
class CommCounter(CommDebugMode):
    """CommDebugMode that also adds up the bytes each collective sends, by paratrain.comm's ring formulas.

    CommDebugMode (public) sees every collective op dispatched while it is active, forward and
    backward: DTensor's functional collectives (`_c10d_functional::*`) and the in-place c10d ops
    behind `torch.distributed.all_reduce` & co. (`c10d::*`, which paratrain's Comm calls). It counts
    calls only; for each op it counted, the size comes from the op's tensor arguments, read by op
    name (torch-internal op schemas: a collective missing from RULES is listed in `uncounted`).
    All-reduce of S bytes over n ranks: 2·S·(n−1)/n; all-gather / reduce-scatter / all-to-all of a
    full S: S·(n−1)/n.
    """

    # op name -> (ring factor, which argument holds the full-size tensor(s); "shard×n": input × n)
    RULES = {"all_reduce": (2, 0), "all_reduce_": (2, 0), "allreduce_": (2, 0), "all_reduce_coalesced": (2, 0),
             "reduce_scatter_tensor": (1, 0), "_reduce_scatter_base_": (1, 1),
             "all_gather_into_tensor": (1, "shard×n"), "_allgather_base_": (1, 0), "all_to_all_single": (1, 0)}

    def __init__(self, ranks: int):
        super().__init__()
        self.ranks, self.bytes, self.calls, self.uncounted = ranks, 0.0, {}, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # CommDebugMode counted a collective
            self._add(func.name().partition("::")[2].split(".")[0], args)
        return out

    def _add(self, op: str, args) -> None:
        if op not in self.RULES:
            self.uncounted.add(op)
            return
        factor, where = self.RULES[op]
        full = args[0] if where == "shard×n" else args[where]
        nbytes = sum(t.numel() * t.element_size() for t in (full if isinstance(full, (list, tuple)) else [full]))
        if where == "shard×n":
            nbytes *= self.ranks
        n = self.ranks
        self.bytes += factor * nbytes * (n - 1) / n
        kind = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather_into_tensor",
                "_reduce_scatter_base_": "reduce_scatter_tensor"}.get(op, op)
        self.calls[kind] = self.calls.get(kind, 0) + 1


# ---------------------------------------------------------------- single process, paratrain, PyTorch
@dataclass
class Runner:
    """What the training loop needs from one implementation."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: object  # (logits, targets) -> mean cross-entropy
    clip: object  # clip(max_norm)
    loss_context: object = contextlib.nullcontext  # PyTorch: loss_parallel, around the loss and backward
    comm: Comm | None = None  # paratrain's counters


def setup_single(model, spec: Spec, world: int, args) -> Runner:
    return Runner(model, adamw_factory(args)(model.parameters()), plain_cross_entropy,
                  lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def setup_paratrain(model, spec: Spec, world: int, args) -> Runner:
    mesh = build_mesh(MeshShape(tp=world))
    comm = Comm(mesh)
    info = apply_tensor_parallel(model, LLAMA_SP_PLAN if spec.sp else LLAMA_TP_PLAN, comm,
                                 sequence_parallel=spec.sp)
    loss_fn = lambda logits, targets: info.loss_fn(logits, targets, reduction="mean")  # noqa: E731
    clip = lambda max_norm: clip_grad_norm_tp_(model, info, max_norm)  # noqa: E731
    return Runner(model, adamw_factory(args)(model.parameters()), loss_fn, clip, comm=comm)


def torch_plan(sp: bool, region: bool) -> dict:
    """`parallelize_module`'s plan for the reference Transformer (torchtitan's Llama plan, adapted).

    Under SP the embedding's output stays a DTensor (`use_local_output=False`): the model sizes
    its rotary tables from the embedding output's sequence length, which a local Shard(1) tensor
    would halve. The residual stream then stays a Shard(1) DTensor (wo / w2 return DTensors) so
    that `x + attention(...)` adds two DTensors.
    """
    if sp:
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
                "norm": SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    else:
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    block = {name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv",
                                                  "feed_forward.w1", "feed_forward.w3")}
    for name in ("attention.wo", "feed_forward.w2"):
        block[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
    if sp or region:
        enters = Shard(1) if sp else Replicate()
        block["attention"] = PrepareModuleInput(input_layouts=(enters, None, None),
                                                desired_input_layouts=(Replicate(), None, None))
        block["feed_forward"] = PrepareModuleInput(input_layouts=(enters,), desired_input_layouts=(Replicate(),))
    if sp:
        block["attention_norm"], block["ffn_norm"] = SequenceParallel(), SequenceParallel()
    return {**plan, **{f"layers.*.{name}": style for name, style in block.items()}}


def setup_pytorch(model, spec: Spec, world: int, args) -> Runner:
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, torch_plan(spec.sp, spec.region))
    params = list(model.parameters())
    # Without SP the norms stay plain tensors beside DTensor shards, and torch.nn.utils.clip_grad_norm_
    # raises on the mix ("got mixed torch.Tensor and DTensor"): clip_mixed_ then does the same per kind.
    everything_dtensor = all(isinstance(p, DTensor) for p in params)
    clip = (lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm)) if everything_dtensor else (
        lambda max_norm: clip_mixed_(params, max_norm))
    return Runner(model, adamw_factory(args)(params), plain_cross_entropy, clip, loss_context=loss_parallel)


@torch.no_grad()
def clip_mixed_(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over DTensor and plain gradients: torch.nn.utils' total norm of each kind, combined."""
    grads = [p.grad for p in params if p.grad is not None]
    kinds = [g for g in (
        [g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]) if g]
    norms = [torch.nn.utils.get_total_norm(kind) for kind in kinds]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    scale = min(max_norm / (total.item() + 1e-6), 1.0)
    for grad in grads:
        grad.mul_(scale)
    return total


SETUPS = {"single": setup_single, "paratrain": setup_paratrain, "pytorch": setup_pytorch}


# ---------------------------------------------------------------- one rank
def train_step(run: Runner, x: torch.Tensor, y: torch.Tensor, clip: float) -> torch.Tensor:
    """Forward, loss, backward, clipping, optimizer step; the loss (detached)."""
    with run.loss_context():
        loss = run.loss_fn(run.model(x), y)
        loss.backward()
    if clip > 0:
        run.clip(clip)
    run.optimizer.step()
    return loss.detach()


def scalar(loss: torch.Tensor) -> float:
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


def warm_process(spec: Spec, world: int, args) -> None:
    """One step of a tiny model through this row's own setup, so the RSS peak measures data, not code.

    Ranks fork from a forkserver that imported torch but never ran it: the first step pages in
    tens of MB of libtorch (and DTensor's Python) code, which would dominate a small model's peak.
    """
    tiny = ModelConfig(vocab_size=args.vocab, dim=16 * world, n_layers=1, n_heads=world, n_kv_heads=world,
                       ffn_dim=16 * world, max_seq_len=args.seq)
    run = SETUPS[spec.framework](build_model(tiny, 0), spec, world, args)
    x, y = global_batch(0, 1, args)
    train_step(run, x[:1], y[:1], args.clip)


def attention_heads_seen(model) -> dict:
    """Record the width of the first block's query projection output as the attention reads it."""
    seen = {}

    def hook(module, inputs, output):
        seen.update(dtensor=isinstance(output, DTensor), width=output.shape[-1])
        handle.remove()

    handle = model.get_submodule("layers.0.attention.wq").register_forward_hook(hook)
    return seen


def bench_rank(rank: int, world: int, spec: Spec, args) -> dict:
    """One rank of one row: warm-up + measured steps, then one step with every collective counted."""
    warm_process(spec, world, args)
    reset_ok = reset_peak_rss()
    rss0, hwm0 = proc_status_kb("VmRSS"), proc_status_kb("VmHWM")
    run = SETUPS[spec.framework](build_model(model_config(args), args.seed), spec, world, args)
    heads = attention_heads_seen(run.model)
    times, losses, comm, calls, state = [], [], [], [], None
    for step in range(args.warmup + args.steps):
        x, y = global_batch(step, 1, args)  # the whole batch, on every tp rank
        dist.barrier()
        if run.comm is not None:
            run.comm.reset()
        t0 = time.perf_counter()
        loss = train_step(run, x, y, args.clip)
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(elapsed)
            if run.comm is not None:
                comm.append(sum(run.comm.bytes_by_axis().values()))
                calls.append(sum(run.comm.calls.values()))
        if step == args.warmup + args.steps - 1:
            state = state_bytes(run)  # after the last step, before gradients are released
        run.optimizer.zero_grad(set_to_none=True)
        losses.append(scalar(loss))
    hwm, rss_end = proc_status_kb("VmHWM"), proc_status_kb("VmRSS")
    counted = counted_step(run, world, args)
    return {"times": times, "losses": losses, "comm": comm, "calls": calls, "state": state, "counted": counted,
            "heads": heads, "rss0_kb": rss0, "hwm0_kb": hwm0, "hwm_kb": hwm, "rss_end_kb": rss_end,
            "hwm_reset": reset_ok}


def state_bytes(run: Runner) -> dict:
    """Bytes of this rank's parameters, gradients and Adam moments (distinct storages; DTensors: local)."""
    params = list(run.model.parameters())
    grads, moments = [p.grad for p in params], optimizer_tensors(run.optimizer)
    b = {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(moments)}
    return {**b, "total": storage_bytes(params + grads + moments)}


def counted_step(run: Runner, world: int, args) -> dict:
    """One more step (after the measured ones, outside timing and RSS) under CommCounter."""
    x, y = global_batch(args.warmup + args.steps, 1, args)
    if run.comm is not None:
        run.comm.reset()
    counter = CommCounter(world)
    with counter, warnings.catch_warnings():
        # CommDebugMode's module tracker hooks every module's backward; torch warns that the
        # embedding's hook fires without input grads (token ids). Harmless here.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        train_step(run, x, y, args.clip)
    out = {"bytes": counter.bytes, "calls": counter.calls, "uncounted": sorted(counter.uncounted)}
    if run.comm is not None:
        out["paratrain_comm_bytes"] = sum(run.comm.bytes_by_axis().values())
        out["paratrain_comm"] = run.comm.summary()
    return out


# ---------------------------------------------------------------- driver
def run_row(spec: Spec, world: int, args) -> dict:
    """Launch one row on `world` fresh ranks and reduce the per-rank results."""
    row = {"variant": spec.variant, "label": spec.label, "framework": spec.framework, "mode": spec.mode,
           "ranks": world}
    print(f"  {spec.label} on {world} rank(s) ...", file=sys.stderr, flush=True)
    try:
        results = run_on_ranks(bench_rank, world, spec, args, timeout=args.timeout)
    except RankError as exc:
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "detail": str(exc)}
    r0, step = results[0], statistics.median(results[0]["times"])
    counted = [r["counted"] for r in results]
    measured = spec.framework == "paratrain"  # PyTorch's bytes come from the counted step alone
    return {**row, "step_s": step, "tokens_per_s": args.micro_batch * args.seq / step,
            "step_times_s": r0["times"], "losses": r0["losses"], "attention_wq_output": r0["heads"],
            "peak_rss_delta_mb": max((r["hwm_kb"] - r["rss0_kb"]) / 1024 for r in results),
            "rss_start_mb": max(r["rss0_kb"] for r in results) / 1024,
            "rss_end_mb": max(r["rss_end_kb"] for r in results) / 1024,
            "hwm_reset": all(r["hwm_reset"] for r in results),
            "params_mb": max(r["state"]["params"] for r in results) / MB,
            "state_mb": max(r["state"]["total"] for r in results) / MB,
            "state_breakdown_mb": {k: max(r["state"][k] for r in results) / MB for k in r0["state"]},
            "comm_mb_per_step": max(statistics.mean(r["comm"]) if measured else r["counted"]["bytes"]
                                    for r in results) / MB,
            "calls_per_step": max(statistics.mean(r["calls"]) if measured else sum(r["counted"]["calls"].values())
                                  for r in results),
            "counted_step": counted}


def compare(rows: list[dict]) -> None:
    """Losses against the single process; PyTorch rows get paratrain ÷ them (same mode) as ratios."""
    ok = [r for r in rows if "error" not in r]
    single = next((r for r in ok if r["framework"] == "single"), None)
    paratrain = {r["mode"]: r for r in ok if r["framework"] == "paratrain"}
    for r in ok:
        if single is not None and r is not single:
            r["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], single["losses"]))
        ref = paratrain.get(r["mode"])
        if r["framework"] != "pytorch" or ref is None:
            continue
        for key, value in (("time", "step_s"), ("params", "params_mb"), ("state", "state_mb"),
                           ("comm", "comm_mb_per_step"), ("rss", "peak_rss_delta_mb")):
            r[f"{key}_ratio"] = ref[value] / r[value] if r[value] > 0 else None


def markdown(rows: list[dict], meta: dict) -> str:
    head = ["variant", "ranks", "step ms median (min–max)", "tokens/s", "peak RSS Δ MB/rank", "params MB/rank",
            "model state MB/rank", "comm MB/rank/step", "collectives/step", "time ratio", "params ratio",
            "state ratio", "comm ratio", "RSS ratio", "loss max rel diff vs 1 process"]
    lines = [f"# Tensor-parallel benchmark, {meta['date']}", "",
             f"- machine: {meta['platform']}, {meta['cpu_count']} CPUs ({meta['cpu_model']}), torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- model: {meta['model']} — {meta['params']:,} parameters ({meta['params'] * 4 / MB:.1f} MB fp32)",
             f"- batch: {meta['micro_batch']} × seq {meta['seq']}, the whole batch on every tp rank; fp32; AdamW lr "
             f"{meta['lr']}, clip {meta['clip']}; {meta['warmup']} warm-up + {meta['steps']} measured steps",
             "- ratios sit on the PyTorch rows: paratrain (same mode, tp or sp) ÷ that row; ≤ 1.0 means paratrain "
             "is faster / smaller",
             "- timings come from a 2-core shared machine (other jobs may run): they are noisy; parameter, "
             "model-state and comm bytes are exact. Load average (1, 5, 15 min) at start "
             f"{fmt_load(meta['load_avg_start'])}, at end {fmt_load(meta['load_avg_end'])}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['ranks']} | {r['error']} |" + " |" * (len(head) - 3))
            continue
        spread = fmt_spread(r, ".1f")
        cells = [r["label"], str(r["ranks"]), spread, fmt(r["tokens_per_s"], ",.0f"),
                 fmt(r["peak_rss_delta_mb"], ".1f"), fmt(r["params_mb"], ".2f"), fmt(r["state_mb"], ".2f"),
                 fmt(r["comm_mb_per_step"], ".2f"), fmt(r["calls_per_step"], ".0f")]
        cells += [fmt(r.get(f"{k}_ratio"), ".2f") for k in ("time", "params", "state", "comm", "rss")]
        cells.append(fmt(r.get("loss_max_rel_diff"), ".1e"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += details(rows)
    return "\n".join(lines) + "\n"


def details(rows: list[dict]) -> list[str]:
    """Collectives by kind, the counter's cross-check on paratrain, what the attention saw, failures."""
    ok = [r for r in rows if "error" not in r]
    lines = ["", "Collectives per step by kind (rank 0, the counted step):", ""]
    for r in ok:
        c = r["counted_step"][0]
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(c["calls"].items())) or "none"
        check = ""
        if "paratrain_comm_bytes" in c:
            check = (f" — CommCounter {c['bytes'] / MB:.3f} MB vs paratrain's Comm "
                     f"{c['paratrain_comm_bytes'] / MB:.3f} MB on the same step")
        lines.append(f"- {r['label']}: {kinds}{check}" + (f"; not counted: {c['uncounted']}" if c["uncounted"] else ""))
    if ok:
        seen = "; ".join(f"{r['label']}: {r['attention_wq_output'].get('width')}"
                         f"{' (DTensor)' if r['attention_wq_output'].get('dtensor') else ''}" for r in ok)
        lines += ["", f"Width of `layers.0.attention.wq`'s output as the attention reads it: {seen}."]
        lines += rss_start_note([r["rss_start_mb"] for r in ok], all(r["hwm_reset"] for r in ok),
                                "after a warm-up step of a tiny model through the same setup")
    return lines + failure_notes(rows, lambda r: f"{r['label']}, {r['ranks']} ranks")


def parse_args(argv=None):
    p = doc_parser(__doc__)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (ranks per row)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="rows to run besides the single-process reference")
    add_common_args(p, micro_batch_default=8, micro_batch_help="sequences per step (every tp rank sees all of them)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for tp-<time>.md and .json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.tp < 2:
        p.error("--steps must be >= 1, --warmup >= 0, --tp >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    meta = run_meta(args, now)
    rows = [run_row(SINGLE, 1, args)]
    rows += [run_row(spec, args.tp, args) for variant in args.variants for spec in VARIANTS[variant]]
    meta["load_avg_end"] = os.getloadavg()
    compare(rows)
    text = markdown(rows, meta)
    print(text)
    write_results(args.out, "tp", now, text, {"meta": meta, "args": vars(args), "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
