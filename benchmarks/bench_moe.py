"""Expert-parallel benchmark: a mixture-of-experts model at ep 1/2/4 on the same ranks against one process.

    python benchmarks/bench_moe.py                          # defaults: a 2-layer, 8-expert MoE, 4 ranks, ep 1 2 4, 3 rounds
    python benchmarks/bench_moe.py --steps 2 --warmup 1 --rounds 1 --ep 2

Rows (each round of each row its own `run_on_ranks` launch on CPU gloo ranks, one thread per rank; the same
model, init and global batches; the rounds alternate the rows' order):
    one process   the plain model on the whole global batch (ranks × micro-batch sequences): the reference
    epN           `parallelize` on `MeshShape(dp=ranks, ep=N)`: rank r takes its micro-batch of the global batch,
                  each holds E/N experts of every MoE layer (ep1: all of them, the experts are data parallel),
                  tokens go to their experts' ranks and back by all-to-all; gradients averaged over the data ranks

Per row: step time (rank 0, the median of the rounds' medians, min–max over every measured step); the
peak of live tensor bytes per rank over one step (`paratrain.peak_memory.TensorMemory`, max over ranks)
with the model state in it (parameters, gradients, optimizer state) and the process's peak RSS rise over
that step (glibc returning freed memory at once, as MALLOC_MMAP_THRESHOLD_=131072 makes it); the
all-to-all bytes each rank sends on the ep axis in one step, counted where they reach torch.distributed
(`paratrain.testing.Collectives`), beside the formula evaluated on that step's actual routing
(the formula of tests/parallel/expert/test_expert_parallel.py, for any ep: per MoE layer, forward and again backward,
the rows this rank routes to experts on other ranks plus the rows other ranks route to its experts, D fp32
elements each, plus the forward's (ep − 1)·E/ep int64 counts; equal, not approximately equal); and the
largest relative differences of the LM losses and of the auxiliary losses from one process's. See
benchmarks/README.md.
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import (
    MB, adamw_factory, add_common_args, build_model, doc_parser, failed_row, fmt, fmt_load, fmt_spread, global_batch,
    machine, run_rounds, write_results,
)
from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import ModelConfig
from paratrain.parallel.api import parallelize
from paratrain.parallel.expert import moe_layers
from paratrain.peak_memory import TensorMemory, return_freed_memory
from paratrain.ranks import RankError, run_on_ranks
from paratrain.testing import Collectives

STATE = ("parameters", "gradients", "optimizer")


@dataclass(frozen=True)
class Spec:
    """One row: one process, or `parallelize` with expert-parallel degree `ep` on `ranks` data ranks."""

    ep: int  # 0: one process
    ranks: int

    @property
    def label(self) -> str:
        return "one process (reference)" if self.ep == 0 else f"ep{self.ep}"

    @property
    def world(self) -> int:
        return 1 if self.ep == 0 else self.ranks


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_dim=args.ffn, max_seq_len=args.seq, n_experts=args.experts,
                       top_k=args.top_k, expert_ffn_dim=args.expert_ffn, aux_loss_coef=args.aux_coef)


# ---------------------------------------------------------------- the two implementations
class Single:
    """One process: mean cross-entropy over the global batch; the aux loss averaged over its sequences."""

    def __init__(self, args, spec: Spec):
        self.model = build_model(model_config(args), args.seed)
        self.optimizer = adamw_factory(args)(self.model.parameters())
        self.layers = moe_layers(self.model)
        self.mesh = None

    def rows(self, x, y, spec: Spec):
        return x, y

    def forward(self, x, y):
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


class Paratrain(Single):
    """`parallelize` on `MeshShape(dp=ranks, ep=ep)`: each rank its micro-batch's mean, gradients averaged."""

    def __init__(self, args, spec: Spec):
        self.mesh = build_mesh(MeshShape(dp=spec.ranks, ep=spec.ep))
        self.model, self.optimizer = parallelize(build_model(model_config(args), args.seed), self.mesh,
                                                 optimizer=adamw_factory(args))
        self.layers = moe_layers(self.model.module)

    def rows(self, x, y, spec: Spec):
        mb = x.shape[0] // spec.ranks
        r = dist.get_rank()
        return x[r * mb:(r + 1) * mb], y[r * mb:(r + 1) * mb]

    def forward(self, x, y):
        return self.model.loss_fn(self.model(x), y) / y.numel()

    def clip(self, max_norm: float) -> None:
        self.model.clip_grad_norm_(max_norm)


