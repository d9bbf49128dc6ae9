"""Goodput under failures: the expected waste of disk checkpoints and in-memory snapshots, and their intervals.

A job that saves its state every T seconds, each save stalling it C seconds, and fails on average once
every M seconds (the whole job's mean time between failures), loses per unit of time (Young 1974, Daly 2006):

    waste(T) = C / T + (T / 2 + R) / M

the saves' stall, plus per failure half an interval of work on average and the restart R (starting the
processes again and reading the state back). The waste is least at T_opt = sqrt(2·C·M) (d waste / dT =
-C/T² + 1/(2M) = 0); goodput = 1 − waste. Intervals are whole steps: the step count N of t seconds each
is whichever of floor(T_opt/t) and ceil(T_opt/t) (at least 1) wastes less, the waste being convex in T.

Two ways of saving are priced for one layout, with S the checkpoint's bytes per rank (the rank's
parameters, fp32 master weights and optimizer moments):

    disk only   C_disk = S / disk write bandwidth; R_disk = R + C_disk (the state read back at the same rate)
    snapshots   C_snap = S / the device's host link (`Hardware.copy_seconds`: the snapshot's only stall is its
                copy to host memory, the buddy's copy running in the background); R_snap = R + C_snap; disk
                checkpoints are kept at the disk-only interval for the loss of the whole job, their stall
                C_disk / T_disk paid as well, and failures restore from memory

The failure rate is the job's: `--failures-per-day`, or the GPUs' count times a per-GPU rate
(`DEFAULT_GPU_FAILURES_PER_YEAR`, Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs,
Llama 3 report §3.3.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.plan.memory import MemoryBreakdown, PlanError

SECONDS_PER_DAY = 86400.0
# Llama 3 (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in a 54-day snapshot of pretraining on
# 16,384 H100 GPUs, about 0.17 per GPU per year.
DEFAULT_GPU_FAILURES_PER_YEAR = 419 / 54 * 365 / 16384
DEFAULT_DISK_GBPS = 1.0  # GB/s each rank writes to shared storage while every rank writes at once
DEFAULT_RESTART_S = 300.0  # a cold restart: processes, imports, rendezvous, before the state is read


def failures_per_day(gpus: int, gpu_failures_per_year: float = DEFAULT_GPU_FAILURES_PER_YEAR) -> float:
    """The whole job's failures per day from its GPU count and a per-GPU rate per year."""
    return gpus * gpu_failures_per_year / 365.0


def checkpoint_bytes(memory: MemoryBreakdown) -> float:
    """A rank's checkpoint: its parameters, fp32 master weights and optimizer moments (the offloaded optimizer's
    host bytes without their 4-byte gradient buffer of 16 per element)."""
    return memory.params + memory.optimizer_state + memory.host * 12 / 16


def waste(save_s: float, interval_s: float, restart_s: float, mtbf_s: float) -> float:
    """Young/Daly's expected fraction of time lost: C/T + (T/2 + R)/M."""
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def optimal_interval(save_s: float, mtbf_s: float) -> float:
    """T_opt = sqrt(2·C·M), seconds."""
    return math.sqrt(2 * save_s * mtbf_s)


def best_steps(save_s: float, step_s: float, restart_s: float, mtbf_s: float) -> int:
    """The whole number of steps nearest T_opt that wastes least (at least 1)."""
    x = optimal_interval(save_s, mtbf_s) / step_s
    candidates = {max(1, math.floor(x)), max(1, math.ceil(x))}
    return min(sorted(candidates), key=lambda n: waste(save_s, n * step_s, restart_s, mtbf_s))


@dataclass(frozen=True)
class Strategy:
    """One way of saving: its stall per save, restart, interval and the waste it leaves."""

    name: str
    save_s: float
    restart_s: float
    interval_steps: int
    interval_s: float
    waste: float

    def as_dict(self) -> dict:
        return {"save_s": self.save_s, "restart_s": self.restart_s, "interval_steps": self.interval_steps,
                "interval_s": self.interval_s, "waste": self.waste, "goodput": 1 - self.waste}


