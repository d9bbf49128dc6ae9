"""Checkpoint benchmark: save/load throughput per rank, loading into other layouts, the pause a save adds to a step.

    python benchmarks/bench_checkpoint.py                  # defaults: 87M-param Transformer (348 MB fp32) + AdamW state
    python benchmarks/bench_checkpoint.py --dim 256 --layers 2 --vocab 4096 --reps 1 --rounds 2 --block 2

Everything runs on 2 gloo ranks (CPU) through `paratrain.ranks.run_on_ranks`
and calls the storage layer directly (`save_checkpoint`, `AsyncCheckpointer`,
`CheckpointReader`) with shard dicts built here: every tensor of a training
checkpoint (fp32 weights `model/<name>` and AdamW's two moments
`optim/<name>/exp_avg`, `optim/<name>/exp_avg_sq`) split by rows as ZeRO splits
it (`paratrain.parallel.shard.row_range`). See benchmarks/README.md for what
each number means.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import fmt_load, machine, write_results
from paratrain.checkpoint import (
    AsyncCheckpointer, CheckpointReader, DistCoordinator, ShardSpec, save_checkpoint, verify_checkpoint,
)
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.data.shard import row_range
from paratrain.ranks import run_on_ranks

MB = 1e6  # throughput in decimal megabytes per second, as disks are rated
RANKS = 2


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_dim=args.ffn, max_seq_len=max(args.seq, 64))


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}


def checkpoint_names(name: str) -> list[str]:
    """The checkpoint tensors of one parameter: its weight and AdamW's two moments."""
    return [f"model/{name}", f"optim/{name}/exp_avg", f"optim/{name}/exp_avg_sq"]


def rows_box(shape: tuple[int, ...], n: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of `rank`'s rows of a tensor split over `n` ranks."""
    lo, hi = row_range(shape[0], n, rank)
    return (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:])


def random_shards(cfg: ModelConfig, rank: int, n: int) -> dict:
    """This rank's rows of every checkpoint tensor, filled with noise (no model is built)."""
    gen = torch.Generator().manual_seed(rank)
    shards = {}
    for name, shape in global_shapes(cfg).items():
        offset, local = rows_box(shape, n, rank)
        for key in checkpoint_names(name):
            shards[key] = (ShardSpec(key, shape, offset), torch.randn(local, generator=gen))
    return shards


def nbytes(shards: dict) -> int:
    return sum(t.numel() * t.element_size() for _, t in shards.values())


def evict(path: str) -> None:
    """Drop the checkpoint's files from this machine's page cache (clean pages; the data stays on disk)."""
    for entry in os.scandir(path):
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_boxes(path: str, boxes: list[tuple[str, tuple, tuple]]) -> tuple[float, int, list[torch.Tensor]]:
    """Open the checkpoint (no verification) and read `boxes` (name, offset, shape); (seconds, bytes, tensors)."""
    start = time.perf_counter()
    reader = CheckpointReader(path, verify=False)
    out = [reader.read(name, offset, shape) for name, offset, shape in boxes]
    seconds = time.perf_counter() - start
    reader.close()
    return seconds, sum(t.numel() * t.element_size() for t in out), out


def layout_boxes(cfg: ModelConfig, n: int, rank: int) -> list[tuple[str, tuple, tuple]]:
    return [(key, *rows_box(shape, n, rank)) for name, shape in global_shapes(cfg).items()
            for key in checkpoint_names(name)]


# ---- phase 1: save, load in the same layout, load into dp4 (on the 2 processes) ----


def bench_save_load(rank: int, world: int, root: str, cfg: ModelConfig, reps: int) -> dict:
    coordinator = DistCoordinator()
    shards = random_shards(cfg, rank, world)
    saves, path = [], None
    for step in range(1, reps + 1):
        dist.barrier()
        start = time.perf_counter()
        path = str(save_checkpoint(root, step, shards, shared_state={"step": step}, coordinator=coordinator,
                                   keep_latest=1))
        saves.append(time.perf_counter() - start)
    result = {"bytes": nbytes(shards), "save_s": saves, "path": path, "load_cold_s": [], "load_warm_s": []}
    boxes = layout_boxes(cfg, world, rank)
    for rep in range(reps):
        for mode in ("cold", "warm"):
            if mode == "cold" and rank == 0:
                evict(path)
            dist.barrier()
            seconds, _, tensors = read_boxes(path, boxes)
            result[f"load_{mode}_s"].append(seconds)
            if rep == 0 and mode == "cold":
                assert all(torch.equal(t, s) for t, (_, s) in zip(tensors, shards.values())), "read back differs"
            del tensors  # the next read allocates afresh, as a real load does
    dist.barrier()
    if rank == 0:
        start = time.perf_counter()
        verify_checkpoint(path, checksums=True)
        result["verify_s"] = time.perf_counter() - start
    # Four readers on two processes: each process plays two ranks of dp4, one after the other.
    result["dp4"] = {v: {"bytes": 0, "load_cold_s": [], "load_warm_s": []} for v in (2 * rank, 2 * rank + 1)}
    for _ in range(reps):
        for mode in ("cold", "warm"):
            if mode == "cold" and rank == 0:
                evict(path)
            dist.barrier()
            for virtual, timings in result["dp4"].items():
                seconds, timings["bytes"], _ = read_boxes(path, layout_boxes(cfg, 4, virtual))
                timings[f"load_{mode}_s"].append(seconds)
    return result


