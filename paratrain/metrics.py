"""Per-step measurements: throughput, model FLOPs utilisation, peak memory, the JSONL log."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import numpy as np
import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocator peak on CUDA, resident-set peak on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


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


class MetricsLog:
    """Appends one JSON object per line and flushes it, so a crash loses no finished step."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Read a metrics.jsonl file back into a list of records."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
