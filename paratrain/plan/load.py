"""The host's CPU load, for measurements on a shared machine: wait for quiet, tell others' CPU apart.

Timings taken while other processes compete for the cores measure the competition, not the
machine. `wait_until_quiet` waits until the CPUs are nearly idle (between measurements, when
this process is idle itself); `CpuWindow` measures, around a measurement, how much CPU the
whole host used beyond what the measuring processes report as their own: the foreign share.
Linux only (/proc/stat); elsewhere nothing is waited for and the foreign share is unknown (None).
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
