"""Which samples each data rank reads at each step, independent of the layout.

The sample order is one infinite stream: the concatenation of per-epoch
permutations of ``range(num_samples)``, epoch ``e`` shuffled by a generator
seeded with ``(seed, e)`` (identity without shuffling). Global step ``k``
consumes stream positions ``[k*B, (k+1)*B)`` with ``B = global_batch``; of
those, data rank ``r`` of ``N`` reads the contiguous slice
``[k*B + r*B/N, k*B + (r+1)*B/N)``. So:

- concatenating the ranks' slices gives the same global batch for every N,
  which is what makes a run on N ranks equal to a run on one;
- a global batch may straddle an epoch boundary, so each epoch uses every
  sample exactly once and drops none;
- the state is just (epoch, position in epoch), global rather than per
  rank, so a run can resume on a different number of data ranks.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from paratrain.errors import DataError


class DataSampler:
    """Sample indices for data rank ``dp_rank`` of ``dp_size``, ``global_batch // dp_size`` per step."""

    def __init__(self, num_samples: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        _check_int("num_samples", num_samples, minimum=1)
        _check_int("global_batch", global_batch, minimum=1)
        _check_int("dp_size", dp_size, minimum=1)
        _check_int("seed", seed, minimum=0)
        _check_int("dp_rank", dp_rank, minimum=0)
        if dp_rank >= dp_size:
            raise DataError(f"dp_rank={dp_rank} must be below dp_size={dp_size}")
        if global_batch % dp_size:
            raise DataError(f"global_batch={global_batch} is not divisible by dp_size={dp_size}; "
                            f"use global_batch={_nearest_multiples(global_batch, dp_size)}")
        # int(): numpy integers would leak into the JSON state.
        self.num_samples = int(num_samples)
        self.global_batch = int(global_batch)
        self.local_batch = self.global_batch // int(dp_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._epoch = 0
        self._position = 0
        # Only one epoch's permutation is kept: it is recomputed on demand.
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be read."""
        return self._epoch

    @property
    def position(self) -> int:
        """Index within the current epoch of the next sample to be read."""
        return self._position

    @property
    def samples_consumed(self) -> int:
        """Samples consumed by all ranks together so far (stream position)."""
        return self._epoch * self.num_samples + self._position

    def next_batch(self) -> list[int]:
        """This rank's sample indices for the next step; advances by one global batch."""
        start = self.samples_consumed + self.dp_rank * self.local_batch
        indices = self._read(start, self.local_batch)
        self._epoch, self._position = divmod(self.samples_consumed + self.global_batch, self.num_samples)
        return indices

    def global_batch_indices(self) -> list[int]:
        """All ranks' indices of the next step, rank 0's first; does not advance."""
        return self._read(self.samples_consumed, self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        """Endless ``next_batch()`` calls."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Global position and identity of the stream, JSON-serializable (ints only)."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
                "num_samples": self.num_samples, "global_batch": self.global_batch,
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``, saved with any ``dp_size``.

        A different ``global_batch`` is accepted: the next step starts at the
        saved sample position. A different dataset, seed or shuffle is not.
        """
        if "sizes" in state:
            raise DataError("the checkpoint's data stream is a mixture, this run's a single corpus; resume with the "
                            "same --data, or start a new stage on this data with --reset data")
        for key in ("epoch", "position", "seed", "num_samples"):
            if key not in state:
                raise DataError(f"sampler state lacks {key!r}; pass a dict from DataSampler.state_dict()")
            _check_int(f"sampler state {key}", state[key], minimum=0)
        for key, mine in (("num_samples", self.num_samples), ("seed", self.seed),
                          ("shuffle", int(self.shuffle))):
            theirs = state.get(key, mine)
            if theirs != mine:
                raise DataError(f"sampler state has {key}={theirs} but this run has {key}={mine}; resume with the "
                                f"same {key} (same data and seq_len for num_samples), or start a new stage on "
                                f"other data with --reset data")
        if state["position"] >= self.num_samples:
            raise DataError(f"sampler state position={state['position']} must be below "
                            f"num_samples={self.num_samples}")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])

    def _read(self, start: int, count: int) -> list[int]:
        """Sample indices at stream positions ``[start, start + count)``."""
        out: list[int] = []
        while count > 0:
            epoch, pos = divmod(start, self.num_samples)
            take = min(count, self.num_samples - pos)
            out.extend(self._permutation(epoch)[pos:pos + take].tolist())
            start += take
            count -= take
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        """Order of the samples in ``epoch``: a function of (seed, epoch) alone."""
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples, dtype=np.int64)
            self._perm_epoch = epoch
        return self._perm


def _check_int(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{field}={value!r} must be an integer >= {minimum}")


def _nearest_multiples(value: int, divisor: int) -> str:
    """The multiples of ``divisor`` just below and above ``value``, e.g. '8 or 12'."""
    lower = value // divisor * divisor
    upper = lower + divisor
    return f"{lower} or {upper}" if lower else str(upper)
