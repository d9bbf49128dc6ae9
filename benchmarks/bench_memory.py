"""Peak memory per rank: paratrain's DDP / ZeRO-1/2/3 against PyTorch's own, side by side in one invocation.

    python benchmarks/bench_memory.py                                   # both models, 2 and 4 ranks, every pair
    python benchmarks/bench_memory.py --models linear --ranks 4 --variants zero2 zero3

Pairs (paratrain variant <-> PyTorch counterpart):
    ddp    zero=0  <-> torch.nn.parallel.DistributedDataParallel
    zero1  zero=1  <-> ZeroRedundancyOptimizer(AdamW) + DistributedDataParallel
    zero2  zero=2  <-> FSDP2 fully_shard(reshard_after_forward=False)
    zero3  zero=3  <-> FSDP2 fully_shard(reshard_after_forward=True)
    hsdp   zero=3, --dp-shard world/2  <-> FSDP2 fully_shard on a (replicate 2, shard world/2) mesh (4+ ranks)

Models: `linear` is weights-only (16 x Linear(1024, 1024) in an nn.Sequential, 16.8M parameters, a
batch of a few rows: activations are negligible, so the peak is model state and buffers); `transformer`
is the reference model with activations (bench_dp's shape options). Every variant runs in its own
launch (fresh processes, gloo, one thread per rank) on the same model, init and batches.

Per rank, over the memory steps (the first steps of the run, optimizer state created in the first):
- tracked peak: the peak of live tensor bytes (paratrain.peak_memory.TensorMemory: every operator
  and collective seen by a dispatch mode), absolute, with what made it up by category;
- RSS rise: peak RSS (VmHWM, reset when the steps begin) minus the RSS before the first step, with
  glibc returning freed memory at once (mallopt M_MMAP_THRESHOLD = 128 KiB, as
  MALLOC_MMAP_THRESHOLD_=131072 does);
then step time over further steps without the meter. Ratios are paratrain / PyTorch (<= 1.0: paratrain
needs less). Results: benchmarks/results/memory-<time>.md and .json.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench_dp import PAIRS, setup_paratrain, setup_pytorch
from common import (
    MB, add_common_args, build_model, doc_parser, failure_notes, fmt, fmt_load, fmt_spread, machine, model_config,
    proc_status_kb, warm_process, write_results,
)
from paratrain.peak_memory import CATEGORIES, TensorMemory, return_freed_memory
from paratrain.ranks import RankError, run_on_ranks

LINEAR_WIDTH, LINEAR_LAYERS = 1024, 16


def build(kind: str, args) -> nn.Module:
    if kind == "transformer":
        return build_model(model_config(args), args.seed)
    torch.manual_seed(args.seed)
    return nn.Sequential(*(nn.Linear(LINEAR_WIDTH, LINEAR_WIDTH) for _ in range(LINEAR_LAYERS)))


def batch(kind: str, step: int, rank: int, world: int, args):
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    if kind == "linear":
        x = torch.randn(args.linear_rows * world, LINEAR_WIDTH, generator=g)
        return x[rank * args.linear_rows:(rank + 1) * args.linear_rows], None
    shape = (args.micro_batch * world, args.seq)
    x, y = torch.randint(0, args.vocab, shape, generator=g), torch.randint(0, args.vocab, shape, generator=g)
    rows = slice(rank * args.micro_batch, (rank + 1) * args.micro_batch)
    return x[rows], y[rows]


def loss_of(model, x, y):
    out = model(x)
    if y is None:
        return out.float().pow(2).mean()
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def one_step(run, x, y, clip: float) -> float:
    loss = loss_of(run.model, x, y)
    loss.backward()
    if clip > 0:
        run.clip(clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def memory_rank(rank: int, world: int, kind: str, spec, args) -> dict:
    return_freed_memory()
    warm_process(args)
    model = build(kind, args)
    run = (setup_paratrain if spec.framework == "paratrain" else setup_pytorch)(model, spec, world, args)
    losses = []
    meter = TensorMemory()
    with meter:
        dist.barrier()
        rss_before = proc_status_kb("VmRSS")
        meter.begin(run.model, run.optimizer)
        for step in range(args.memory_steps):
            losses.append(one_step(run, *batch(kind, step, rank, world, args), args.clip))
        window = meter.end(run.model, run.optimizer)
    times = []
    for step in range(args.memory_steps, args.memory_steps + args.timed_steps):
        x, y = batch(kind, step, rank, world, args)
        dist.barrier()
        start = time.perf_counter()
        losses.append(one_step(run, x, y, args.clip))
        times.append(time.perf_counter() - start)
    run.close()
    return {"tracked_peak": window.peak_bytes, "tracked_start": window.start_bytes,
            "by_category": window.by_category, "largest": window.largest, "rss_rise": window.process.peak_bytes - rss_before * 1024,
            "times": times, "losses": losses}


def run_variant(kind: str, spec, world: int, args) -> dict:
    row = {"model": kind, "pair": spec.pair, "variant": spec.label, "framework": spec.framework, "ranks": world}
    print(f"  {kind}: {spec.label} on {world} ranks ...", file=sys.stderr, flush=True)
    try:
        results = run_on_ranks(memory_rank, world, kind, spec, args, timeout=args.timeout)
    except RankError as exc:
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "detail": str(exc)}
    worst = max(results, key=lambda r: r["tracked_peak"])
    return {**row, "tracked_peak_mb": worst["tracked_peak"] / MB, "tracked_start_mb": worst["tracked_start"] / MB,
            "by_category_mb": {k: v / MB for k, v in worst["by_category"].items()},
            "largest_at_peak": [(n / MB, *rest) for n, *rest in worst["largest"]],
            "rss_rise_mb": max(r["rss_rise"] for r in results) / MB,
            "step_s": statistics.median(results[0]["times"]), "step_times_s": results[0]["times"],
            "losses": results[0]["losses"]}


def compare(rows: list[dict]) -> None:
    by_key = {(r["model"], r["pair"], r["ranks"], r["framework"]): r for r in rows}
    for r in rows:
        ref = by_key.get((r["model"], r["pair"], r["ranks"], "pytorch"))
        if r["framework"] != "paratrain" or "error" in r or ref is None or "error" in ref:
            continue
        r["tracked_ratio"] = r["tracked_peak_mb"] / ref["tracked_peak_mb"]
        r["rss_ratio"] = r["rss_rise_mb"] / ref["rss_rise_mb"] if ref["rss_rise_mb"] > 0 else None
        r["time_ratio"] = r["step_s"] / ref["step_s"]
        r["loss_max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"]))


def markdown(rows: list[dict], meta: dict) -> str:
    short = {"parameters": "param", "gradients": "grad", "optimizer": "opt", "communication": "comm",
             "activations": "act", "temporaries": "temp", "other": "other"}
    head = ["model", "variant", "ranks", "tracked peak MiB", "at the peak: " + " / ".join(short[c] for c in CATEGORIES),
            "RSS rise MiB", "step ms median (min–max)", "tracked ratio", "RSS ratio", "time ratio", "loss max rel diff"]
    lines = [f"# Peak memory per rank, {meta['date']}", "",
             f"- machine: {meta['platform']}, {meta['cpu_count']} CPUs ({meta['cpu_model']}), torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- models: linear = {LINEAR_LAYERS} x Linear({LINEAR_WIDTH}, {LINEAR_WIDTH}), {meta['linear_rows']} rows "
             f"per rank; transformer = {meta['model']}, micro-batch {meta['micro_batch']} x seq {meta['seq']} per rank",
             f"- AdamW, clip {meta['clip']}, bucket {meta['bucket_mb']} MB (paratrain and DDP); memory over the first "
             f"{meta['memory_steps']} steps, step time over the next {meta['timed_steps']}",
             "- tracked peak: peak of live tensor bytes of the worst rank (absolute, model state included); "
             "RSS rise: peak RSS above the RSS before the first step (worst rank), freed memory returned at once",
             "- ratios: paratrain / PyTorch counterpart (the row below it); <= 1.0 means paratrain needs less",
             f"- 2 shared cores: step times are noisy. Load average (1, 5, 15 min) at start "
             f"{fmt_load(meta['load_avg_start'])}, at end {fmt_load(meta['load_avg_end'])}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {r['ranks']} | {r['error']} |" + " |" * (len(head) - 4))
            continue
        parts = " / ".join(f"{r['by_category_mb'][c]:.1f}" for c in CATEGORIES)
        spread = fmt_spread(r, ".0f")
        cells = [r["model"], r["variant"], str(r["ranks"]), f"{r['tracked_peak_mb']:.1f}", parts,
                 f"{r['rss_rise_mb']:.1f}", spread, fmt(r.get("tracked_ratio"), ".2f"), fmt(r.get("rss_ratio"), ".2f"),
                 fmt(r.get("time_ratio"), ".2f"), fmt(r.get("loss_max_rel_diff"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    if meta["largest"]:
        for r in rows:
            if "largest_at_peak" in r:
                lines += ["", f"Largest storages at the peak, {r['model']} {r['variant']} on {r['ranks']} ranks "
                              "(MiB, category, made in, by operator):", ""]
                lines += [f"- {mb:.2f} {cat} {born} {op}" for mb, cat, born, op in r["largest_at_peak"]]
    lines += failure_notes(rows, lambda r: f"{r['model']} {r['variant']}, {r['ranks']} ranks")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = doc_parser(__doc__)
    p.add_argument("--models", nargs="+", choices=["linear", "transformer"], default=["linear", "transformer"],
                   help="models to run")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes, one launch per variant each")
    p.add_argument("--variants", nargs="+", choices=list(PAIRS), default=list(PAIRS),
                   help="pairs to run (each runs its paratrain and its PyTorch side)")
    add_common_args(p, micro_batch_default=2, micro_batch_help="transformer: sequences per rank per step")
    p.add_argument("--linear-rows", type=int, default=4, help="linear: rows of the batch per rank")
    p.add_argument("--memory-steps", type=int, default=4, help="steps measured for memory (from the first)")
    p.add_argument("--timed-steps", type=int, default=5, help="steps timed after them, without the meter")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size (paratrain DDP/ZeRO-1/2, torch DDP)")
    p.add_argument("--largest", action="store_true", help="list the largest storages alive at each peak")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for memory-<time>.md and .json")
    args = p.parse_args(argv)
    if args.memory_steps < 1 or args.timed_steps < 1 or min(args.ranks) < 1:
        p.error("--memory-steps and --timed-steps must be >= 1, --ranks >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    cfg = model_config(args)
    meta = {"date": now.isoformat(timespec="seconds"), **machine(),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "model": repr(cfg),
            **{k: getattr(args, k) for k in ("micro_batch", "seq", "clip", "bucket_mb", "memory_steps", "timed_steps",
                                             "linear_rows", "largest")},
            "load_avg_start": os.getloadavg()}
    rows = []
    for kind in args.models:
        for world in args.ranks:
            for pair in args.variants:
                rows.extend(run_variant(kind, spec, world, args) for spec in PAIRS[pair] if spec.usable(world))
    meta["load_avg_end"] = os.getloadavg()
    compare(rows)
    text = markdown(rows, meta)
    print(text)
    write_results(args.out, "memory", now, text, {"meta": meta, "args": vars(args), "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