@dataclass(frozen=True)
class Goodput:
    """Disk-only checkpoints against snapshots for one layout and failure rate."""

    failures_per_day: float
    checkpoint_bytes: float
    step_s: float
    disk: Strategy
    snapshot: Strategy
    disk_bytes_per_s: float
    copy_bytes_per_s: float

    @property
    def mtbf_s(self) -> float:
        return SECONDS_PER_DAY / self.failures_per_day

    def as_dict(self) -> dict:
        return {"failures_per_day": self.failures_per_day, "mtbf_s": self.mtbf_s,
                "checkpoint_bytes_per_rank": self.checkpoint_bytes, "step_s": self.step_s,
                "disk_bytes_per_s": self.disk_bytes_per_s, "copy_bytes_per_s": self.copy_bytes_per_s,
                "disk_only": self.disk.as_dict(), "snapshots": self.snapshot.as_dict()}


def goodput(nbytes: float, step_s: float, failures: float, disk_bytes_per_s: float, copy_s: float,
            restart_s: float = DEFAULT_RESTART_S) -> Goodput:
    """Price both strategies: `nbytes` per rank, `copy_s` the snapshot's stall (its copy to host memory)."""
    if not failures > 0:
        raise PlanError(f"the failure rate must be positive, got {failures!r} per day")
    if not disk_bytes_per_s > 0:
        raise PlanError(f"the disk write bandwidth must be positive, got {disk_bytes_per_s!r} bytes/s")
    if not restart_s >= 0:
        raise PlanError(f"the restart time must be non-negative, got {restart_s!r} s")
    mtbf = SECONDS_PER_DAY / failures
    c_disk = nbytes / disk_bytes_per_s
    r_disk = restart_s + c_disk
    n = best_steps(c_disk, step_s, r_disk, mtbf)
    disk = Strategy("disk only", c_disk, r_disk, n, n * step_s, waste(c_disk, n * step_s, r_disk, mtbf))
    r_snap = restart_s + copy_s
    k = best_steps(copy_s, step_s, r_snap, mtbf) if copy_s > 0 else 1
    snap_waste = waste(copy_s, k * step_s, r_snap, mtbf) + c_disk / (n * step_s)
    snap = Strategy("snapshots", copy_s, r_snap, k, k * step_s, snap_waste)
    copy_rate = nbytes / copy_s if copy_s > 0 else math.inf
    return Goodput(failures, nbytes, step_s, disk, snap, disk_bytes_per_s, copy_rate)


def format_goodput(g: Goodput, days: float, cost: float | None) -> str:
    """The two strategies' intervals, goodput, and the days (and dollars) their waste adds to `days`."""
    lines = [f"goodput under failures: {g.failures_per_day:.3g} failures per day, one every "
             f"{g.mtbf_s / 3600:,.2f} h (M); checkpoint {g.checkpoint_bytes / 1e9:,.2f} GB per rank (S)",
             "  waste = C/T + (T/2 + R)/M at Young/Daly's T = sqrt(2·C·M), rounded to whole steps"]
    for s, rate, extra in ((g.disk, f"{g.disk_bytes_per_s / 1e9:g} GB/s disk", ""),
                           (g.snapshot, f"{g.copy_bytes_per_s / 1e9:g} GB/s host copy",
                            f", + disk's C/T {g.disk.save_s / g.disk.interval_s:.2%} (kept every "
                            f"{g.disk.interval_steps:,} steps)")):
        # the work takes days; at goodput g the run takes days / g, the waste adding the difference
        lost = days / (1 - s.waste) - days if s.waste < 1 else math.inf
        money = f", ${cost / (1 - s.waste) - cost:,.0f}" if cost is not None and s.waste < 1 else ""
        lines.append(f"  {s.name:<10} every {s.interval_steps:,} steps ({s.interval_s:,.0f} s): C = S / {rate} = "
                     f"{s.save_s:,.2f} s, R = {s.restart_s:,.0f} s{extra}; goodput {1 - s.waste:.1%}, "
                     f"+{lost:,.2f} days{money}")
    return "\n".join(lines)
