"""FP8 training's loss bar, measured over seeds: `paratrain train --fp8` against bf16 alone, paired by seed.

    python benchmarks/bench_fp8_convergence.py              # 8 seeds x 100 steps of tiny, ~35 min on 2 quiet cores
    ATEN_CPU_CAPABILITY=default python benchmarks/bench_fp8_convergence.py   # on torch's plain CPU kernels
    python benchmarks/bench_fp8_convergence.py --seeds 2 --steps 2 --batch 2 --seq 32 --eval-batches 1 --n-layers 1 \
        --dim 64                                            # a dry run
    python benchmarks/bench_fp8_convergence.py --first-seed 8 --recipes tensorwise --include results/fp8-....json
                                                            # 8 more seeds of one recipe, reported with the earlier

The bar FP8 training is held to: a hundred steps of the tiny model with every block linear in FP8 end within 0.05
nats of bf16 alone, the metric being the mean of the last ten step losses. One run cannot show it: a run's last-ten mean moves
by as much as the bar when nothing but rounding changes (a different CPU kernel path moved bf16 alone by 0.046, and
one seed's FP8 difference went from +0.002 to +0.096 with it). So every seed trains bf16 and each recipe from the
same initialization and data order (`--seed`), the difference is taken per seed (recipe - bf16), and the bar is
held to the mean of those differences, with its spread: standard deviation, standard error, min and max, and the
95% interval mean +- 2 SE. A recipe passes when |mean difference| <= --bar.

The control recipe `bf16-accum2` is bf16 again with each step's batch in two micro-batches: the same samples, the
same loss, only the summation order of the gradients changes. Its differences are the trajectory noise a change of
rounding alone produces, the scale against which FP8's differences are read; bf16's own seed-to-seed spread is
reported too. Every run is `paratrain.cli.main` in this process, one rank, its output kept out of the way (one line
per run instead). Writes benchmarks/results/fp8-convergence-<time>.md and .json (every run's step losses kept, the
included runs too) with the machine, its load, the torch version and the CPU kernel path (ATEN_CPU_CAPABILITY when
set).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import doc_parser, fmt_load, machine, train_in_process, write_results

REFERENCE = "bf16"
CONTROL = "bf16-accum2"
RECIPES = ("tensorwise", "rowwise", CONTROL)


def recipe_args(recipe: str, batch: int) -> list[str]:
    """The trainer options of `recipe`'s run: the bf16 reference's, plus FP8 or a batch in two micro-batches."""
    micro = batch // 2 if recipe == CONTROL else batch
    fp8 = ["--fp8", recipe] if recipe not in (REFERENCE, CONTROL) else []
    return ["--global-batch", str(batch), "--micro-batch", str(micro), *fp8]


def model_args(args) -> list[str]:
    """The trainer's overrides of the named model's depth and width, where given (a dry run's smaller model)."""
    return [*(["--n-layers", str(args.n_layers)] if args.n_layers else []),
            *(["--dim", str(args.dim)] if args.dim else [])]


def train_once(recipe: str, seed: int, args, work: Path) -> dict:
    """One run of the trainer; its step losses, wall time and final eval loss. The trainer's own output is kept
    and shown only if the run fails."""
    out = work / f"{recipe}-seed{seed}"
    argv = ["train", "--model", args.model, "--precision", "bf16", "--steps", str(args.steps), "--seq-len",
            str(args.seq), "--sample-tokens", "0", "--eval-every", "0", "--eval-batches", str(args.eval_batches),
            "--no-progress", "--seed", str(seed), *model_args(args),
            *recipe_args(recipe, args.batch), "--out", str(out)]
    records, seconds = train_in_process(argv, out, f"{recipe} seed {seed}")
    losses = [r["loss"] for r in records]
    return {"recipe": recipe, "seed": seed, "seconds": seconds, "losses": losses,
            "last_mean": statistics.mean(losses[-args.last:]), "eval_loss": records[-1].get("eval_loss")}


def summarize(diffs: list[float], bar: float) -> dict:
    """Mean, spread and verdict of one recipe's per-seed differences."""
    n = len(diffs)
    mean = statistics.mean(diffs)
    std = statistics.stdev(diffs) if n > 1 else math.nan
    se = std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "se": se, "min": min(diffs), "max": max(diffs),
            "interval": [mean - 2 * se, mean + 2 * se], "pass": abs(mean) <= bar,
            "interval_inside_bar": abs(mean) + 2 * se <= bar}


def verdict(recipe: str, s: dict) -> str:
    if recipe == CONTROL:
        return "control"
    return "PASS" if s["pass"] else "FAIL"


