"""`paratrain report`: figures and a text summary of one or more run directories.

    paratrain report runs/a                      # figures into runs/a/report/
    paratrain report runs/a runs/b --out cmp/    # runs overlaid on the same axes

Each run directory holds `config.json` and `metrics.jsonl` as `paratrain train`
writes them. The figures (PNG):

- `loss.png`: training loss (and evaluation loss where measured) against
  steps and against tokens seen;
- `throughput.png`: tokens per second and model FLOPs utilisation per step;
- `memory.png`: peak memory of every rank, and a breakdown by kind when the
  metrics carry one (`resident_bytes`: {kind: bytes});
- `comm.png`: bytes sent per step on each mesh axis, marked with what
  `paratrain plan` estimates for the same model and layout;
- `pipeline-<run>.png`: the pipeline schedule's timeline, for runs with pp > 1,
  drawn by the pipeline simulator.

The summary puts the planner's predicted step time and its breakdown (compute, exposed
communication per axis, pipeline bubble, optimizer) next to the measured medians of
`time_breakdown_s`, with a hardware profile: `--hardware NAME_OR_FILE`, else the profile
`paratrain plan --calibrate` wrote (`paratrain.plan.DEFAULT_PROFILE`) if there is one.

Every run is labelled with its directory name and its layout (`dp2,zero3`; hybrid sharding
writes the data axis as replicas × shard group, `dp4(2×2),zero3`).
Bad input raises `ReportError` (a ValueError) with one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from paratrain.commands.report_plan import format_prediction, median_or_none, planned_comm
from paratrain.errors import ParatrainError

MB = 10**6
# Per-kind memory breakdown a run may log (ParallelModel.resident_bytes); "total" is their sum.
BREAKDOWN_KEY = "resident_bytes"
KIND_ORDER = ("params", "grads", "master", "optimizer")  # bottom to top of the stacked bars


class ReportError(ParatrainError, ValueError):
    """A run directory cannot be reported on; the message names it and says why."""


@dataclass
class Run:
    """One run directory: its name, resolved configuration and per-step records."""

    path: Path
    name: str
    config: dict
    records: list[dict]
    layout: str = ""
    dp: int = 1
    color: str = "C0"
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.layout})" if self.layout else self.name

    def series(self, key: str, x: str = "step") -> tuple[list, list]:
        """(x values, values) of the records that carry `key`."""
        rows = [r for r in self.records if r.get(key) is not None and r.get(x) is not None]
        return [r[x] for r in rows], [r[key] for r in rows]


def load_run(path: str | Path) -> Run:
    """Read a run directory's config.json and metrics.jsonl; raise ReportError if unusable."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"run directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ReportError(f"{str(path)!r} is not a run directory (expected a directory holding metrics.jsonl)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{path} has no metrics.jsonl; is it the --out directory of `paratrain train`?")
    records = _read_records(metrics)
    if not records:
        raise ReportError(f"{metrics} is empty: the run has not finished a step yet")
    config = _read_config(path / "config.json")
    dp = data_ranks(config, records)
    return Run(path=path, name=path.resolve().name, config=config, records=records,
               layout=layout_of(config, dp), dp=dp)


def _read_records(metrics: Path) -> list[dict]:
    records = []
    lines = metrics.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # a run killed mid-write leaves a partial last line
                break
            raise ReportError(f"{metrics}, line {number}: not valid JSON") from None
    return records


def _read_config(path: Path) -> dict:
    if not path.is_file():  # figures need only the metrics; the layout label then stays short
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise ReportError(f"{path}: not valid JSON") from None


