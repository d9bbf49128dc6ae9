"""Step time of paratrain against PyTorch in one launch, the two sides taking turns step by step.

    python benchmarks/bench_paired.py                                # every pair, 40 measured steps each
    python benchmarks/bench_paired.py --pairs pp-1f1b dp-ddp --steps 60

On a shared machine a pair's time ratio moves by ±10% between launches (other jobs, where the
scheduler puts the ranks), more than the differences the other benchmarks look for, whose
sides run in separate launches. Here every rank builds both sides of a pair, from the
setups of the benchmark that names it, on the same model and batches, and runs their steps in
turn, the order alternating: each paratrain step has a PyTorch step beside it under the same
load. A step's time is its slowest rank's. Reported per pair: each side's median, the median of
the per-step ratios (paratrain ÷ PyTorch) with their quartiles, and in how many steps paratrain
was the faster. Both sides live in one process, so this measures time only (memory: the other
benchmarks).

Pairs (each benchmark's default model and sizes):
    dp-ddp dp-zero1 dp-zero2 dp-zero3    bench_dp.py: DDP / ZeroRedundancyOptimizer / FSDP2, --ranks ranks
    dp-ddp-agreed                        dp-ddp, the PyTorch side ending its step as paratrain's agreement
                                         does (one all-reduce of every rank's flags and squared norm, one
                                         host read): how much of dp-ddp's difference is that agreement
    pp-gpipe pp-1f1b pp-interleaved pp-zb-h1
                                         bench_pp.py: torch.distributed.pipelining's schedule, --pp ranks
    tp-plain tp-region tp-sp             bench_tp.py: parallelize_module with Colwise/Rowwise, the same with
                                         PrepareModuleInput, with SequenceParallel; --ranks ranks
    overhead-ddp ... overhead-pp         bench_overhead.py: 96 blocks × 4 Linear(64, 64), --ranks ranks
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import bench_dp  # noqa: E402
import bench_overhead  # noqa: E402
import bench_pp  # noqa: E402
import bench_tp  # noqa: E402
from common import build_model, doc_parser, fmt_load, global_batch, machine, model_config, write_results  # noqa: E402
from paratrain.ranks import RankError, run_on_ranks  # noqa: E402

PAIRS = ([f"dp-{p}" for p in ("ddp", "zero1", "zero2", "zero3", "ddp-agreed")]
         + [f"pp-{v}" for v in ("gpipe", "1f1b", "interleaved", "zb-h1")]
         + ["tp-plain", "tp-region", "tp-sp"]
         + [f"overhead-{p}" for p in ("ddp", "zero1", "zero2", "zero3", "tp", "pp")])


# ---------------------------------------------------------------- each benchmark's two sides
def optimizer_step(run, clip: float) -> None:
    """Clipping, the optimizer's step, gradients released: the end of every step (bench_dp's and bench_pp's runners)."""
    run.clip(clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def agreed(clip):
    """PyTorch's clipping, then what paratrain's agreement adds to a step: every rank's non-finite flag and
    squared norm summed over the ranks in one all-reduce and read on the host, where the step's decision is made."""
    def clip_and_agree(max_norm):
        norm = clip(max_norm)
        row = torch.stack([(~norm.isfinite()).to(norm.dtype), norm.square()])
        dist.all_reduce(row)
        row.tolist()
        return norm
    return clip_and_agree


def dp_sides(pair: str, rank: int, world: int, microbatches: int) -> dict:
    args = bench_dp.parse_args([])
    sides = {}
    for spec in bench_dp.PAIRS[pair.removesuffix("-agreed")]:
        model = build_model(model_config(args), args.seed)
        run = (bench_dp.setup_paratrain if spec.framework == "paratrain" else bench_dp.setup_pytorch)(
            model, spec, world, args)
        run.close()  # PyTorch's side: its communication counters off (they would count paratrain's calls too)
        if pair.endswith("-agreed") and spec.framework == "pytorch":
            run = dataclasses.replace(run, clip=agreed(run.clip))

        def step(i, run=run):
            rows = slice(rank * args.micro_batch, (rank + 1) * args.micro_batch)
            x, y = (t[rows] for t in global_batch(i, world, args))
            F.cross_entropy(run.model(x).flatten(0, 1).float(), y.flatten()).backward()
            optimizer_step(run, args.clip)
        sides[spec.framework] = step
    return sides


def pp_sides(variant: str, rank: int, world: int, microbatches: int) -> dict:
    args = bench_pp.parse_args(["--pp", str(world), "--microbatches", str(microbatches)])
    sides = {}
    for spec in bench_pp.make_variants(args.virtual_stages)[variant]:
        run = bench_pp.SETUPS[spec.framework](bench_pp.model_config(args), spec, args, bench_pp.ActionClock())

        def step(i, run=run):
            run.train(*bench_pp.global_batch(i, args.microbatches, args))
            optimizer_step(run, args.clip)
        sides[spec.framework] = step
    return sides


def tp_sides(variant: str, rank: int, world: int, microbatches: int) -> dict:
    args = bench_tp.parse_args([])
    ours = bench_tp.VARIANTS["sp" if variant == "sp" else "tp"][0]
    theirs = {"plain": bench_tp.VARIANTS["tp"][1], "region": bench_tp.VARIANTS["tp_region"][0],
              "sp": bench_tp.VARIANTS["sp"][1]}[variant]
    sides = {}
    for spec in (ours, theirs):
        run = bench_tp.SETUPS[spec.framework](bench_tp.build_model(bench_tp.model_config(args), args.seed), spec,
                                              world, args)

        def step(i, run=run):
            bench_tp.train_step(run, *bench_tp.global_batch(i, 1, args), args.clip)  # the whole batch on every rank
            run.optimizer.zero_grad(set_to_none=True)
        sides[spec.framework] = step
    return sides


def overhead_sides(pair: str, rank: int, world: int, microbatches: int) -> dict:
    args = bench_overhead.parse_args([])
    sides = {}
    for framework in ("paratrain", "pytorch"):
        if pair == "tp":
            fn, _ = bench_overhead.tensor_parallel(framework, world, args)
        elif pair == "pp":
            fn, _ = bench_overhead.pipeline_parallel(framework, world, args)
        else:
            fn, _ = bench_overhead.data_parallel(pair, framework, world, args)
        rows = args.rows * (args.microbatches if pair == "pp" else 1)

        def step(i, fn=fn):
            fn(*bench_overhead.batch(i, 0 if pair in ("tp", "pp") else rank, rows, args.seed))
        sides[framework] = step
    return sides


SUITES = {"dp": dp_sides, "pp": pp_sides, "tp": tp_sides, "overhead": overhead_sides}


# ---------------------------------------------------------------- one launch
def paired_rank(rank: int, world: int, pair: str, args) -> dict:
    """Both sides of `pair` on this rank, their steps in turn; each step's time is its slowest rank's."""
    suite, name = pair.split("-", 1)
    sides = SUITES[suite](name, rank, world, args.microbatches)
    order = list(sides)
    times: dict[str, list[float]] = {side: [] for side in order}
    for i in range(args.warmup + args.steps):
        for side in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            sides[side](i)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[side].append(elapsed.item())
    return times


def world_of(pair: str, args) -> int:
    return args.pp if pair.startswith("pp-") else args.ranks


def summarize(pair: str, times: dict) -> dict:
    ours, theirs = times["paratrain"], times["pytorch"]
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"pair": pair, "paratrain_ms": 1e3 * statistics.median(ours), "pytorch_ms": 1e3 * statistics.median(theirs),
            "ratio_median": median, "ratio_q1": q1, "ratio_q3": q3, "faster": sum(r < 1.0 for r in ratios),
            "steps": len(ratios), "times": times}


