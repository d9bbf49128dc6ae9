"""Per-step overhead: many small parameters, negligible compute, paratrain against PyTorch, one invocation.

A model of 96 blocks × 4 Linear(64, 64) (384 weights, 768 parameters), batch 4 per rank, 2 ranks:
compute is a few hundred microseconds, so the step time is the framework's own cost per parameter
(hooks, Python loops, small kernels, syncs) and per collective. Pairs, run back to back, each in
its own launch, two rounds alternating which runs first:

    ddp    paratrain DDP                 torch DDP
    zero1  paratrain ZeRO-1              torch ZeroRedundancyOptimizer + DDP
    zero2  paratrain ZeRO-2              torch FSDP2, reshard_after_forward=False
    zero3  paratrain ZeRO-3              torch FSDP2
    tp     paratrain TensorParallel      torch parallelize_module (Colwise / Rowwise)
    pp     paratrain PipelineParallel    torch.distributed.pipelining Schedule1F1B
           (1f1b, 4 micro-batches)

    python benchmarks/bench_overhead.py [--pairs ddp zero3 ...] [--steps 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from bench_dp import PAIRS, setup_paratrain, setup_pytorch  # noqa: E402
from common import fmt_load, machine, write_results  # noqa: E402
from paratrain.mesh import MeshShape, build_mesh  # noqa: E402
from paratrain.parallel.api import PipelineParallel, TensorParallel, parallelize  # noqa: E402
from paratrain.parallel.tensor import Colwise, Rowwise  # noqa: E402
from paratrain.ranks import RankError, run_on_ranks  # noqa: E402

WIDTH = 64


def build(blocks: int, seed: int) -> nn.Sequential:
    """Blocks of Linear, ReLU, Linear, Linear, ReLU, Linear: two column/row pairs for tensor parallelism."""
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
                           for _ in range(blocks)))


def batch(step: int, rank: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000003 + step * 101 + rank)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def mse_sum(out, target):
    return F.mse_loss(out.float(), target, reduction="sum")


# -- one implementation: a step function ------------------------------------------------------------

def data_parallel(kind: str, framework: str, world: int, args):
    spec = PAIRS[kind][0 if framework == "paratrain" else 1]
    model = build(args.blocks, args.seed)
    run = (setup_paratrain if framework == "paratrain" else setup_pytorch)(model, spec, world, args)

    def step(x, y):
        loss = mse_sum(run.model(x), y) / x.numel()
        loss.backward()
        run.clip(1.0)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    return step, run.close


def tensor_parallel(framework: str, world: int, args):
    model = build(args.blocks, args.seed)
    adamw = functools.partial(torch.optim.AdamW, lr=args.lr)
    if framework == "paratrain":
        plan = {"*.0": Colwise(), "*.2": Rowwise(), "*.3": Colwise(), "*.5": Rowwise()}
        pmodel, opt = parallelize(model, build_mesh(MeshShape(tp=world)), optimizer=adamw,
                                  tensor=TensorParallel(plan=plan))
        clip = pmodel.clip_grad_norm_
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        plan = {f"{i}.{j}": style for i in range(args.blocks)
                for j, style in ((0, ColwiseParallel()), (2, RowwiseParallel()), (3, ColwiseParallel()),
                                 (5, RowwiseParallel()))}
        pmodel = parallelize_module(model, mesh, plan)
        opt = adamw(pmodel.parameters())
        clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(pmodel.parameters()))

    def step(x, y):  # every tp rank sees the same batch
        loss = mse_sum(pmodel(x), y) / x.numel()
        loss.backward()
        clip(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, lambda: None


def pipeline_parallel(framework: str, world: int, args):
    model = build(args.blocks, args.seed)
    adamw = functools.partial(torch.optim.AdamW, lr=args.lr)
    m = args.microbatches
    if framework == "paratrain":
        pmodel, opt = parallelize(model, build_mesh(MeshShape(pp=world)), optimizer=adamw,
                                  pipeline=PipelineParallel(schedule="1f1b"))

        def step(x, y):
            rows = x.shape[0] // m
            micro = [(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]) for i in range(m)]
            pmodel.train_step(micro, torch.tensor(float(x.numel())), mse_sum)
            pmodel.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, lambda: None
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, per = dist.get_rank(), args.blocks // world
    part = nn.Sequential(*list(model.children())[rank * per:(rank + 1) * per])
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    opt = adamw(part.parameters())
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: mse_sum(out, target) / (out.numel() * m))

    def norm_clip():  # the global norm over both stages, as a whole-model clip would compute it
        sq = torch.stack([p.grad.pow(2).sum() for p in part.parameters() if p.grad is not None]).sum()
        dist.all_reduce(sq)
        coef = (1.0 / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in part.parameters() if p.grad is not None], coef)

    def step(x, y):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        norm_clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, lambda: None


def bench_rank(rank: int, world: int, pair: str, framework: str, args) -> dict:
    torch.set_num_threads(1)
    if pair == "tp":
        step, close = tensor_parallel(framework, world, args)
    elif pair == "pp":
        step, close = pipeline_parallel(framework, world, args)
    else:
        step, close = data_parallel(pair, framework, world, args)
    rows = args.rows * (args.microbatches if pair == "pp" else 1)
    times = []
    for i in range(args.warmup + args.steps):
        x, y = batch(i, 0 if pair in ("tp", "pp") else rank, rows, args.seed)
        dist.barrier()
        start = time.perf_counter()
        step(x, y)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    close()
    return {"times": times}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pairs", nargs="+", default=["ddp", "zero1", "zero2", "zero3", "tp", "pp"],
                   choices=["ddp", "zero1", "zero2", "zero3", "tp", "pp"], help="pairs to run")
    p.add_argument("--ranks", type=int, default=2, help="processes per launch")
    p.add_argument("--blocks", type=int, default=96, help="blocks of 4 Linear(64, 64)")
    p.add_argument("--rows", type=int, default=4, help="batch rows per rank (per micro-batch for pp)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every pair, sides alternating")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (data-parallel pairs)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size of DDP and ZeRO-1/2")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per launch")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.isoformat(timespec="seconds"), **machine(), "args": vars(args)}
    import os
    load_start = os.getloadavg()
    medians: dict[tuple[str, str], list[float]] = {}
    errors: dict[tuple[str, str], str] = {}
    for round_ in range(args.rounds):
        for pair in args.pairs:
            sides = ["paratrain", "pytorch"] if round_ % 2 == 0 else ["pytorch", "paratrain"]
            for framework in sides:
                print(f"  round {round_ + 1}: {pair} {framework} ...", file=sys.stderr, flush=True)
                try:
                    result = run_on_ranks(bench_rank, args.ranks, pair, framework, args, timeout=args.timeout)
                except RankError as exc:
                    errors[pair, framework] = str(exc).splitlines()[0]
                    continue
                slowest = [max(ts) for ts in zip(*(r["times"] for r in result))]
                medians.setdefault((pair, framework), []).append(statistics.median(slowest))
    meta["load"] = {"start": load_start, "end": os.getloadavg()}
    lines = [f"# Per-step overhead, {args.blocks} blocks × 4 Linear({WIDTH}, {WIDTH}), {args.ranks} ranks "
             f"({meta['date']})", "", f"Machine: {meta.get('platform', '')}, {meta.get('cpu_count')} CPUs, torch {meta.get('torch')}; load average "
             f"{fmt_load(load_start)} at start, {fmt_load(meta['load']['end'])} at the end.",
             "Median step time of the slowest rank per launch, in ms, one value per round; ratio: paratrain's "
             "median over rounds / PyTorch's.", "",
             "| pair | paratrain ms (rounds) | PyTorch ms (rounds) | ratio |", "|---|---|---|---|"]
    for pair in args.pairs:
        ours, theirs = medians.get((pair, "paratrain")), medians.get((pair, "pytorch"))
        if not ours or not theirs:
            why = errors.get((pair, "paratrain")) or errors.get((pair, "pytorch")) or "no result"
            lines.append(f"| {pair} | — | — | failed: {why} |")
            continue
        ratio = statistics.median(ours) / statistics.median(theirs)
        lines.append(f"| {pair} | {' / '.join(f'{t * 1e3:.1f}' for t in ours)} | "
                     f"{' / '.join(f'{t * 1e3:.1f}' for t in theirs)} | **{ratio:.2f}** |")
    text = "\n".join(lines) + "\n"
    print(text)
    payload = {"meta": meta, "medians_s": {f"{p}/{f}": v for (p, f), v in medians.items()},
               "errors": {f"{p}/{f}": v for (p, f), v in errors.items()}}
    write_results(args.out, "overhead", now, text, payload)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
