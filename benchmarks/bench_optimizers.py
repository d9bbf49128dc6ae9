"""Does Muon train faster than AdamW? Steps to AdamW's final eval loss, each optimizer at its own tuned learning rate.

    python benchmarks/bench_optimizers.py                      # sweep + 3 seeds, ~10 min on 2 quiet cores
    python benchmarks/bench_optimizers.py --seeds 1 --steps 4 --eval-every 2 --adamw-lrs 3e-3 --muon-lrs 0.02
                                                               # a dry run

`paratrain train` in this process, one rank, fp32, on the embedded corpus (the default data), a small model given by
its sizes. First a sweep (seed 0): AdamW at each of --adamw-lrs, Muon (`--optimizer muon`: Muon for the blocks'
matrices at --muon-lr, AdamW at AdamW's tuned --lr for the embeddings, head and norms) at each of --muon-lrs; each
optimizer's tuned learning rate is the one with the lowest final eval loss. Then --seeds seeds (the sweep's seed 0
counted) of each at its tuned rate. The target of a seed is AdamW's final eval loss with that seed; for each run the
first evaluated step (every --eval-every steps, on the same held-out batches) whose eval loss is at or below its
seed's target (AdamW's is at most its last step; Muon's is paired with it).
Reported: each optimizer's steps to the target and final eval loss, mean and spread over the seeds (std, min, max),
and Muon's steps as a fraction of AdamW's. The same seed gives both optimizers the same initialization and data
order. Writes benchmarks/results/optimizers-<time>.md and .json (every run's eval curve) with the machine and its
load: the step counts do not depend on the load; the seconds do.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import doc_parser, machine, machine_sentence, train_in_process, write_results

SIZES = ["--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "176"]


def train_once(optimizer: str, lr: float, seed: int, args, work: Path, adamw_lr: float | None = None) -> dict:
    """One run of the trainer: its eval curve [(step, eval loss)], step losses and wall time."""
    out = work / f"{optimizer}-{lr:g}-seed{seed}"
    rate = ["--lr", str(lr)] if optimizer == "adamw" else ["--optimizer", "muon", "--muon-lr", str(lr),
                                                            "--lr", str(adamw_lr)]
    argv = ["train", *SIZES, "--precision", "fp32", "--steps", str(args.steps), "--seq-len", str(args.seq),
            "--global-batch", str(args.batch), "--warmup-steps", str(args.warmup), "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches), "--sample-tokens", "0", "--no-progress", "--seed", str(seed),
            "--checkpoint-every", "0", *rate, "--out", str(out)]
    records, seconds = train_in_process(argv, out, f"{optimizer} lr {lr} seed {seed}")
    curve = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    print(f"{optimizer:5s} lr {lr:<6g} seed {seed}: eval {curve[-1][1]:.4f} at step {curve[-1][0]}, {seconds:.0f} s",
          flush=True)
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "seconds": seconds, "curve": curve,
            "losses": [r["loss"] for r in records], "final_eval": curve[-1][1]}


def steps_to(curve: list, target: float) -> int | None:
    """The first evaluated step whose eval loss is at or below `target` (None: never)."""
    return next((step for step, loss in curve if loss <= target), None)


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def run(args) -> tuple[dict, list[dict]]:
    work = Path(tempfile.mkdtemp(prefix="bench-optimizers-"))
    runs: list[dict] = []
    try:
        sweep = [train_once("adamw", lr, 0, args, work) for lr in args.adamw_lrs]
        adamw_lr = min(sweep, key=lambda r: r["final_eval"])["lr"]
        sweep += [train_once("muon", lr, 0, args, work, adamw_lr) for lr in args.muon_lrs]
        muon_lr = min((r for r in sweep if r["optimizer"] == "muon"), key=lambda r: r["final_eval"])["lr"]
        runs += sweep
        tuned = {"adamw": adamw_lr, "muon": muon_lr}
        for seed in range(1, args.seeds):
            runs += [train_once("adamw", adamw_lr, seed, args, work),
                     train_once("muon", muon_lr, seed, args, work, adamw_lr)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    chosen = {o: sorted((r for r in runs if r["optimizer"] == o and r["lr"] == tuned[o]), key=lambda r: r["seed"])
              for o in tuned}
    targets = {r["seed"]: r["final_eval"] for r in chosen["adamw"]}  # per seed: AdamW's own final eval loss
    result = {"tuned_lr": tuned, "targets": targets, "optimizers": {}}
    for name, picked in chosen.items():
        steps = [steps_to(r["curve"], targets[r["seed"]]) for r in picked]
        reached = [s for s in steps if s is not None]
        result["optimizers"][name] = {
            "seeds": [r["seed"] for r in picked], "steps_to_target": steps,
            "steps": spread(reached) if reached else None, "reached": len(reached),
            "final_eval": spread([r["final_eval"] for r in picked]),
            "seconds": spread([r["seconds"] for r in picked])}
    a, m = (result["optimizers"][o]["steps"] for o in ("adamw", "muon"))
    result["muon_over_adamw_steps"] = m["mean"] / a["mean"] if a and m else None
    return result, runs


def report(meta: dict, args, result: dict, runs: list[dict]) -> str:
    lines = [f"# paratrain optimizers: Muon against AdamW, {meta['date']}", "",
             machine_sentence(meta) + f" (the "
             f"machine shared with other jobs: seconds are noisy, step counts are not); {meta['wall_s'] / 60:.1f} min "
             "in all.", "",
             f"Model: {' '.join(SIZES)} (fp32) on the embedded corpus; {args.steps} steps of {args.batch} x {args.seq} "
             f"tokens, {args.warmup} warmup steps then cosine; eval every {args.eval_every} steps on "
             f"{args.eval_batches} held-out batches.", "",
             "## Sweep (seed 0): final eval loss", "", "| optimizer | lr | final eval loss |", "|---|---|---|"]
    lines += [f"| {r['optimizer']} | {r['lr']:g} | {r['final_eval']:.4f} |" for r in runs if r["seed"] == 0]
    lines += ["", f"Tuned: AdamW lr {result['tuned_lr']['adamw']:g}; Muon lr {result['tuned_lr']['muon']:g} (AdamW at "
              f"{result['tuned_lr']['adamw']:g} for the embeddings, head and norms).", "",
              "## Steps to AdamW's final eval loss (of the same seed: "
              f"{', '.join(f'{v:.4f}' for v in result['targets'].values())})", "",
              "| optimizer | seeds | steps to target, per seed | mean | std | min | max | final eval loss mean "
              "(std) | s per run |", "|---|---|---|---|---|---|---|---|---|"]
    for name, o in result["optimizers"].items():
        s = o["steps"] or {"mean": float("nan"), "std": float("nan"), "min": "-", "max": "-"}
        lines.append(f"| {name} | {len(o['seeds'])} | {', '.join('-' if x is None else str(x) for x in o['steps_to_target'])}"
                     f" | {s['mean']:.1f} | {s['std']:.1f} | {s['min']} | {s['max']} | {o['final_eval']['mean']:.4f} "
                     f"({o['final_eval']['std']:.4f}) | {o['seconds']['mean']:.0f} |")
    ratio = result["muon_over_adamw_steps"]
    lines += ["", f"Muon needs {ratio:.2f}x AdamW's steps to AdamW's final eval loss." if ratio else
              "", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = doc_parser(__doc__)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=10, help="warmup steps")
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of each optimizer at its tuned rate")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2], help="AdamW's sweep")
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.05], help="Muon's sweep")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="results folder")
    args = parser.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.isoformat(timespec="seconds"), "machine": machine(), "load_avg_start": os.getloadavg(),
            "command": "python benchmarks/bench_optimizers.py " + " ".join(os.sys.argv[1:])}
    start = time.perf_counter()
    result, runs = run(args)
    meta["wall_s"], meta["load_avg_end"] = time.perf_counter() - start, os.getloadavg()
    write_results(args.out, "optimizers", now, report(meta, args, result, runs),
                  {"meta": meta, "args": vars(args), "result": result, "runs": runs})


if __name__ == "__main__":
    main()
