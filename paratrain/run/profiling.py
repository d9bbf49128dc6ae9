"""Looking inside steps: torch.profiler traces of chosen steps (--profile-steps) and CUDA memory snapshots
(--memory-snapshot), every rank writing its own into the run directory.

- `StepProfiler`: from the first chosen step to the last, torch.profiler records this rank's CPU activity
  (and CUDA's on a GPU) with tensor shapes, each step under a `paratrain step N` range; after the last one
  it writes one Chrome trace, <out>/profile/rank-R-step-A-B.json.gz, which Perfetto and chrome://tracing
  open. Python stacks are recorded on a GPU only, where the host runs ahead of the kernels and the cost
  hides; on the CPU they would slow the very steps being measured.
- `MemorySnapshots`: on CUDA, the allocator's history is recorded from the start of the run
  (`torch.cuda.memory._record_memory_history`), and a snapshot, which PyTorch's memory visualizer
  (pytorch.org/memory_viz) reads, is dumped after the first optimizer step of the attempt and when a
  step runs out of memory, before the run's out-of-memory message: <out>/memory/rank-R-step-S.pickle and
  rank-R-oom-step-S.pickle. On the CPU there is no such allocator: the run says so once.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

import torch

from paratrain import compat
from paratrain.config import Config, ConfigError
from paratrain.run.rundir import MEMORY_DIR, PROFILE_DIR

OOM_ERRORS = (MemoryError, torch.OutOfMemoryError)
HISTORY_ENTRIES = 100_000  # allocation events kept: the first step of a large model fits


def profile_steps(cfg: Config) -> tuple[int, int] | None:
    """--profile-steps A:B as (A, B), 1 ≤ A ≤ B ≤ --steps; None when not asked for; ConfigError otherwise."""
    text = cfg.logging.profile_steps.strip()
    if not text:
        return None
    match = re.fullmatch(r"(\d+):(\d+)", text)
    first, last = (int(match[1]), int(match[2])) if match else (0, 0)
    if not match or not 1 <= first <= last:
        raise ConfigError(f"--profile-steps {text!r}: expected A:B, the first and last step to record (1 ≤ A ≤ B), "
                          f"e.g. 4:5")
    if cfg.train.steps is not None and last > cfg.train.steps:
        raise ConfigError(f"--profile-steps {text}: step {last} is past the run's last step (--steps "
                          f"{cfg.train.steps})")
    return first, last


def trace_name(rank: int, first: int, last: int) -> str:
    return f"{PROFILE_DIR}/rank-{rank}-step-{first}-{last}.json.gz"


class StepProfiler:
    """torch.profiler over steps `steps` = (A, B) of this rank (None: nothing recorded)."""

    def __init__(self, steps: tuple[int, int] | None, out: Path, rank: int, device: torch.device):
        self.steps, self.out, self.rank, self.device = steps, out, rank, device
        self._profile = None

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one whole step; yields the trace's path (relative to the run) on the step that writes it."""
        written: list[str] = []
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            yield written
            return
        if self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities, record_shapes=True,
                                                   with_stack=self.device.type == "cuda")
            with self._native_log():
                self._profile.__enter__()
        with torch.profiler.record_function(f"paratrain step {step}"):
            yield written
        if step == self.steps[1]:
            written.append(self._finish())

    def _finish(self) -> str:
        profile, self._profile = self._profile, None
        with self._native_log():
            profile.__exit__(None, None, None)
        name = trace_name(self.rank, *self.steps)
        (self.out / PROFILE_DIR).mkdir(exist_ok=True)
        profile.export_chrome_trace(str(self.out / name))  # gzipped, by its name
        return name

    def close(self) -> None:
        """A run that ends (or stops) inside the range: the trace of the steps it recorded."""
        if self._profile is not None:
            with self._native_log():
                self._profile.__exit__(None, None, None)
            self._profile = None

    @contextlib.contextmanager
    def _native_log(self):
        """The profiler's own C++ log lines (Kineto's `USDT: ... profiler_start`/`profiler_stop`, which no log level
        turns off) written to this rank's <out>/profile/rank-R.log instead of the console: file descriptor 2 is
        pointed there while the profiler starts and stops."""
        (self.out / PROFILE_DIR).mkdir(parents=True, exist_ok=True)
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(self.out / PROFILE_DIR / f"rank-{self.rank}.log", "ab") as log:
                os.dup2(log.fileno(), 2)
                try:
                    yield
                finally:
                    sys.stderr.flush()
                    os.dup2(saved, 2)
        finally:
            os.close(saved)


class MemorySnapshots:
    """CUDA memory snapshots after the first optimizer step and on an out-of-memory step (`enabled`)."""

    def __init__(self, enabled: bool, out: Path, rank: int, device: torch.device, say_once: bool):
        self.out, self.rank = out, rank
        self.enabled = enabled and device.type == "cuda"
        self._first_dumped = False
        if enabled and not self.enabled and say_once:
            print(f"paratrain: --memory-snapshot needs CUDA (this run is on the {device.type}): no snapshot is "
                  f"recorded", file=sys.stderr, flush=True)
        if self.enabled:
            compat.record_memory_history(HISTORY_ENTRIES)

    def dump(self, name: str) -> Path:
        path = self.out / MEMORY_DIR / f"rank-{self.rank}-{name}.pickle"
        path.parent.mkdir(exist_ok=True)
        compat.dump_memory_snapshot(str(path))
        return path

    @contextlib.contextmanager
    def around_step(self, step: int):
        """One step: dumps a snapshot after it if it is the attempt's first, and before an out-of-memory error
        leaves it."""
        if not self.enabled:
            yield
            return
        try:
            yield
        except OOM_ERRORS:
            path = self.dump(f"oom-step-{step}")
            print(f"paratrain: rank {self.rank}: memory snapshot of the out-of-memory step {step}: {path}",
                  file=sys.stderr, flush=True)
            raise
        if not self._first_dumped:
            self._first_dumped = True
            self.dump(f"step-{step}")

    def close(self) -> None:
        if self.enabled:
            compat.record_memory_history(None)