# ---------------------------------------------------------------- one rank
def step(run: Single, x, y, args) -> tuple[float, float]:
    """One training step; (LM loss, aux loss) of the global batch (ranks' means averaged: equal micro-batches)."""
    loss = run.forward(x, y)
    loss.backward()
    if args.clip > 0:
        run.clip(args.clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    value = torch.stack([loss.detach(), sum(layer.last_aux_loss for layer in run.layers)])
    if dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value[0].item(), value[1].item()


def a2a_formula(counts: list[list[list[int]]], group: list[int], rank: int, num_experts: int, dim: int) -> int:
    """Bytes `rank` sends on ep in one step: per layer 2·(rows it routes away + rows routed to it)·D·4 + the
    (ep − 1)·E/ep int64 counts. counts[layer][r]: rank r's assignments per expert in that layer."""
    ep = len(group)
    local = num_experts // ep
    me = group.index(rank)
    total = 0
    for per_rank in counts:
        mine = per_rank[rank]
        away = sum(mine) - sum(mine[me * local:(me + 1) * local])
        came = sum(sum(per_rank[other][me * local:(me + 1) * local]) for other in group if other != rank)
        total += 2 * (away + came) * dim * 4 + (ep - 1) * local * 8
    return total


def measured_a2a(run: Single, x, y, spec: Spec, args) -> dict:
    """One step under `Collectives`: the ep axis's bytes as torch.distributed saw them, and the formula on the
    routing of that very step (each rank's tokens per expert, gathered after the count)."""
    counted = Collectives()
    with counted:
        losses = step(run, x, y, args)
    sent = counted.by_axis(run.mesh).get("ep", 0.0) if run.mesh is not None else 0.0
    per_layer = [layer.last_tokens_per_expert for layer in run.layers]
    world = dist.get_world_size()
    counts = []
    for c in per_layer:
        gathered = [torch.zeros_like(c) for _ in range(world)]
        dist.all_gather(gathered, c)
        counts.append([g.tolist() for g in gathered])
    group = run.mesh.ranks("ep") if spec.ep > 1 else [dist.get_rank()]
    return {"losses": losses, "sent": sent,
            "formula": a2a_formula(counts, group, dist.get_rank(), args.experts, args.dim)}


def measured_memory(run: Single, x, y, args) -> dict:
    """One step under `TensorMemory`: the peak of live tensor bytes, by category, and the peak RSS rise."""
    gc.collect()
    meter = TensorMemory()
    with meter:
        dist.barrier()
        meter.begin(run.model, run.optimizer)
        losses = step(run, x, y, args)
        window = meter.end(run.model, run.optimizer)
    return {"losses": losses, "peak": window.peak_bytes, "by_category": window.by_category,
            "rss_rise": window.process_rise_bytes}


def bench_rank(rank: int, world: int, spec: Spec, args) -> dict:  # noqa: ARG001
    return_freed_memory()
    run = (Single if spec.ep == 0 else Paratrain)(args, spec)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        x, y = run.rows(*global_batch(i, spec.ranks, args), spec)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(run, x, y, args))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    n = args.warmup + args.steps
    a2a = measured_a2a(run, *run.rows(*global_batch(n, spec.ranks, args), spec), spec, args)
    memory = measured_memory(run, *run.rows(*global_batch(n + 1, spec.ranks, args), spec), args)
    losses += [a2a.pop("losses"), memory.pop("losses")]
    return {"times": times, "losses": losses, **a2a, **memory}


# ---------------------------------------------------------------- driver
def run_row(spec: Spec, args) -> dict:
    row = {"label": spec.label, "ep": spec.ep, "ranks": spec.world}
    print(f"  {spec.label} on {spec.world} rank(s) ...", file=sys.stderr, flush=True)
    try:
        results = run_on_ranks(bench_rank, spec.world, spec, args, timeout=args.timeout)
    except RankError as exc:
        return failed_row(row, exc)
    r0 = results[0]
    worst = max(results, key=lambda r: r["peak"])
    return {**row, "step_s": statistics.median(r0["times"]), "step_times_s": r0["times"],
            "tokens_per_s": args.micro_batch * args.ranks * args.seq / statistics.median(r0["times"]),
            "lm_losses": [a for a, _ in r0["losses"]], "aux_losses": [b for _, b in r0["losses"]],
            "peak_mb": worst["peak"] / MB, "state_mb": sum(worst["by_category"][k] for k in STATE) / MB,
            "by_category_mb": {k: v / MB for k, v in worst["by_category"].items()},
            "rss_rise_mb": max(r["rss_rise"] for r in results) / MB,
            "a2a_bytes": [r["sent"] for r in results], "a2a_formula": [r["formula"] for r in results]}