def markdown(rows: list[dict], meta: dict, args) -> str:
    lines = [f"# paratrain against PyTorch, step by step in one launch ({meta['date']})", "",
             f"Machine: {meta['platform']}, {meta['cpu_count']} CPUs, torch {meta['torch']}; load average "
             f"{fmt_load(meta['load_avg_start'])} at start, {fmt_load(meta['load_avg_end'])} at the end. Command: "
             f"`{meta['command']}`.", "",
             f"Each launch builds both sides of a pair on every rank and runs {args.warmup} warm-up + {args.steps} "
             "measured steps of each in turn (the order alternating); a step's time is its slowest rank's. "
             "Ratio: paratrain ÷ PyTorch per step, median (quartiles); faster: steps in which paratrain was.", "",
             "| pair | ranks | paratrain ms (median) | PyTorch ms (median) | ratio median (q1–q3) | paratrain faster |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['pair']} | {r['ranks']} | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['pair']} | {r['ranks']} | {r['paratrain_ms']:.1f} | {r['pytorch_ms']:.1f} | "
                     f"**{r['ratio_median']:.3f}** ({r['ratio_q1']:.3f}–{r['ratio_q3']:.3f}) | "
                     f"{r['faster']} of {r['steps']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = doc_parser(__doc__)
    p.add_argument("--pairs", nargs="+", choices=PAIRS, default=PAIRS, metavar="PAIR",
                   help=f"pairs to run, one launch each: {' '.join(PAIRS)}")
    p.add_argument("--ranks", type=int, default=2, help="processes of the dp-, tp- and overhead- pairs")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks of the pp- pairs")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of the pp- pairs")
    p.add_argument("--steps", type=int, default=40, help="measured steps of each side")
    p.add_argument("--warmup", type=int, default=3, help="steps of each side run first, not measured")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launch")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for paired-<time>.md and .json")
    args = p.parse_args(argv)
    if args.steps < 2 or args.warmup < 0 or args.ranks < 2 or args.pp < 2:
        p.error("--steps must be >= 2, --warmup >= 0, --ranks and --pp >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    meta = {"date": now.isoformat(timespec="seconds"), **machine(), "command": " ".join(["python"] + sys.argv),
            "load_avg_start": os.getloadavg()}
    rows = []
    for pair in args.pairs:
        world = world_of(pair, args)
        print(f"  {pair} on {world} ranks ...", file=sys.stderr, flush=True)
        try:
            times = run_on_ranks(paired_rank, world, pair, args, timeout=args.timeout)[0]
            rows.append({**summarize(pair, times), "ranks": world})
        except RankError as exc:
            rows.append({"pair": pair, "ranks": world, "error": str(exc).splitlines()[0]})
    meta["load_avg_end"] = os.getloadavg()
    text = markdown(rows, meta, args)
    print(text)
    write_results(args.out, "paired", now, text, {"meta": meta, "args": vars(args), "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