def bench_load_whole(rank: int, world: int, path: str, cfg: ModelConfig, reps: int) -> dict:
    """dp1: one process reads every tensor whole."""
    out = {"load_cold_s": [], "load_warm_s": []}
    for _ in range(reps):
        evict(path)
        seconds, out["bytes"], _ = read_boxes(path, layout_boxes(cfg, 1, 0))
        out["load_cold_s"].append(seconds)
        out["load_warm_s"].append(read_boxes(path, layout_boxes(cfg, 1, 0))[0])
    return out


# ---- phase 2: the pause a save adds to training steps ----


def training_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> dict:
    """This rank's rows of the live weights and AdamW moments (views: the save copies or writes them)."""
    shards = {}
    for name, p in model.named_parameters():
        offset, local = rows_box(tuple(p.shape), world, rank)
        state = optimizer.state[p]
        for key, value in zip(checkpoint_names(name), (p, state["exp_avg"], state["exp_avg_sq"])):
            rows = value.detach()[offset[0]:offset[0] + local[0]]
            shards[key] = (ShardSpec(key, tuple(p.shape), offset), rows)
    return shards


MODES = ("none", "sync", "async")


def bench_pause(rank: int, world: int, root: str, cfg: ModelConfig, rounds: int, block: int, seq: int,
                micro_batch: int) -> dict:
    """Rounds of three blocks of `block` steps: no save, a synchronous save, an asynchronous one.

    A block with a save saves after its first step; the asynchronous block waits for its save
    at the end of its last step, so each block carries all the cost of its save and the
    blocks of one round (run back to back) can be compared whatever the machine's load.
    """
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(rank))

    def train_step():
        logits = model(data[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def save(mode: str, step: int) -> None:
        shards = training_shards(model, optimizer, rank, world)
        if mode == "sync":
            save_checkpoint(os.path.join(root, "sync"), step, shards, coordinator=coordinator, keep_latest=1)
        else:
            saver.save(step, shards)

    train_step()  # creates AdamW's state
    coordinator = DistCoordinator()
    saver = AsyncCheckpointer(os.path.join(root, "async"), keep_latest=1)  # collective: its own gloo group
    out = {"bytes": nbytes(training_shards(model, optimizer, rank, world)),
           **{mode: {"step_s": [], "block_s": [], "pause_s": [], "drain_s": []} for mode in MODES}}
    for r in range(rounds):
        for mode in MODES:
            times = []
            for i in range(block):
                dist.barrier()
                start = time.perf_counter()
                train_step()
                if mode != "none" and i == 0:
                    t0 = time.perf_counter()
                    save(mode, r + 1)
                    out[mode]["pause_s"].append(time.perf_counter() - t0)
                if mode == "async" and i == block - 1:
                    t0 = time.perf_counter()
                    saver.wait()
                    out[mode]["drain_s"].append(time.perf_counter() - t0)
                # The step ends at a collective, as a data-parallel step does: a rank still saving holds the others.
                dist.barrier()
                times.append(time.perf_counter() - start)
            out[mode]["step_s"] += times
            out[mode]["block_s"].append(sum(times))
    saver.close()
    return out


# ---- report ----


def summarize(save_load: list[dict], whole: dict, pause: list[dict], meta: dict) -> dict:
    r0 = save_load[0]
    per_rank = [r["bytes"] / MB for r in save_load]
    saves = [statistics.median(r["save_s"]) for r in save_load]
    summary = {
        "checkpoint_mb": sum(per_rank), "per_rank_mb": per_rank,
        "save_s_median": saves, "save_s_all": [r["save_s"] for r in save_load],
        "save_mb_s": [mb / s for mb, s in zip(per_rank, saves)],
        "load_cold_mb_s": [r["bytes"] / MB / statistics.median(r["load_cold_s"]) for r in save_load],
        "load_warm_mb_s": [r["bytes"] / MB / statistics.median(r["load_warm_s"]) for r in save_load],
        "verify_s": r0.get("verify_s"),
        "dp1": {"mb": whole["bytes"] / MB, "cold_mb_s": whole["bytes"] / MB / statistics.median(whole["load_cold_s"]),
                "warm_mb_s": whole["bytes"] / MB / statistics.median(whole["load_warm_s"])},
        "dp4": [{"virtual_rank": v, "mb": t["bytes"] / MB,
                 "cold_mb_s": t["bytes"] / MB / statistics.median(t["load_cold_s"]),
                 "warm_mb_s": t["bytes"] / MB / statistics.median(t["load_warm_s"])}
                for r in save_load for v, t in r["dp4"].items()],
    }
    modes = {}
    for mode in MODES:
        # Rank 0's clock: it commits, so it waits longest, and the barriers make the step times common.
        m = pause[0][mode]
        added = [b - n for b, n in zip(m["block_s"], pause[0]["none"]["block_s"])]
        modes[mode] = {
            "step_s_median": statistics.median(m["step_s"]), "saves": len(m["pause_s"]),
            "pause_s": m["pause_s"],
            "pause_s_max_over_ranks": max(max(p[mode]["pause_s"], default=0.0) for p in pause),
            "drain_s": m["drain_s"], "added_per_save_s": added,
        }
    summary["pause"] = {"per_rank_mb": pause[0]["bytes"] / MB, **modes}
    return summary


def markdown(s: dict, meta: dict) -> str:
    mmm = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"  # noqa: E731
    lines = [
        f"# Checkpoint save/load benchmark — {meta['date']}",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['cpu_model']}, {meta['cpu_count']} cores, {meta['ram_gb']:.0f} GB RAM, {meta['platform']}, "
        f"torch {meta['torch']}, Python {meta['python']}",
        f"- checkpoint directory: `{meta['root']}` on {meta['filesystem']}",
        f"- load average (1/5/15 min): start {fmt_load(meta['load_avg_start'])}, end {fmt_load(meta['load_avg_end'])}"
        f" (at the start of each phase: {', '.join(f'{k} {fmt_load(v)}' for k, v in meta['load_avg_phases'].items())})"
        f" — the 2 cores are shared with other jobs, so every time here is noisy",
        f"- model: {meta['model']} — {meta['params']:,} parameters, {meta['params'] * 4 / MB:.0f} MB fp32; "
        f"checkpoint = weights + AdamW's 2 moments = {s['checkpoint_mb']:.0f} MB, split by rows over {RANKS} ranks",
        "",
        "## Save and load, same layout (dp2 → dp2)",
        "",
        "| rank | MB | save s median (min–max) | save MB/s | load cold MB/s (median) | load warm MB/s (median) |",
        "|---|---|---|---|---|---|",
    ]
    for r in range(RANKS):
        lines.append(f"| {r} | {s['per_rank_mb'][r]:.0f} | {mmm(s['save_s_all'][r])} | {s['save_mb_s'][r]:.0f} | "
                     f"{s['load_cold_mb_s'][r]:.0f} | {s['load_warm_mb_s'][r]:.0f} |")
    lines += ["", f"Full verification (size + sha256 of every file, {s['checkpoint_mb']:.0f} MB) on rank 0: "
                  f"{s['verify_s']:.2f} s ({s['checkpoint_mb'] / s['verify_s']:.0f} MB/s).", "",
              "## Loading into other layouts (saved by dp2)", "",
              "| layout | reader | MB read | load cold MB/s (median) | load warm MB/s (median) |",
              "|---|---|---|---|---|",
              f"| dp1 | the only process | {s['dp1']['mb']:.0f} | {s['dp1']['cold_mb_s']:.0f} | "
              f"{s['dp1']['warm_mb_s']:.0f} |"]
    for r in range(RANKS):
        lines.append(f"| dp2 | rank {r} | {s['per_rank_mb'][r]:.0f} | {s['load_cold_mb_s'][r]:.0f} | "
                     f"{s['load_warm_mb_s'][r]:.0f} |")
    for v in s["dp4"]:
        lines.append(f"| dp4 | rank {v['virtual_rank']} (process {v['virtual_rank'] // 2}) | {v['mb']:.0f} | "
                     f"{v['cold_mb_s']:.0f} | {v['warm_mb_s']:.0f} |")
    p = s["pause"]
    lines += ["", "## The pause a save adds to training", "",
              f"Each rank trains the whole model (micro-batch {meta['micro_batch']} × {meta['seq']} tokens, AdamW); "
              f"every step ends at a barrier, as a data-parallel step ends at its all-reduce. {meta['rounds']} rounds "
              f"of three blocks of {meta['block']} steps: no save; a `save_checkpoint` after the first step; an "
              f"`AsyncCheckpointer.save` after the first step and its `wait()` at the end of the block. A save "
              f"holds this rank's rows of the weights and moments ({p['per_rank_mb']:.0f} MB per rank). "
              f"Times are rank 0's, median (min–max) over the rounds.", "",
              "| mode | step s | on the training thread per save, s (rank 0; max over ranks) | "
              "waited at block end, s | added per save, s (block − no-save block of the same round) |",
              "|---|---|---|---|---|"]
    for mode, label in (("none", "no save"), ("sync", "save_checkpoint"), ("async", "AsyncCheckpointer")):
        m = p[mode]
        on_thread = f"{mmm(m['pause_s'])}; {m['pause_s_max_over_ranks']:.2f}" if m["pause_s"] else "—"
        lines.append(f"| {label} | {m['step_s_median']:.2f} | {on_thread} | "
                     f"{mmm(m['drain_s']) if m['drain_s'] else '—'} | "
                     f"{mmm(m['added_per_save_s']) if mode != 'none' else '—'} |")
    return "\n".join(lines) + "\n"



def filesystem(path: str) -> str:
    best, fs = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, kind = line.split()[:3]
            if path.startswith(mount) and len(mount) > len(best):
                best, fs = mount, f"{kind} ({device} mounted at {mount})"
    return fs


def parse_args(argv=None):
    intro, _examples, rest = __doc__.split("\n\n", 2)
    p = argparse.ArgumentParser(description=intro, epilog=rest,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dim", type=int, default=768, help="model width")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--heads", type=int, default=12, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    p.add_argument("--ffn", type=int, default=2048, help="SwiGLU hidden width")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--reps", type=int, default=5, help="saves timed in the save/load phase")
    p.add_argument("--rounds", type=int, default=6, help="rounds of the pause phase (one save per mode each)")
    p.add_argument("--block", type=int, default=3, help="training steps per block of the pause phase")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence of a training step")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per training step")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a new temporary directory)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launch")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for checkpoint-<time>.md and .json")
    args = p.parse_args(argv)
    if min(args.reps, args.rounds, args.block) < 1:
        p.error("--reps, --rounds and --block must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    cfg = model_config(args)
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    meta = {"date": now.isoformat(timespec="seconds"), **machine(),
            "ram_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "model": repr(cfg),
            "params": cfg.num_params(), "root": root, "filesystem": filesystem(os.path.realpath(root)),
            "load_avg_start": os.getloadavg(), **{k: getattr(args, k) for k in
                                                   ("reps", "rounds", "block", "seq", "micro_batch")}}
    try:
        meta["load_avg_phases"] = {"save_load": os.getloadavg()}
        print("save / load (2 ranks)...", file=sys.stderr)
        save_load = run_on_ranks(bench_save_load, RANKS, os.path.join(root, "save"), cfg, args.reps,
                                 timeout=args.timeout)
        meta["load_avg_phases"]["load_whole"] = os.getloadavg()
        print("load whole (1 process)...", file=sys.stderr)
        whole = run_on_ranks(bench_load_whole, 1, save_load[0]["path"], cfg, args.reps, timeout=args.timeout)[0]
        shutil.rmtree(os.path.join(root, "save"))
        meta["load_avg_phases"]["pause"] = os.getloadavg()
        print("pause (2 ranks)...", file=sys.stderr)
        pause = run_on_ranks(bench_pause, RANKS, os.path.join(root, "pause"), cfg, args.rounds, args.block,
                             args.seq, args.micro_batch, timeout=args.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta["load_avg_end"] = os.getloadavg()
    summary = summarize(save_load, whole, pause, meta)
    text = markdown(summary, meta)
    print(text)
    write_results(args.out, "checkpoint", now, text, {"meta": meta, "args": vars(args), "summary": summary,
                                                       "raw": {"save_load": save_load, "load_whole": whole,
                                                               "pause": pause}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
