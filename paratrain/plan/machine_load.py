"""Measuring on a shared machine: wait for quiet, tell others' CPU apart, notice the machine slow down.

Timings taken while other processes compete for the cores measure the competition, not the
machine. `wait_until_quiet` waits until the CPUs are nearly idle (between measurements, when
this process is idle itself); `CpuWindow` measures, around a measurement, how much CPU the
whole host used beyond what the measuring processes report as their own: the foreign share
(Linux only, /proc/stat; elsewhere nothing is waited for and the share is unknown, None).
`matmul_probe` times a fixed matmul, so that measurements made while the machine itself ran
slower (a virtual machine's host busy elsewhere) can be told apart and made again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of every CPU since boot, from /proc/stat; None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / tick, sum(fields) / tick


def busy_fraction(window: float = 1.0) -> float | None:
    """Fraction of all CPUs busy over the next `window` seconds (the caller sleeping meanwhile)."""
    before = cpu_seconds()
    time.sleep(window)
    after = cpu_seconds()
    if before is None or after is None:
        return None
    return (after[0] - before[0]) / max(after[1] - before[1], 1e-9)


def wait_until_quiet(limit: float = 0.15, max_wait: float = 120.0, window: float = 1.0) -> float:
    """Wait until two windows in a row have less than `limit` of the CPUs busy; return the seconds waited.

    Gives up after `max_wait` seconds (the measurement then goes ahead and its foreign share
    tells how much it suffered).
    """
    start, calm = time.monotonic(), 0
    while calm < 2 and time.monotonic() - start < max_wait:
        busy = busy_fraction(window)
        if busy is None:
            return 0.0
        calm = calm + 1 if busy < limit else 0
    return time.monotonic() - start


@dataclass
class CpuWindow:
    """Host CPU use between `start()` and `stop(own_cpu_s)`: the share other processes took."""

    begin: tuple[float, float] | None = None
    wall: float = 0.0
    foreign: float | None = None

    def start(self) -> CpuWindow:
        self.begin, self.wall = cpu_seconds(), time.monotonic()
        return self

    def stop(self, own_cpu_s: float) -> float | None:
        """Foreign share of all CPUs over the window, given the CPU seconds the measuring processes used."""
        end, wall = cpu_seconds(), time.monotonic() - self.wall
        if self.begin is None or end is None or wall <= 0:
            return None
        cores = os.cpu_count() or 1
        self.foreign = max(0.0, (end[0] - self.begin[0]) - own_cpu_s) / (cores * wall)
        return self.foreign


# -- the machine's speed -------------------------------------------------------------------------
# A virtual machine's host can slow it down with nothing to see from inside (no foreign process,
# little steal time): a fixed matmul timed on every rank (the probe) tells measurements taken at
# different speeds apart.

PROBE_SIZE = 256  # a 256³ matmul: in cache, about a third of a millisecond on a CPU core


def matmul_probe(seconds: float = 0.15) -> float:
    """FLOP/s this process gets on a fixed matmul over `seconds` (the caller's peers run it at once)."""
    import torch

    a, b = torch.randn(PROBE_SIZE, PROBE_SIZE), torch.randn(PROBE_SIZE, PROBE_SIZE)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        calls += 1
    return 2 * PROBE_SIZE**3 * calls / (time.perf_counter() - start)


def probe_rank(rank: int, world: int, samples: int = 5) -> float:
    """This rank's best probe of `samples`, all ranks probing together: its speed when nothing interferes."""
    import torch.distributed as dist

    best = 0.0
    for _ in range(samples):
        dist.barrier()
        best = max(best, matmul_probe())
    return best


def machine_speed(nproc: int, timeout: float = 120.0) -> float:
    """The probe's total FLOP/s over `nproc` ranks at once, the best of a few samples (a baseline)."""
    from paratrain.ranks import run_on_ranks

    return sum(run_on_ranks(probe_rank, nproc, timeout=timeout))


@dataclass(frozen=True)
class Conditions:
    """What a measurement ran under: other processes' CPU share, the speed against the baseline probe."""

    foreign: float | None
    speed: float | None

    def off(self, max_foreign: float, max_drift: float) -> float:
        """How far outside the limits (0: inside); unknown values count as inside."""
        foreign = 0.0 if self.foreign is None else max(0.0, self.foreign - max_foreign)
        speed = 0.0 if self.speed is None else max(0.0, abs(self.speed - 1) - max_drift)
        return foreign + speed
