"""Per-step measurements: throughput, model FLOPs utilisation, time breakdown, the JSONL log (peak memory: paratrain.peak_memory)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import torch


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


# -- mixture-of-experts load ------------------------------------------------------------------

_MOE_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.feed_forward$")


def moe_layers(model) -> dict[int, object]:
    """Layer index → the MoE module of that layer this rank holds (`paratrain.models.moe.MoE`: it records
    `step_tokens_per_expert` and `step_aux_loss` over a step's forwards); empty for a dense model."""
    out = {}
    for name, module in model.named_modules():
        match = _MOE_MODULE.search(name)
        if match and hasattr(module, "step_tokens_per_expert"):
            out[int(match.group(1))] = module
    return out


def moe_counts(layers: dict[int, object], n_layers: int, n_experts: int) -> dict[str, torch.Tensor | float]:
    """The step's expert load of this rank's MoE layers (every micro-batch's forward, once), for the step's
    agreement to sum over the ranks: {"moe.3.e5": tokens of layer 3 routed to expert 5, "moe.3.aux": its
    auxiliary loss, the mean over the step's sequences on this rank}.

    Device tensors (0-d views) ride the agreement's one all-reduce and its one host read, so reading them
    costs no sync. Every rank names every layer of the model (the agreement's rows must match across
    ranks): a layer this rank does not hold, or has not run, counts 0.
    """
    out: dict[str, torch.Tensor | float] = {}
    for layer in range(n_layers if n_experts else 0):
        module = layers.get(layer)
        counts = getattr(module, "step_tokens_per_expert", None)
        aux = getattr(module, "step_aux_loss", None)
        for e in range(n_experts):
            out[f"moe.{layer}.e{e}"] = counts[e] if counts is not None else 0.0
        out[f"moe.{layer}.aux"] = aux if aux is not None else 0.0
    return out


def expert_load(per_rank: dict[str, tuple[float, ...]], owners: list[int], data_ranks: int) -> dict | None:
    """The metrics record's `moe` entry from the agreement's per-rank rows of `moe_counts` (None: a dense model).

    `owners`: the ranks whose rows count (one per data rank and pipeline stage: the tensor and context
    parallel ranks of a data rank see the same tokens); `data_ranks`: dp, to average the aux loss over.
    tokens_per_expert: per layer, every data rank's assignments over the step's micro-batches;
    load_max_mean: per layer, the busiest expert's tokens over the mean (1 when balanced, E when one
    expert takes everything); aux_loss: the auxiliary terms (coefficients applied) summed over the
    layers, averaged over the data ranks: what the backward added beside the LM loss, which `loss` is.
    """
    rows = {key: sum(values[r] for r in owners) for key, values in per_rank.items() if key.startswith("moe.")}
    if not rows:
        return None
    layers = sorted({int(key.split(".")[1]) for key in rows})
    tokens = {f"layer{i}": [int(rows[key]) for key in sorted((k for k in rows if k.startswith(f"moe.{i}.e")),
                                                                key=lambda k: int(k.rsplit(".e", 1)[1]))]
              for i in layers}
    ratio = {name: (max(t) / (sum(t) / len(t)) if sum(t) else None) for name, t in tokens.items()}
    aux = sum(rows[f"moe.{i}.aux"] for i in layers) / data_ranks
    finite = [r for r in ratio.values() if r is not None]
    return {"aux_loss": aux, "tokens_per_expert": tokens, "load_max_mean": ratio,
            "load_max_mean_worst": max(finite) if finite else None}


# -- stragglers --------------------------------------------------------------------------------

class StragglerWatch:
    """Names a rank whose compute time exceeds the median of every rank's by more than `threshold` (a fraction)
    for `steps` steps in a row: the step's agreement carries each rank's time, so every rank sees the same.

    `observe(times)` takes a step's per-rank compute seconds and returns the stragglers of that step, each
    {"rank", "host", "compute_s", "median_s", "steps"}: a rank is one from its `steps`-th slow step in a row
    until a step of its is not slow. `new` says which of them were named at this step (once per run of slow steps).
    """

    def __init__(self, threshold: float, steps: int, hosts: list[str]):
        self.threshold, self.steps, self.hosts = threshold, steps, list(hosts)
        self.streak = [0] * len(self.hosts)

    def observe(self, times) -> tuple[list[dict], list[dict]]:
        """(the stragglers of this step, those newly named) from this step's per-rank compute seconds."""
        times = [float(t) for t in times]
        median = float(np.median(times))
        stragglers = []
        for rank, seconds in enumerate(times):
            slow = median > 0 and seconds > median * (1 + self.threshold)
            self.streak[rank] = self.streak[rank] + 1 if slow else 0
            if self.streak[rank] >= self.steps:
                stragglers.append({"rank": rank, "host": self.hosts[rank], "compute_s": seconds, "median_s": median,
                                   "steps": self.streak[rank]})
        return stragglers, [s for s in stragglers if s["steps"] == self.steps]

    def describe(self, straggler: dict, step: int) -> str:
        """The warning line naming one straggler."""
        return (f"rank {straggler['rank']} on {straggler['host']} is a straggler: its compute took "
                f"{straggler['compute_s'] * 1e3:.1f} ms at step {step} against the median's "
                f"{straggler['median_s'] * 1e3:.1f} ms (more than {self.threshold:.0%} slower for {self.steps} steps "
                f"in a row)")


class MetricsLog:
    """Appends one JSON object per line and flushes it, so a crash loses no finished step.

    Each record's numbers also go to the run's `trackers` (`paratrain.trackers`: TensorBoard, W&B, MLflow) as
    scalars at the record's step, each on a thread of its own; metrics.jsonl stays the source of truth.
    """

    def __init__(self, path: Path, trackers: list | None = None):
        self.path = path
        self.trackers = list(trackers or [])
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        from paratrain.trackers import scalars

        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        values = scalars({k: v for k, v in record.items() if k != "step"})
        for tracker in self.trackers:
            tracker.log(record["step"], values)

    def close(self) -> None:
        self._file.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def read_metrics(path: str | Path) -> list[dict]:
    """Read a metrics.jsonl file back into a list of records.

    Text after the last newline is a record still being written (a live run's file, read while its rank 0
    writes) or cut by a kill: it is left out, not read as a broken record.
    """
    with open(path, encoding="utf-8") as f:
        complete = f.read().split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip()]


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


# -- where a launch's time to its first step goes -----------------------------------------------

def process_start_time() -> float | None:
    """This process's creation as a `time.time()`, to 1/100 s (Linux's /proc: ticks since boot, set against the
    boot-time clock now; a worker forked by the launcher's server), or None."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(stat[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class LaunchTimes:
    """The wall-clock times (`time.time()`) of a launch's way to its first step, which the first step's record
    carries as `launch_times`: `process` (created; to 1/100 s), `train` (the trainer entered: imports done),
    `group` (the process group up: the rendezvous of the workers), `resume` (run built: data, model, optimizer),
    `resumed` (restored from a snapshot or checkpoint, or started afresh), `first_step` (the first step done)."""

    def __init__(self):
        self.times = {"process": process_start_time(), "train": time.time()}

    def mark(self, name: str, at: float | None = None) -> None:
        self.times[name] = time.time() if at is None else at

    def record(self) -> dict:
        self.mark("first_step")
        return {"launch_times": dict(self.times)}
