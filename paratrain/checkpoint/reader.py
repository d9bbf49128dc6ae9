"""Reading a committed checkpoint into any layout: any box of any tensor, assembled from the boxes that were saved.

    with CheckpointReader(find_latest(root)) as ckpt:
        ckpt.check_compatible({name: (p.shape, p.dtype) for name, p in full_shapes.items()})
        rows = ckpt.read("layers.0.wq", offset=(r * c, 0), shape=(n, 32))   # this rank's new shard
        rng = ckpt.rank_state(rank)["rng"]

A read touches only the stored boxes that overlap the requested one, and of
each only the overlapping slice (safetensors maps the file and copies just
that slice), so a rank loading its shard reads about its shard's bytes,
whatever the layout that saved it.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open

from paratrain.checkpoint.boxes import intersect, slices
from paratrain.checkpoint.format import (
    Box, CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, TensorEntry, torch_dtype,
)
from paratrain.checkpoint.state import decode_state
from paratrain.checkpoint.store import read_index, verify_checkpoint

# Names listed in full in a compatibility error; longer lists are cut.
_LIST_NAMES = 5


@dataclass(frozen=True)
class Compatibility:
    """What `check_compatible` tolerated (only without `strict`): expected names absent, stored names not expected."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


class CheckpointReader:
    """One committed checkpoint, open for reading. Verified against its manifest first unless ``verify=False``.

    With ``checksums=False`` verification checks presence and sizes only
    (fast); a job typically verifies fully on one rank (`find_latest`) and
    opens with ``verify=False`` or ``checksums=False`` on the others.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, checksums: bool = True):
        self.path = Path(path)
        if verify:
            verify_checkpoint(self.path, checksums=checksums)
        self._index = read_index(self.path)
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Release the open files (the reader can still be used; files reopen on demand)."""
        self._handles.clear()

    @property
    def step(self) -> int:
        """The step the checkpoint was saved at."""
        return self._index.step

    @property
    def num_saved_ranks(self) -> int:
        """How many ranks saved it (the world size of the saving job's checkpoint group)."""
        return self._index.world_size

    def names(self) -> list[str]:
        """The names of every stored tensor, sorted."""
        return sorted(self._index.tensors)

    def global_shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor `name`."""
        return self._entry(name).global_shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype tensor `name` was saved in."""
        return torch_dtype(self._entry(name).dtype)

    def boxes(self, name: str) -> tuple[Box, ...]:
        """The stored pieces of tensor `name` (file, key, offset, shape), empty pieces left out."""
        return self._entry(name).boxes

    def read(self, name: str, offset: Sequence[int] | None = None, shape: Sequence[int] | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """The box of tensor `name` at `offset` with extent `shape` (both None: the whole tensor), on the CPU.

        In the stored dtype unless `dtype` asks for a conversion. Raises
        CheckpointError when the box leaves the tensor or part of it was
        never stored.
        """
        entry = self._entry(name)
        offset, shape = self._request(name, entry, offset, shape)
        out = torch.empty(shape, dtype=torch_dtype(entry.dtype), device="cpu")  # read into host memory
        filled = 0
        for box in entry.boxes:
            common = intersect(box.offset, box.shape, offset, shape)
            if common is None:
                continue
            out[slices(*common, origin=offset)] = self._load_slice(box, *common)
            filled += math.prod(common[1])
        wanted = math.prod(shape)
        if filled != wanted:
            raise CheckpointError(f"{self.path.name}: tensor {name!r} at offset {list(offset)} shape {list(shape)} "
                                  f"is only partly stored ({filled} of {wanted} elements)")
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def shared_state(self) -> dict:
        """The state rank 0 saved for all ranks (tensors come back on the CPU, tuples as lists)."""
        return decode_state(self._index.shared_state)

    def rank_state(self, rank: int) -> dict:
        """The state rank `rank` saved for itself; CheckpointError if no such rank saved."""
        if rank not in self._index.rank_state:
            raise CheckpointError(f"{self.path.name} was saved by {self.num_saved_ranks} rank(s): there is no state "
                                  f"of rank {rank}; map the ranks of the new layout onto the saved ones first")
        return decode_state(self._index.rank_state[rank])

    def check_compatible(self, expected: Mapping[str, tuple[Sequence[int], torch.dtype | str]], *,
                         strict: bool = True) -> Compatibility:
        """Compare stored tensors with `expected` (name -> (global shape, dtype)); IncompatibleCheckpointError if they differ.

        The error names the first tensor (in `expected`'s order) whose shape
        or dtype differs, with both, and lists expected names that are
        missing and stored names that are unexpected. Without `strict`,
        missing and unexpected names are returned instead of raised.
        """
        stored = self._index.tensors
        problems = []
        for name, (shape, dtype) in expected.items():
            if name not in stored:
                continue
            want = (tuple(int(d) for d in shape), _dtype_str(dtype))
            have = (stored[name].global_shape, stored[name].dtype)
            if have != want:
                problems.append(f"tensor {name!r} is {list(have[0])} {have[1]} in the checkpoint but "
                                f"{list(want[0])} {want[1]} is expected")
                break
        missing = tuple(n for n in expected if n not in stored)
        unexpected = tuple(n for n in sorted(stored) if n not in expected)
        if strict and missing:
            problems.append(f"missing from the checkpoint: {_name_list(missing)}")
        if strict and unexpected:
            problems.append(f"unexpected in the checkpoint: {_name_list(unexpected)}")
        if problems:
            raise IncompatibleCheckpointError(f"{self.path.name} does not match the model: {'; '.join(problems)}")
        return Compatibility(missing, unexpected)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self._index.tensors[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._index.tensors), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise CheckpointError(f"{self.path.name} has no tensor {name!r}{hint}") from None

    def _request(self, name: str, entry: TensorEntry, offset, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if offset is None and shape is None:
            return (0,) * len(entry.global_shape), entry.global_shape
        if offset is None or shape is None:
            raise CheckpointError(f"read({name!r}): give both offset and shape, or neither for the whole tensor")
        offset, shape = tuple(int(o) for o in offset), tuple(int(n) for n in shape)
        ndim = len(entry.global_shape)
        if len(offset) != ndim or len(shape) != ndim or any(o < 0 or n < 0 for o, n in zip(offset, shape)) or any(
                o + n > d for o, n, d in zip(offset, shape, entry.global_shape)):
            raise CheckpointError(f"read({name!r}): offset {list(offset)} shape {list(shape)} is not a box inside "
                                  f"the global shape {list(entry.global_shape)}")
        return offset, shape

    def _load_slice(self, box: Box, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The part (offset, shape) of a stored box, read from its file."""
        try:
            handle = self._handles.get(box.file)
            if handle is None:
                handle = self._handles[box.file] = safe_open(str(self.path / box.file), framework="pt", device="cpu")
            stored = handle.get_slice(box.key)
            if tuple(stored.get_shape()) != box.shape:
                raise CorruptCheckpointError(f"{self.path.name}: {box.file} holds {box.key!r} with shape "
                                             f"{stored.get_shape()}, but index.json says {list(box.shape)}")
            # safetensors builds the slice with torch's default device, which a caller may have set
            # (to a GPU, say): a read lands in host memory, and the loader copies it where it goes.
            with torch.device("cpu"):
                return stored[slices(offset, shape, origin=box.offset)]
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own and Python's errors alike
            raise CorruptCheckpointError(f"{self.path.name}: cannot read {box.key!r} from {box.file} "
                                         f"({type(exc).__name__}: {exc})") from exc


def _dtype_str(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _name_list(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LIST_NAMES])
    return shown if len(names) <= _LIST_NAMES else f"{shown}, … ({len(names)} in all)"
