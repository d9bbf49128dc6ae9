"""Corpora already preprocessed for Megatron-LM: its indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read as it is.

The format (Megatron-Core's ``IndexedDataset``, "MMIDIDX"): ``PREFIX.bin`` holds every sequence's token ids one
after another, in one integer dtype; ``PREFIX.idx`` describes them:

    9 bytes   b"MMIDIDX\\x00\\x00"
    <Q        version, 1
    <B        dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q        sequence count S
    <Q        document count D (entries of the document index)
    int32[S]  sequence lengths (tokens)
    int64[S]  sequence pointers (byte offsets into PREFIX.bin)
    int64[D]  document index (the sequence each document starts at, and S at the end)

The token stream paratrain trains on is the .bin as it is, memory-mapped: Megatron's preprocessing appends the end
of document token (--append-eod), so documents are separated as in paratrain's own prepared corpora. The
tokenizer is the one the corpus was made with (`--tokenizer FILE`): every id must be below its vocabulary.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from paratrain.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_INTEGER_CODES = (1, 2, 3, 4, 5, 8)


def megatron_prefix(data: str | Path | None) -> Path | None:
    """The prefix of a Megatron indexed dataset that `data` names (PREFIX, PREFIX.bin or PREFIX.idx), else None."""
    if data is None:
        return None
    path = Path(str(data))
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if prefix.with_suffix(".idx").is_file() and prefix.with_suffix(".bin").is_file():
        return prefix
    return None


def read_index(prefix: Path) -> dict:
    """The header and arrays of PREFIX.idx; DataError in one line for a file that is not one."""
    path = prefix.with_suffix(".idx")
    data = path.read_bytes()
    if data[:9] != MAGIC:
        raise DataError(f"{path}: not a Megatron index (magic {data[:9]!r}, expected {MAGIC!r})")
    if len(data) < 34:
        raise DataError(f"{path}: truncated header ({len(data)} bytes)")
    version, code = struct.unpack_from("<QB", data, 9)
    if version != VERSION:
        raise DataError(f"{path}: version {version}; paratrain reads Megatron's indexed dataset version {VERSION}")
    if code not in _INTEGER_CODES:
        raise DataError(f"{path}: dtype code {code} is not an integer token type; a token corpus needs one")
    sequences, documents = struct.unpack_from("<QQ", data, 18)
    offset = 34
    need = offset + 4 * sequences + 8 * sequences + 8 * documents
    if len(data) < need:
        raise DataError(f"{path}: {len(data)} bytes, but its header describes {sequences} sequences and {documents} "
                        f"document entries ({need} bytes)")
    lengths = np.frombuffer(data, np.int32, sequences, offset)
    pointers = np.frombuffer(data, np.int64, sequences, offset + 4 * sequences)
    document_index = np.frombuffer(data, np.int64, documents, offset + 12 * sequences)
    return {"dtype": np.dtype(DTYPES[code]), "lengths": lengths, "pointers": pointers,
            "document_index": document_index}


def open_megatron(prefix: Path, vocab_size: int) -> np.ndarray:
    """PREFIX.bin memory-mapped as the token stream (unsigned, as paratrain's streams are), checked against the
    index (size, contiguous sequences) and against `vocab_size` (every id below it)."""
    index = read_index(prefix)
    dtype = index["dtype"]
    path = prefix.with_suffix(".bin")
    tokens = int(index["lengths"].astype(np.int64).sum())
    if path.stat().st_size != tokens * dtype.itemsize:
        raise DataError(f"{path}: {path.stat().st_size} bytes, but {prefix.with_suffix('.idx').name} describes "
                        f"{tokens} {dtype.name} tokens")
    starts = np.concatenate(([0], np.cumsum(index["lengths"].astype(np.int64))[:-1])) * dtype.itemsize
    if not np.array_equal(index["pointers"], starts):
        raise DataError(f"{path}: its sequences are not stored one after another; paratrain reads the .bin as one "
                        f"token stream")
    stream = np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r") if tokens else np.empty(0, dtype)
    if dtype.kind == "i":  # ids are never negative: the same bits as unsigned
        stream = stream.view(np.dtype(f"<u{dtype.itemsize}"))
    largest = max((int(stream[i:i + (1 << 24)].max()) for i in range(0, len(stream), 1 << 24)), default=-1)
    if largest >= vocab_size:
        raise DataError(f"{path}: token id {largest} is not below the tokenizer's vocabulary of {vocab_size}; pass "
                        f"--tokenizer the tokenizer.json the corpus was made with")
    return stream