def analyse(runs: list[dict], recipes: list[str], bar: float) -> dict:
    """Per seed, each recipe's difference from bf16 of the same seed; over the seeds a recipe ran, their summary."""
    by = {(r["recipe"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    reference = [by[REFERENCE, s]["last_mean"] for s in seeds]
    result = {"seeds": seeds, "reference": {
        "mean": statistics.mean(reference), "seed_std": statistics.stdev(reference) if len(seeds) > 1 else math.nan,
        "min": min(reference), "max": max(reference)}, "recipes": {}}
    for recipe in recipes:
        ran = [s for s in seeds if (recipe, s) in by]
        diffs = [by[recipe, s]["last_mean"] - by[REFERENCE, s]["last_mean"] for s in ran]
        summary = summarize(diffs, bar)
        summary["seeds"], summary["diffs"] = ran, diffs
        evals = [(by[recipe, s]["eval_loss"], by[REFERENCE, s]["eval_loss"]) for s in ran]
        if all(a is not None and b is not None for a, b in evals):
            summary["eval_diff_mean"] = statistics.mean(a - b for a, b in evals)
        summary["seconds_mean"] = statistics.mean(by[recipe, s]["seconds"] for s in ran)
        result["recipes"][recipe] = summary
    result["reference"]["seconds_mean"] = statistics.mean(by[REFERENCE, s]["seconds"] for s in seeds)
    return result


def report(meta: dict, args, runs: list[dict], result: dict) -> str:
    m, ref, recipes = meta["machine"], result["reference"], result["recipes"]
    last = min(args.last, args.steps)
    kernel = meta["aten_cpu_capability"] or "not set"
    lines = [f"# paratrain FP8 convergence, {meta['date']}", "",
             f"{m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}, Python {m['python']}; CPU kernel path "
             f"{meta['cpu_capability']} (ATEN_CPU_CAPABILITY {kernel}); load average {fmt_load(meta['load_avg_start'])}"
             f" at the start, {fmt_load(meta['load_avg_end'])} at the end; {meta['wall_s'] / 60:.1f} min in all.", "",
             f"Model {' '.join([args.model, *model_args(args)])}, {args.steps} steps of {args.batch} x {args.seq} "
             f"tokens, --precision bf16, seeds "
             f"{', '.join(map(str, result['seeds']))}. Metric: the mean of the last {last} step losses; "
             f"difference = recipe - bf16 of the same seed. Bar: |mean difference| <= {args.bar} nats.", "",
             *[f"With the runs of {inc['file']} (seeds {', '.join(map(str, inc['seeds']))}; {inc['date']}, "
               f"{inc['wall_s'] / 60:.1f} min; CPU kernel path {inc['cpu_capability']}, ATEN_CPU_CAPABILITY "
               f"{inc['aten_cpu_capability'] or 'not set'}): every difference is between runs of one seed, made on "
               f"one path." for inc in meta["included"]], *([""] if meta["included"] else []),
             "| recipe | n seeds | mean diff | std | SE | 95% interval (mean +- 2 SE) | min | max | verdict | "
             "interval inside the bar | mean eval-loss diff | s per run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for recipe, s in recipes.items():
        low, high = s["interval"]
        lines.append(f"| {recipe} | {s['n']} | {s['mean']:+.4f} | {s['std']:.4f} | {s['se']:.4f} | "
                     f"[{low:+.4f}, {high:+.4f}] | {s['min']:+.4f} | {s['max']:+.4f} | {verdict(recipe, s)} | "
                     f"{'yes' if s['interval_inside_bar'] else 'no'} | {s.get('eval_diff_mean', math.nan):+.4f} | "
                     f"{s['seconds_mean']:.1f} |")
    lines += ["", f"bf16 alone: last-{last} mean {ref['mean']:.4f} over seeds, seed-to-seed std "
                  f"{ref['seed_std']:.4f} (min {ref['min']:.4f}, max {ref['max']:.4f}); {ref['seconds_mean']:.1f} s "
                  f"per run.", "", f"`{CONTROL}` is bf16 with each batch in two micro-batches (only the gradients' "
                  "summation order changes): its spread is the noise of a run's trajectory, not a cost of FP8.", "",
              f"## Per seed (last-{last} mean; differences from bf16)", "",
              "| seed | bf16 | " + " | ".join(recipes) + " |", "| --- " * (len(recipes) + 2) + "|"]
    by = {(r["recipe"], r["seed"]): r for r in runs}
    for seed in result["seeds"]:
        ref_mean = by[REFERENCE, seed]["last_mean"]
        cells = [f"{by[recipe, seed]['last_mean']:.4f} ({by[recipe, seed]['last_mean'] - ref_mean:+.4f})"
                 if (recipe, seed) in by else "-" for recipe in recipes]
        lines.append(f"| {seed} | {by[REFERENCE, seed]['last_mean']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None):
    parser = doc_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=8, help="seeds run (first-seed, first-seed + 1, ...)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (one micro-batch; the control: two)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--last", type=int, default=10, help="the metric: the mean of this many last step losses")
    parser.add_argument("--bar", type=float, default=0.05, help="nats the mean difference may reach")
    parser.add_argument("--eval-batches", type=int, default=8,
                        help="held-out batches of the final evaluation (its loss is reported beside the metric)")
    parser.add_argument("--model", default="tiny", help="named model config")
    parser.add_argument("--n-layers", type=int, default=None, help="blocks of the model (default: the named config's)")
    parser.add_argument("--dim", type=int, default=None, help="hidden size of the model (default: the named config's)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES,
                        help="run beside bf16 for every seed")
    parser.add_argument("--include", nargs="+", default=[], metavar="JSON",
                        help="earlier results of this benchmark (same model, steps, batch, seq and torch) "
                             "whose runs join this one's: more seeds without running the first ones again; with "
                             "--seeds 0 only their joint report is written")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    args = parser.parse_args(argv)
    if args.seeds < (0 if args.include else 2):
        parser.error("--seeds: at least 2, for a spread (0 with --include: only the joint report)")
    if CONTROL in args.recipes and (args.batch < 2 or args.batch % 2):
        parser.error(f"--batch: an even number of at least 2 for {CONTROL} (or leave it out of --recipes)")
    return args


SAME = ("model", "n_layers", "dim", "steps", "batch", "seq")  # the settings runs must share to be compared


def included_runs(paths: list[str], args) -> tuple[list[dict], list[dict]]:
    """The runs of earlier results that join this invocation's (their metric recomputed with --last), and a line of
    facts on each file (with its torch, which `check_torch` compares with this run's); a file of other settings, or
    a run twice: one-line exit. The CPU kernel path may differ: a seed's runs are all made by one invocation, so
    every difference is taken between runs on one path (a path moves single runs, not the expected difference), and
    the report names each file's path."""
    runs, facts = [], []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            earlier, their_runs = data["meta"], data["runs"]
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"--include {path}: not a result of this benchmark ({exc})") from None
        for key in SAME:
            if earlier["args"].get(key) != getattr(args, key):  # (a file from before --n-layers/--dim: None)
                raise SystemExit(f"--include {path}: its --{key.replace('_', '-')} is {earlier['args'].get(key)}, "
                                 f"this run's {getattr(args, key)}; runs of other settings do not compare")
        for run in their_runs:
            if any((r["recipe"], r["seed"]) == (run["recipe"], run["seed"]) for r in runs):
                raise SystemExit(f"--include {path}: {run['recipe']} seed {run['seed']} is in an earlier --include "
                                 f"too (a result holds the runs it included: include the newest alone)")
            run["last_mean"] = statistics.mean(run["losses"][-args.last:])
        runs += their_runs
        facts.append({"file": Path(path).name, "date": earlier["date"], "wall_s": earlier["wall_s"],
                      "seeds": sorted({r["seed"] for r in their_runs}), "cpu_capability": earlier["cpu_capability"],
                      "aten_cpu_capability": earlier["aten_cpu_capability"], "torch": earlier["machine"]["torch"]})
    return runs, facts


def check_torch(paths: list[str], facts: list[dict], meta: dict) -> None:
    """An included file (`paths`, their `facts` in order) of another torch: one-line exit."""
    for path, fact in zip(paths, facts):
        if fact["torch"] != meta["machine"]["torch"]:
            raise SystemExit(f"--include {path}: torch {fact['torch']}, this run's {meta['machine']['torch']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    load_start = os.getloadavg()
    # What refuses the invocation comes before torch is imported: a refusal is a moment, not an import.
    runs, included = included_runs(args.include, args)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    twice = {(r["recipe"], r["seed"]) for r in runs} & {(name, s) for s in seeds for name in (REFERENCE, *args.recipes)}
    if twice:
        raise SystemExit(f"seed {min(twice)[1]} ran already in --include; start at a new --first-seed")
    import torch

    meta = {"date": now.isoformat(timespec="seconds"), "machine": machine(), "load_avg_start": load_start,
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "args": vars(args), "included": included}
    check_torch(args.include, included, meta)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for recipe in (REFERENCE, *args.recipes):
                run = train_once(recipe, seed, args, Path(tmp))
                runs.append(run)
                reference = run if recipe == REFERENCE else reference
                diff = "" if recipe == REFERENCE else f", {run['last_mean'] - reference['last_mean']:+.4f} from bf16"
                print(f"seed {seed} {recipe:>11}: last-{args.last} mean {run['last_mean']:.4f}{diff} "
                      f"({run['seconds']:.0f} s; {(time.perf_counter() - start) / 60:.1f} min so far)", flush=True)
    meta["wall_s"] = time.perf_counter() - start
    meta["load_avg_end"] = os.getloadavg()
    if not any(r["recipe"] == REFERENCE for r in runs):
        raise SystemExit("no bf16 runs to compare with")
    result = analyse(runs, [name for name in RECIPES if any(r["recipe"] == name for r in runs)], args.bar)
    text = report(meta, args, runs, result)
    print(text)
    write_results(args.out, "fp8-convergence", now, text, {"meta": meta, "result": result, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
