"""Durable file writes: safetensors shard files, JSON files and the atomic `latest` pointer, each fsynced.

The shard writer streams the safetensors format itself (an 8-byte
little-endian header length, a JSON header of dtype / shape / byte range per
tensor padded with spaces to 8 bytes, then the raw bytes) instead of calling
`safetensors.torch.save_file`, for three reasons: the sha256 of the manifest
is computed from the bytes as they are written (no second read of the file),
a full disk surfaces as Python's ``OSError(ENOSPC)`` with its errno (the
Rust writer reports it as a generic error), and the file is opened with
``O_EXCL`` so nothing is ever overwritten. Files are read back with
`safetensors.safe_open`, which validates what this writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Callable, Iterable

import torch

from paratrain.checkpoint.format import DTYPES, FileDigest, dtype_name

# Files are hashed in pieces of this size, so memory stays flat.
_CHUNK = 8 << 20


def write_shard_file(path: Path, tensors: dict[str, torch.Tensor],
                     before_data: Callable[[], None] | None = None) -> FileDigest:
    """Write `tensors` (key -> tensor) as one safetensors file at `path`, fsync it, return its digest.

    `before_data` runs after the header is written, before any tensor byte:
    the place where fault injection simulates a disk filling up mid-file.
    """
    # Larger elements first, so every tensor starts at a multiple of its
    # element size (the header is padded to 8 bytes): safetensors maps such
    # files without copying.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries = [(key, tensors[key].dtype, tuple(tensors[key].shape)) for key in order]
    return write_safetensors(path, entries, ((key, tensors[key]) for key in order), before_data=before_data)


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
                      before_data: Callable[[], None] | None = None) -> FileDigest:
    """Write a safetensors file whose tensors arrive one at a time as (key, tensor), in `entries` order
    (key, dtype, shape); each is cast to its entry's dtype. fsynced; returns the file's digest.

    The header is made from `entries` alone, so a caller can produce each
    tensor just before it is written (a gathered parameter, a read from a
    checkpoint) and drop it after: memory holds one tensor, never the file.
    """
    header: dict[str, dict] = {"__metadata__": metadata or {"format": "pt"}}
    start = 0
    for key, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPES[dtype_name(dtype)][1], "shape": list(shape), "data_offsets": [start, start + size]}
        start += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    written = 0
    with _naming_errors(path), open(path, "xb") as f:
        for piece in (struct.pack("<Q", len(encoded)), encoded):
            f.write(piece)
            digest.update(piece)
            written += len(piece)
        if before_data is not None:
            before_data()
        for (key, dtype, shape), (arrived, tensor) in zip(entries, tensors, strict=True):
            if arrived != key or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"expected {key} {list(shape)} next, got {arrived} {list(tensor.shape)}")
            data = _raw_bytes(tensor.to(dtype))
            f.write(data)
            digest.update(data)
            written += len(data)
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(written, digest.hexdigest())


@contextlib.contextmanager
def _naming_errors(path: Path):
    """Attach the file name to an OSError that lacks it (write() errors carry none), for the error message."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def write_durable(path: Path, text: str | bytes) -> FileDigest:
    """Write `text` (a str as UTF-8, or bytes) to a new file at `path`, fsync it, return its digest."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    with _naming_errors(path), open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(len(data), hashlib.sha256(data).hexdigest())


def write_atomic(path: Path, text: str) -> None:
    """Replace the file at `path` with `text` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Persist the entries of a directory (creations, renames) on file systems that need it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> FileDigest:
    """Size and sha256 of a file as it is on disk now."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(size, digest.hexdigest())


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap the directories `a` and `b` in one atomic step; return False where the system cannot.

    Linux's renameat2(RENAME_EXCHANGE) (glibc 2.28+, most local file
    systems) is the only call that replaces a non-empty directory with no
    moment where neither is in place; it is reached through ctypes because
    Python's os module does not expose it. False (nothing changed) on other
    systems or file systems, so the caller can fall back to two renames.
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