def compare(rows: list[dict]) -> None:
    """Losses against one process's; step time and peak memory as ratios to it."""
    ok = [r for r in rows if "error" not in r]
    single = next((r for r in ok if r["ep"] == 0), None)
    if single is None:
        return
    for r in ok:
        for kind in ("lm", "aux"):
            pairs = zip(r[f"{kind}_losses"], single[f"{kind}_losses"])
            r[f"{kind}_loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in pairs)
        r["time_ratio"] = r["step_s"] / single["step_s"]
        r["peak_ratio"] = r["peak_mb"] / single["peak_mb"]


def markdown(rows: list[dict], meta: dict) -> str:
    head = ["row", "ranks", "step ms median (min–max)", "÷ one process", "peak tensors MB/rank", "of which model "
            "state", "peak RSS rise MB/rank", "all-to-all bytes/rank/step (ep axis)", "formula", "LM loss max rel "
            "diff", "aux loss max rel diff"]
    lines = [f"# Expert-parallel benchmark, {meta['date']}", "",
             f"- machine: {meta['platform']}, {meta['cpu_count']} CPUs ({meta['cpu_model']}), torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- model: {meta['model']} — {meta['params']:,} parameters, {meta['active_params']:,} active per token",
             f"- batch: {meta['ranks']} ranks × micro-batch {meta['micro_batch']} × seq {meta['seq']} (one process: "
             f"the whole global batch); fp32; AdamW lr {meta['lr']}, clip {meta['clip']}; {meta['warmup']} warm-up "
             f"+ {meta['steps']} timed steps, then one step counting the all-to-all and one measuring memory; "
             f"{meta['rounds']} rounds per row, the rows' order alternating",
             "- peak tensors: the peak of live tensor bytes over one step (TensorMemory), max over ranks; model state: "
             "parameters + gradients + optimizer state alive at that peak; RSS rise: peak RSS over that step above "
             "its start (freed memory returned at once)",
             "- all-to-all bytes: per rank (rank 0, 1, ...), as torch.distributed saw them; the formula on the "
             "same step's routing beside them",
             "- timings come from a 2-core shared machine that the ranks oversubscribe: noisy. Load average (1, 5, "
             f"15 min) at start {fmt_load(meta['load_avg_start'])}, at end {fmt_load(meta['load_avg_end'])}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['ranks']} | did not run: {r['error']} |" + " |" * (len(head) - 3))
            continue
        spread = fmt_spread(r, ".0f")
        equal = r["a2a_bytes"] == r["a2a_formula"]
        cells = [r["label"], str(r["ranks"]), spread, fmt(r.get("time_ratio"), ".2f"), fmt(r["peak_mb"], ".2f"),
                 fmt(r["state_mb"], ".2f"), fmt(r["rss_rise_mb"], ".1f"),
                 " / ".join(f"{b:,.0f}" for b in r["a2a_bytes"]) if r["ep"] else "-",
                 (" / ".join(f"{b:,}" for b in r["a2a_formula"]) + (" (equal)" if equal else " (DIFFERS)"))
                 if r["ep"] else "-",
                 fmt(r.get("lm_loss_max_rel_diff"), ".1e"), fmt(r.get("aux_loss_max_rel_diff"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = doc_parser(__doc__)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4], help="expert-parallel degrees (one row each)")
    p.add_argument("--ranks", type=int, default=4, help="data ranks of every epN row (each ep divides it)")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--expert-ffn", type=int, default=128, help="hidden width of each expert")
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss coefficient")
    p.add_argument("--rounds", type=int, default=3, help="launches per row (the spread of step times over them)")
    add_common_args(p, micro_batch_default=2, micro_batch_help="sequences per rank per step")
    p.set_defaults(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, seq=64, steps=4, warmup=1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for moe-<time>.md and .json")
    args = p.parse_args(argv)
    if any(args.ranks % ep or args.experts % ep for ep in args.ep) or args.steps < 1 or args.rounds < 1:
        p.error("every --ep must divide --ranks and --experts; --steps and --rounds >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    cfg = model_config(args)
    meta = {"date": now.isoformat(timespec="seconds"), **machine(),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "model": repr(cfg),
            "params": cfg.num_params(), "active_params": cfg.num_active_params(),
            **{k: getattr(args, k) for k in ("ranks", "micro_batch", "seq", "lr", "clip", "warmup", "steps", "seed",
                                             "rounds")}, "load_avg_start": os.getloadavg()}
    specs = [Spec(0, args.ranks)] + [Spec(ep, args.ranks) for ep in args.ep]
    rows = run_rounds(specs, args.rounds, lambda spec: run_row(spec, args))
    compare(rows)
    meta["load_avg_end"] = os.getloadavg()
    text = markdown(rows, meta)
    print(text)
    write_results(args.out, "moe", now, text, {"meta": meta, "rows": rows})
    broken = [r for r in rows if "error" in r or r.get("ep") and r["a2a_bytes"] != r["a2a_formula"]]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
