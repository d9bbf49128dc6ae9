"""Per-step measurements: throughput, model FLOPs utilisation, time breakdown, the JSONL log (peak memory: paratrain.peak_memory)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import numpy as np

from paratrain.errors import ParatrainError


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return flops_per_token * tokens_per_s / (peak_flops * num_devices)


def unigram_entropy(tokens: np.ndarray, vocab_size: int, max_tokens: int = 20_000_000) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that ignores context."""
    counts = np.bincount(np.asarray(tokens[:max_tokens], dtype=np.int64), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def summary_writer_class():
    """torch's TensorBoard SummaryWriter; a one-line ParatrainError when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ParatrainError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numbers as TensorBoard tags: nested dicts flattened as `a/b`; lists, None and flags left out."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = value
    return out


class MetricsLog:
    """Appends one JSON object per line and flushes it, so a crash loses no finished step.

    With `tensorboard` (a directory) each record's numbers also go there as scalars at the record's
    step (`scalars`); metrics.jsonl stays the source of truth. `purge_step`: a resumed run's first
    step, from which TensorBoard drops the events an earlier attempt wrote (as metrics.jsonl is cut
    back to the resumed step).
    """

    def __init__(self, path: Path, tensorboard: Path | None = None, purge_step: int | None = None):
        self.path = path
        self._writer = summary_writer_class()(str(tensorboard), purge_step=purge_step) if tensorboard else None
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._writer is not None:
            for tag, value in scalars({k: v for k, v in record.items() if k != "step"}).items():
                self._writer.add_scalar(tag, value, global_step=record["step"])
            self._writer.flush()

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Read a metrics.jsonl file back into a list of records."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class StepTimer:
    """Where one optimizer step's time goes, for the metrics of each step.

    The trainer runs each phase of a step (data, forward_backward, optimizer; and the checkpoint
    save after the step, which it reports with the next step) inside `phase(name)`. The seconds
    a phase's collectives kept this rank blocked (`Comm.blocked_s`: synchronous collectives and
    waits on asynchronous ones) are taken out of the phase and reported as exposed
    communication per axis, the pp axis's as the
    pipeline wait (a stage idle until its neighbour's activation or gradient arrives). What
    remains of forward_backward is compute; recomputation under activation checkpointing is
    part of it.
    """

    PHASES = ("data", "forward_backward", "optimizer", "checkpoint")

    def __init__(self, comm):
        self.comm = comm
        self.seconds = dict.fromkeys(self.PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        blocked, start = self._blocked(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start - (self._blocked() - blocked)

    def _blocked(self) -> float:
        return sum(self.comm.blocked_s.values())

    def breakdown(self, step_time_s: float) -> dict:
        """{compute_s, optimizer_s, data_s, checkpoint_s, comm_exposed_s: {axis: s}, pipeline_wait_s, other_s}.

        On CUDA the exposed communication and the pipeline wait are the previous step's (`Comm.exposed_s`:
        the stream's waits, read from CUDA events once the GPU has passed them, so that no step waits for
        its own last kernel); the first step's are empty.
        """
        held = self.comm.exposed_s()
        exposed = {axis: s for axis, s in held.items() if axis != "pp"}
        result = {"compute_s": self.seconds["forward_backward"], "optimizer_s": self.seconds["optimizer"],
                  "data_s": self.seconds["data"], "checkpoint_s": self.seconds["checkpoint"],
                  "comm_exposed_s": exposed, "pipeline_wait_s": held.get("pp", 0.0)}
        accounted = sum(self.seconds.values()) + self._blocked()
        result["other_s"] = max(0.0, step_time_s - accounted)
        return result
