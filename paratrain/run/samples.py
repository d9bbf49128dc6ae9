"""The sample ids each rank reads at each step (``--log-samples``), to check the data order across kills and resumes.

    <out>/samples/rank-00001.jsonl    {"step": 7, "rank": 1, "attempt": 2, "sample_ids": [...]} per line

On a resume the lines after the resumed step are dropped (those steps run again), so the file
always describes the trajectory behind the current weights, and ``attempt`` (the launcher's
restart count) tells which launch read each step. Off by default: it writes a line every step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from paratrain.data import DataSampler
from paratrain.faults import current_attempt
from paratrain.run.rundir import SAMPLES_DIR


def samples_path(out: Path, rank: int) -> Path:
    return Path(out) / SAMPLES_DIR / f"rank-{rank:05d}.jsonl"


def read_samples(out: Path, rank: int) -> list[dict]:
    """One rank's records, in step order."""
    lines = samples_path(out, rank).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


class SampleRecorder:
    """The run's `DataSampler` as the loop uses it (`next_batch`), writing down what it hands out.

    The checkpoints keep the sampler itself: its state is the data position, this only records.
    """

    def __init__(self, sampler: DataSampler, out: Path, rank: int, resumed_step: int):
        self.sampler, self.rank, self.step = sampler, rank, resumed_step
        self.attempt = current_attempt()
        path = samples_path(out, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        _keep_until(path, resumed_step)
        self._file = open(path, "a", encoding="utf-8")

    def __getattr__(self, name: str):
        """Everything else (the stream position, a mixture's source counts) is the sampler's."""
        return getattr(self.sampler, name)

    def next_batch(self) -> list[int]:
        """The sampler's next batch for this rank, recorded (flushed: a killed rank loses no line it read)."""
        ids = self.sampler.next_batch()
        self.step += 1
        self._file.write(json.dumps({"step": self.step, "rank": self.rank, "attempt": self.attempt,
                                     "sample_ids": ids}) + "\n")
        self._file.flush()
        return ids


def _keep_until(path: Path, step: int) -> None:
    """Drop the records after `step` (a line cut by a kill too); atomically, as `truncate_metrics` does."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
