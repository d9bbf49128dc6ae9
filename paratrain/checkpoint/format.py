"""What a checkpoint is on disk: names, the JSON index and manifest, and their validation.

A committed checkpoint is one directory ``root/step-00000008`` holding

* ``rank-00000.safetensors`` … one file per saving rank with the boxes that
  rank held (a box is a rectangular slice of a global tensor);
* ``index.json``: for every tensor its global shape, dtype and the boxes that
  make it up (file, key inside the file, offset, shape), plus the shared
  state written by rank 0 and every rank's own state;
* ``assets/``: small files the saver hands over whole (`save_checkpoint`'s
  ``assets``: a trainer's tokenizer and model description), written by rank 0;
* ``manifest.json``: size and sha256 of every other file. It is written last,
  so its presence is the commit marker.

Both JSON files are parsed into frozen dataclasses here, and any problem in
them becomes one `CorruptCheckpointError` line naming the file and the field,
never a bare ``KeyError`` or ``JSONDecodeError``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import ParatrainError

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
ASSETS_DIR = "assets"  # the one subdirectory of a checkpoint: its assets, each a plain file name inside it
TEMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step-(\d{8,})")


class CheckpointError(ParatrainError, RuntimeError):
    """A checkpoint could not be saved, found or read; the message says which file and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint on disk is incomplete or damaged (missing commit marker, size, checksum, bad JSON)."""


class IncompatibleCheckpointError(CheckpointError):
    """A valid checkpoint whose tensors do not match what the caller expects (names, shapes, dtypes)."""


class CheckpointWarning(UserWarning):
    """Something was skipped or left behind, and training can go on (an invalid newer checkpoint, a failed purge)."""


def step_dirname(step: int) -> str:
    """Directory name of a committed checkpoint: ``step-00000008``."""
    return f"step-{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a committed checkpoint directory name, or None for any other name."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def rank_filename(rank: int) -> str:
    """Name of the safetensors file one rank writes: ``rank-00003.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


# JSON dtype name -> (torch dtype, safetensors dtype code). The JSON name is
# torch's own name without the "torch." prefix, so it reads naturally.
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint64": (torch.uint64, "U64"),
    "uint32": (torch.uint32, "U32"),
    "uint16": (torch.uint16, "U16"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}
_NAME_OF = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The JSON name of a torch dtype; CheckpointError for dtypes safetensors cannot store."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a checkpoint; "
                              f"supported: {', '.join(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a JSON dtype name."""
    try:
        return DTYPES[name][0]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; supported: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class ShardSpec:
    """Where a local tensor sits in a global one: the box starting at `offset` of the tensor `name`.

    The box's extent is the local tensor's shape. ZeRO rank r of N holds rows
    [r·c, min((r+1)·c, d0)) with c = ceil(d0/N), i.e. ``offset=(r*c, 0, …)``;
    a tensor-parallel chunk k of a dim split in t holds ``offset[dim] = k·d/t``;
    both compose. A replicated tensor is one box covering everything, saved
    by exactly one rank.
    """

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        object.__setattr__(self, "offset", tuple(int(o) for o in self.offset))

    def check(self, local_shape: tuple[int, ...]) -> None:
        """Raise CheckpointError unless a local tensor of `local_shape` fits inside the global shape at `offset`."""
        where = f"shard of {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise CheckpointError(f"shard name must be a non-empty string, got {self.name!r}")
        if len(self.offset) != len(self.global_shape) or len(local_shape) != len(self.global_shape):
            raise CheckpointError(f"{where}: global shape {list(self.global_shape)}, offset {list(self.offset)} "
                                  f"and local shape {list(local_shape)} must have the same number of dims")
        if any(d < 0 for d in self.global_shape) or any(o < 0 for o in self.offset):
            raise CheckpointError(f"{where}: negative global shape {list(self.global_shape)} or offset "
                                  f"{list(self.offset)}")
        if any(o + n > d for o, n, d in zip(self.offset, local_shape, self.global_shape)):
            raise CheckpointError(f"{where}: local shape {list(local_shape)} at offset {list(self.offset)} "
                                  f"exceeds the global shape {list(self.global_shape)}")