def data_ranks(config: dict, records: list[dict]) -> int:
    """The data-parallel degree: `parallel.dp`, or (dp 0: what tp × cp × pp leave) one per peak-memory entry."""
    parallel = config.get("parallel", {})
    if parallel.get("dp"):
        return parallel["dp"]
    ranks = records[0].get("peak_mem_bytes_per_rank")  # gathered over the dp axis
    if ranks:
        return len(ranks)
    tp_cp_pp = (parallel.get("tp") or 1) * (parallel.get("cp") or 1) * (parallel.get("pp") or 1)
    return max(1, config.get("run", {}).get("nproc", 1) // tp_cp_pp)


def layout_of(config: dict, dp: int) -> str:
    """The run's layout in `paratrain verify`'s notation (e.g. 'dp2,zero3,bf16'; under hybrid sharding
    'dp4,shard2,zero3': ZeRO over groups of 2 data ranks, in 2 replicas)."""
    from paratrain.verify import format_layout

    return format_layout({**config.get("parallel", {}), "dp": dp})


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Load several runs; runs sharing a directory name are told apart by their parent directory."""
    runs = [load_run(path) for path in paths]
    names = [run.name for run in runs]
    for i, run in enumerate(runs):
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
        run.color = f"C{i % 10}"
    return runs


# -- summary -------------------------------------------------------------------------------


def run_summary(run: Run) -> dict:
    """The numbers of one run the text summary prints (None where the metrics lack them)."""
    _, losses = run.series("loss")
    eval_steps, eval_losses = run.series("eval_loss")
    peaks = [max(r.get("peak_mem_bytes_per_rank") or [r.get("peak_mem_bytes") or 0]) for r in run.records]
    axes = sorted({axis for r in run.records for axis in (r.get("comm_bytes") or {})})
    comm = {axis: median_or_none([(r.get("comm_bytes") or {}).get(axis, 0) for r in run.records]) for axis in axes}
    return {
        "steps": len(run.records),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "eval_loss": eval_losses[-1] if eval_losses else None,
        "eval_step": eval_steps[-1] if eval_steps else None,
        "tokens_per_s": median_or_none(run.series("tokens_per_s")[1]),
        "mfu": median_or_none(run.series("mfu")[1]),
        "peak_mem_bytes": max(peaks) if any(peaks) else None,
        "comm_bytes_per_step": comm,
    }


def looking_inside(path: Path) -> list[str]:
    """The run's profiler traces (--profile-steps) and memory snapshots (--memory-snapshot), one line each kind."""
    from paratrain.run.rundir import MEMORY_DIR, PROFILE_DIR

    lines = []
    for kind, folder, pattern in (("profiler traces (Perfetto)", PROFILE_DIR, "*.json.gz"),
                                  ("memory snapshots (pytorch.org/memory_viz)", MEMORY_DIR, "*.pickle")):
        found = sorted((path / folder).glob(pattern))
        if found:
            lines.append(f"  {kind}: {', '.join(str(p) for p in found)}")
    return lines


NO_PROFILE = ("  predicted step time: needs a hardware profile; run `paratrain plan --calibrate` on the machine "
              "that ran it, or give --hardware NAME_OR_FILE")


def format_summary(runs: list[Run], hardware=None) -> str:
    """One paragraph per run: steps, losses, median throughput, peak memory, communication, predicted step time."""
    blocks = []
    for run in runs:
        s = run_summary(run)
        loss = "loss n/a" if s["first_loss"] is None else f"loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}"
        evals = "no eval" if s["eval_loss"] is None else f"eval loss {s['eval_loss']:.4f} (step {s['eval_step']})"
        speed = "n/a" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
        mfu = "" if s["mfu"] is None else f", MFU {s['mfu']:.2%}"
        peak = "n/a" if s["peak_mem_bytes"] is None else f"{s['peak_mem_bytes'] / MB:,.0f} MB"
        planned = planned_comm(run) or {}
        comm = ", ".join(f"{axis} {value / MB:,.2f}" + (f" (plan {planned[axis] / MB:,.2f})" if planned.get(axis)
                                                        else "") for axis, value in s["comm_bytes_per_step"].items())
        lines = [f"{run.label}: {s['steps']} steps, {loss}, {evals}",
                 f"  median {speed} tokens/s{mfu}; peak memory {peak} (largest rank); "
                 f"comm MB/step: {comm or 'none (one process)'}"]
        lines += format_prediction(run, hardware) if hardware is not None else [NO_PROFILE]
        lines += looking_inside(run.path)
        lines += [f"  note: {note}" for note in run.notes]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


# -- figures -------------------------------------------------------------------------------


def _figure(ncols: int, title: str):
    from matplotlib.figure import Figure  # lazily: plotting is optional for the rest of paratrain

    fig = Figure(figsize=(6.2 * ncols, 4.4), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    fig.suptitle(title)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def loss_figure(runs: list[Run]):
    """Training (solid) and evaluation (dashed) loss against steps and against tokens seen."""
    from matplotlib.ticker import EngFormatter

    fig, (by_step, by_tokens) = _figure(2, "Loss")
    for i, run in enumerate(runs):
        # Later runs are drawn thinner, so runs with identical losses stay visible on top of each other.
        width = max(1.0, 3.0 - 0.8 * i)
        for ax, x in ((by_step, "step"), (by_tokens, "tokens_seen")):
            ax.plot(*run.series("loss", x), color=run.color, linewidth=width, label=f"{run.label} train")
            xs, ys = run.series("eval_loss", x)
            if xs:
                ax.plot(xs, ys, color=run.color, linestyle="--", marker="o", label=f"{run.label} eval")
            # Each named held-out set (a mixture's sources, --eval-data) as its own dotted line.
            rows = [r for r in run.records if r.get("eval_losses") and r.get(x) is not None]
            for name, marker in zip(sorted({n for r in rows for n in r["eval_losses"]}), "sv^<>Dph"):
                named = [(r[x], r["eval_losses"][name]) for r in rows if name in r["eval_losses"]]
                ax.plot(*zip(*named), color=run.color, linestyle=":", marker=marker, label=f"{run.label} eval {name}")
    by_step.set(xlabel="step", ylabel="loss (nats per token)")
    by_tokens.set(xlabel="tokens seen", ylabel="loss (nats per token)")
    by_tokens.xaxis.set_major_formatter(EngFormatter(sep=""))
    by_step.legend(fontsize="small")
    return fig


def throughput_figure(runs: list[Run]):
    """Tokens per second over all ranks, and MFU, per step."""
    fig, (speed, util) = _figure(2, "Throughput")
    for run in runs:
        speed.plot(*run.series("tokens_per_s"), color=run.color, marker=".", label=run.label)
        steps, mfu = run.series("mfu")
        if steps:
            util.plot(steps, [100 * m for m in mfu], color=run.color, marker=".", label=run.label)
    speed.set(xlabel="step", ylabel="tokens / s (all ranks)", ylim=(0, None))
    util.set(xlabel="step", ylabel="MFU (%)")
    if util.lines:
        util.set_ylim(0, None)
    else:  # a CPU has no known peak: say so rather than draw an empty panel with a made-up axis
        util.set_axis_off()
        util.text(0.5, 0.5, "no MFU logged: the device's peak FLOP/s is unknown\n(a CPU); --peak-flops sets it",
                  ha="center", va="center", transform=util.transAxes)
    speed.legend(fontsize="small")
    return fig


def _bar_x(group: int, i: int, num_runs: int) -> float:
    """Centre of run i's bar in a group of `num_runs` bars 0.8 wide in total."""
    return group + (i - (num_runs - 1) / 2) * 0.8 / num_runs


def _bars(ax, groups: list[str], runs: list[Run], values: list[list[float | None]]) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per run (None: no bar), values on top."""
    width = 0.8 / len(runs)
    for i, (run, row) in enumerate(zip(runs, values)):
        xs = [_bar_x(g, i, len(runs)) for g, v in enumerate(row) if v is not None]
        bars = ax.bar(xs, [v for v in row if v is not None], width, color=run.color, label=run.label)
        ax.bar_label(bars, fmt="{:,.1f}", fontsize="x-small", padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(False, axis="x")
    ax.margins(y=0.15)


def _peak_per_rank(run: Run) -> list[float]:
    """MB, rank by rank, of the peak over the whole run."""
    peaks: dict[int, float] = {}
    for record in run.records:
        for rank, b in enumerate(record.get("peak_mem_bytes_per_rank") or [record.get("peak_mem_bytes") or 0]):
            peaks[rank] = max(peaks.get(rank, 0.0), b / MB)
    return [peaks[rank] for rank in sorted(peaks)]


def memory_figure(runs: list[Run]):
    """Peak memory of every rank; model state by kind for runs that log `resident_bytes`."""
    with_breakdown = [run for run in runs if isinstance(run.records[-1].get(BREAKDOWN_KEY), dict)]
    fig, axes = _figure(2 if with_breakdown else 1, "Peak memory")
    per_run = [_peak_per_rank(run) for run in runs]
    ranks = max(len(peaks) for peaks in per_run)
    values = [peaks + [None] * (ranks - len(peaks)) for peaks in per_run]
    _bars(axes[0], [f"rank {r}" for r in range(ranks)], runs, values)
    axes[0].set(ylabel="peak memory (MB)", title="per rank, peak over the run")
    axes[0].legend(fontsize="small", loc="lower right")
    if with_breakdown:
        _stacked_breakdown(axes[1], with_breakdown)
    return fig


def _stacked_breakdown(ax, runs: list[Run]) -> None:
    from matplotlib import colormaps

    breakdowns = [run.records[-1][BREAKDOWN_KEY] for run in runs]
    present = {kind for b in breakdowns for kind, value in b.items() if kind != "total" and value}
    kinds = [k for k in KIND_ORDER if k in present] + sorted(present - set(KIND_ORDER))
    bottoms = [0.0] * len(runs)
    for j, kind in enumerate(kinds):  # a palette apart from the runs' colours: these are kinds
        heights = [b.get(kind, 0) / MB for b in breakdowns]
        ax.bar(range(len(runs)), heights, 0.6, bottom=bottoms, label=kind, color=colormaps["Set2"](j))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(runs)), [run.label for run in runs], fontsize="small")
    ax.grid(False, axis="x")
    ax.set(ylabel="MB", title="model state by kind (rank 0, last step)")
    ax.legend(fontsize="small")


def comm_figure(runs: list[Run]):
    """Median bytes sent per step on each mesh axis."""
    fig, (ax,) = _figure(1, "Communication per step (bytes this rank sent)")
    summaries = [run_summary(run)["comm_bytes_per_step"] for run in runs]
    axes = sorted({axis for s in summaries for axis in s})
    if not axes:
        ax.text(0.5, 0.5, "no communication: every run is one process", ha="center", va="center",
                transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])
    else:
        values = [[s.get(axis, 0) / MB for axis in axes] for s in summaries]
        _bars(ax, [f"{axis} axis" for axis in axes], runs, values)
        _planned_marks(ax, runs, axes)
        ax.set(ylabel="MB per step (median over steps)")
        ax.legend(fontsize="small")
    return fig


def _planned_marks(ax, runs: list[Run], axes: list[str]) -> None:
    """A black line across each bar at the bytes `paratrain plan` estimates for that run and axis."""
    labelled = False
    for i, run in enumerate(runs):
        planned = planned_comm(run) or {}
        for g, axis in enumerate(axes):
            if planned.get(axis):
                x, half = _bar_x(g, i, len(runs)), 0.4 / len(runs)
                ax.plot([x - half, x + half], [planned[axis] / MB] * 2, color="black", linewidth=2.5,
                        label=None if labelled else "estimate of paratrain plan")
                labelled = True


def plot_pipeline(run: Run, out: Path) -> Path | None:
    """The run's pipeline timeline (the simulator's, of its schedule) when it has pp > 1."""
    from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE, build_schedule
    from paratrain.parallel.pipeline.simulator import draw_timeline

    parallel, train = run.config.get("parallel", {}), run.config.get("train", {})
    pp = parallel.get("pp") or 1
    if pp <= 1:
        return None
    microbatches = max(1, train.get("global_batch", 1) // (train.get("micro_batch", 1) * run.dp))
    try:
        schedule = build_schedule(parallel.get("schedule") or DEFAULT_SCHEDULE, pp, microbatches,
                                  parallel.get("virtual_stages") or 1)
    except ValueError as e:  # a schedule the simulator refuses should not cost the other figures
        run.notes.append(f"pipeline timeline skipped: {e}")
        return None
    path = out / f"pipeline-{run.name.replace('/', '_')}.png"
    draw_timeline(schedule, path, title=f"{run.label}: {microbatches} micro-batch(es) per step")
    return path


def experts_figure(runs: list[Run]):
    """A mixture of experts' routing per step: each layer's busiest expert over the mean (1: balanced, E: one
    expert takes every token) and the auxiliary loss beside the LM loss; None when no run has MoE records."""
    moe = [run for run in runs if any("moe" in r for r in run.records)]
    if not moe:
        return None
    fig, (balance, aux) = _figure(2, "Expert load")
    for run in moe:
        rows = [r for r in run.records if r.get("moe")]
        layers = list(rows[0]["moe"]["load_max_mean"])
        for i, layer in enumerate(layers):
            balance.plot([r["step"] for r in rows], [r["moe"]["load_max_mean"].get(layer) for r in rows],
                         color=run.color, alpha=0.35 + 0.65 * (i + 1) / len(layers), marker=".",
                         label=f"{run.label} {layer}")
        aux.plot([r["step"] for r in rows], [r["moe"]["aux_loss"] for r in rows], color=run.color, marker=".",
                 label=run.label)
    balance.set(xlabel="step", ylabel="tokens per expert, max / mean", ylim=(1, None))
    aux.set(xlabel="step", ylabel="auxiliary loss (coefficients applied)")
    balance.legend(fontsize="small")
    return fig


def ranks_figure(runs: list[Run]):
    """Each rank's compute time per step (the step's agreement carries it), the stragglers the run named ringed;
    None when no run records it (runs older than the record)."""
    timed = [run for run in runs if any("compute_s_per_rank" in r for r in run.records)]
    if not timed:
        return None
    fig, (ax,) = _figure(1, "Compute time per rank")
    styles = ("-", "--", ":", "-.")
    for i, run in enumerate(timed):
        rows = [r for r in run.records if r.get("compute_s_per_rank")]
        for rank in range(max(len(r["compute_s_per_rank"]) for r in rows)):
            ax.plot([r["step"] for r in rows], [1e3 * r["compute_s_per_rank"][rank] for r in rows],
                    linestyle=styles[i % len(styles)], marker=".", label=f"{run.label} rank {rank}")
        named = [(r["step"], 1e3 * s["compute_s"]) for r in rows for s in r.get("stragglers", [])]
        if named:
            ax.scatter(*zip(*named), s=90, facecolors="none", edgecolors="red", label=f"{run.label} straggler")
    ax.set(xlabel="step", ylabel="compute (ms, communication waits excluded)", ylim=(0, None))
    ax.legend(fontsize="small")
    return fig


FIGURES = {"loss.png": loss_figure, "throughput.png": throughput_figure, "memory.png": memory_figure,
           "comm.png": comm_figure}


def write_report(runs: list[Run], out: str | Path) -> list[Path]:
    """Write every figure for `runs` into `out`; return their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in FIGURES.items():
        build(runs).savefig(out / name, dpi=110)
        paths.append(out / name)
    for name, optional in (("experts.png", experts_figure), ("ranks.png", ranks_figure)):
        figure = optional(runs)  # a mixture of experts' load; the ranks' compute times where recorded
        if figure is not None:
            figure.savefig(out / name, dpi=110)
            paths.append(out / name)
    return paths + [p for p in (plot_pipeline(run, out) for run in runs) if p is not None]


# -- command line --------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `report` subcommand to the main CLI's subparsers; returns its parser."""
    parser = subparsers.add_parser("report", help="plot and summarize finished runs", description=(
        "Plot loss, throughput, peak memory per rank, communication per axis and compute time per rank "
        "(stragglers ringed) of one or more "
        "run directories (several are overlaid on the same axes), draw the pipeline timeline of "
        "runs with pp > 1, and print a summary of each run."))
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="--out directory of `paratrain train`")
    parser.add_argument("--out", metavar="DIR", help="where the PNG figures go (default: RUN_DIR/report "
                                                     "for one run, ./report for several)")
    parser.add_argument("--hardware", metavar="NAME_OR_FILE",
                        help="hardware preset or profile for the predicted step time (default: the profile "
                             "`paratrain plan --calibrate` wrote, if any)")
    return parser


def report_hardware(name: str | None):
    """The hardware of the prediction: `name` (preset or profile file), else the calibrated default, else None."""
    from paratrain.plan import DEFAULT_PROFILE, get_hardware, load_profile

    if name is not None:
        return get_hardware(name)
    return load_profile(DEFAULT_PROFILE) if DEFAULT_PROFILE.is_file() else None


def run(args) -> int:
    """Run `paratrain report` (a bad run directory raises ReportError: one line, exit 2)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ReportError("the figures need matplotlib, which is not installed; "
                          "pip install 'paratrain[plot]' (or matplotlib)")
    runs = load_runs(args.runs)
    hardware = report_hardware(args.hardware)
    out = Path(args.out) if args.out else (runs[0].path / "report" if len(runs) == 1 else Path("report"))
    paths = write_report(runs, out)
    print(format_summary(runs, hardware))
    print(f"figures: {', '.join(str(p) for p in paths)}")
    return 0