@dataclass(frozen=True)
class Box:
    """One stored piece of a tensor: the slice at `offset` of extent `shape`, stored under `key` in `file`."""

    file: str
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorEntry:
    """A global tensor of the checkpoint and the boxes that store it."""

    dtype: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and sha256 (hex) of one file, as written."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Index:
    """The contents of ``index.json``. States are in their JSON encoding (see `paratrain.checkpoint.state`)."""

    step: int
    world_size: int
    tensors: dict[str, TensorEntry]
    shared_state: dict[str, Any]
    rank_state: dict[int, dict[str, Any]]

    def to_json(self) -> str:
        tensors = {
            name: {"dtype": t.dtype, "global_shape": list(t.global_shape),
                   "boxes": [{"file": b.file, "key": b.key, "offset": list(b.offset), "shape": list(b.shape)}
                             for b in t.boxes]}
            for name, t in self.tensors.items()
        }
        return _dump_lines({
            "format": "paratrain-checkpoint", "version": FORMAT_VERSION, "step": self.step,
            "world_size": self.world_size, "tensors": tensors, "shared_state": self.shared_state,
            "rank_state": {str(r): s for r, s in sorted(self.rank_state.items())},
        })

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Index:
        """Parse ``index.json``; `where` (e.g. ``step-00000008/index.json``) prefixes every error."""
        doc = _load_document(text, where, "paratrain-checkpoint")
        tensors = {}
        for name, entry in _get(doc, "tensors", dict, where).items():
            at = f"{where}: tensor {name!r}"
            dtype = _get(entry, "dtype", str, at)
            if dtype not in DTYPES:
                raise CorruptCheckpointError(f"{at}: unknown dtype {dtype!r}")
            global_shape = _shape(_get(entry, "global_shape", list, at), f"{at} global_shape")
            boxes = tuple(_box(b, global_shape, f"{at} box {i}") for i, b in enumerate(_get(entry, "boxes", list, at)))
            tensors[name] = TensorEntry(dtype, global_shape, boxes)
        rank_state = {}
        for key, value in _get(doc, "rank_state", dict, where).items():
            if not key.isdigit():
                raise CorruptCheckpointError(f"{where}: rank_state key {key!r} is not a rank number")
            rank_state[int(key)] = value
        return cls(step=_get(doc, "step", int, where), world_size=_get(doc, "world_size", int, where),
                   tensors=tensors, shared_state=_get(doc, "shared_state", dict, where), rank_state=rank_state)


@dataclass(frozen=True)
class Manifest:
    """The contents of ``manifest.json``, the commit marker: every file of the checkpoint and its digest."""

    step: int
    files: dict[str, FileDigest]

    def to_json(self) -> str:
        files = {name: {"size": d.size, "sha256": d.sha256} for name, d in sorted(self.files.items())}
        return _dump_lines({"format": "paratrain-checkpoint-manifest", "version": FORMAT_VERSION,
                            "step": self.step, "files": files})

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """Parse ``manifest.json``; `where` prefixes every error."""
        doc = _load_document(text, where, "paratrain-checkpoint-manifest")
        files = {}
        for name, digest in _get(doc, "files", dict, where).items():
            at = f"{where}: file {name!r}"
            if not _plain_name(name.removeprefix(ASSETS_DIR + "/")):
                raise CorruptCheckpointError(f"{at} is not a plain file name (or one under {ASSETS_DIR}/)")
            size, sha = _get(digest, "size", int, at), _get(digest, "sha256", str, at)
            if size < 0 or not re.fullmatch(r"[0-9a-f]{64}", sha):
                raise CorruptCheckpointError(f"{at}: bad size {size} or sha256 {sha!r}")
            files[name] = FileDigest(size, sha)
        return cls(step=_get(doc, "step", int, where), files=files)


def _dump_lines(doc: dict) -> str:
    """JSON with one line per top-level field and per entry of a nested object (one tensor, one file, one rank)."""
    def compact(value: Any) -> str:
        return json.dumps(value, separators=(", ", ": "), allow_nan=False)

    lines = []
    for key, value in doc.items():
        if isinstance(value, dict) and value and key != "shared_state":
            inner = ",\n".join(f"  {compact(k)}: {compact(v)}" for k, v in value.items())
            lines.append(f" {compact(key)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {compact(key)}: {compact(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _load_document(text: str | bytes, where: str, kind: str) -> dict:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != kind:
        raise CorruptCheckpointError(f"{where} is not a {kind} file (no \"format\": \"{kind}\")")
    version = _get(doc, "version", int, where)
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(f"{where} has format version {version}, newer than this paratrain reads "
                                     f"({FORMAT_VERSION}); upgrade paratrain")
    return doc


def _get(doc: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if key not in doc:
        raise CorruptCheckpointError(f"{where}: field {key!r} is missing")
    value = doc[key]
    # bool is an int in Python, never in this format.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptCheckpointError(f"{where}: field {key!r} must be a JSON {kind.__name__}, got {value!r:.60}")
    return value


def _shape(value: list, where: str) -> tuple[int, ...]:
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise CorruptCheckpointError(f"{where}: {value!r:.60} is not a list of non-negative ints")
    return tuple(value)


def _box(doc: Any, global_shape: tuple[int, ...], where: str) -> Box:
    offset = _shape(_get(doc, "offset", list, where), f"{where} offset")
    shape = _shape(_get(doc, "shape", list, where), f"{where} shape")
    if len(offset) != len(global_shape) or len(shape) != len(global_shape) or any(
            o + n > d for o, n, d in zip(offset, shape, global_shape)):
        raise CorruptCheckpointError(f"{where}: offset {list(offset)} shape {list(shape)} does not fit the "
                                     f"global shape {list(global_shape)}")
    file = _get(doc, "file", str, where)
    if not _plain_name(file):
        raise CorruptCheckpointError(f"{where}: file {file!r} is not a plain file name")
    return Box(file, _get(doc, "key", str, where), offset, shape)


def _plain_name(name: str) -> bool:
    """A file name inside the checkpoint directory (never a path leading out of it)."""
    return Path(name).name == name and name not in ("", ".", "..")
