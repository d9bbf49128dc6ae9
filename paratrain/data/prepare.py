"""Text to tokens: in memory, or into a self-describing directory on disk.

A prepared directory holds

- ``tokens.bin``: the token stream as raw little-endian uint16 (vocabularies
  up to 65,536) or uint32, every document followed by eos;
- ``meta.json``: dtype, number of tokens, tokenizer, source, eos id;
- the tokenizer file (``tokenizer.json`` for BPE, ``byte_tokenizer.json``
  for bytes), so the directory alone says how to decode it.

It is written file by file into a temporary directory that is renamed into
place at the end, so a corpus larger than memory can be prepared (each
single file must fit), and an interrupted run leaves no half-written
directory behind. ``build_dataset`` reads it through ``np.memmap``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from paratrain.errors import DataError
from paratrain.data.corpus import corpus_files, iter_texts
from paratrain.data.tokenizer import BPE_FILE, BYTE_FILE, Tokenizer, load_tokenizer, tokenizer_from_file

META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
FORMAT = "paratrain.tokens"
FORMAT_VERSION = 1

# Texts are handed to the tokenizer in batches of about this many characters:
# large enough for the BPE library's parallel batch encoding, small enough
# that memory stays bounded whatever the corpus size.
_CHUNK_CHARS = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id below ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode_documents(tokenizer: Tokenizer, texts: Iterable[str], dtype: np.dtype) -> Iterator[np.ndarray]:
    """Token arrays of consecutive batches of ``texts``, each text followed by eos."""
    if tokenizer.eos_id is None:
        raise DataError(f"tokenizer {tokenizer.spec} has no end-of-text token (looked for </s>, <|endoftext|>, "
                        "<|end_of_text|>, <|eos|>); add one to its tokenizer.json")
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= _CHUNK_CHARS:
            yield _encode_batch(tokenizer, batch, eos)
            batch, size = [], 0
    if batch:
        yield _encode_batch(tokenizer, batch, eos)


def _encode_batch(tokenizer: Tokenizer, texts: Sequence[str], eos: np.ndarray) -> np.ndarray:
    parts = []
    for ids in tokenizer.encode_batch(texts):
        parts.append(ids)
        parts.append(eos)
    return np.concatenate(parts).astype(eos.dtype, copy=False)


def tokenize_files(tokenizer: Tokenizer, files: Sequence[Path], *, progress: bool = True,
                   desc: str = "tokenizing") -> Iterator[np.ndarray]:
    """Token chunks of ``files`` in order, with a progress bar (stderr) if it takes over a second."""
    bar = tqdm(files, desc=desc, unit="file", file=sys.stderr, delay=1.0, disable=not progress)
    return encode_documents(tokenizer, iter_texts(bar), token_dtype(tokenizer.vocab_size))


def training_texts(files: Sequence[Path], *, progress: bool = True) -> Callable[[], Iterator[str]]:
    """``train_texts`` for ``load_tokenizer``: the texts of ``files``, with a progress bar."""
    def texts() -> Iterator[str]:
        bar = tqdm(files, desc="training tokenizer", unit="file", file=sys.stderr, delay=1.0, disable=not progress)
        return iter_texts(bar)
    return texts


def prepare_corpus(data: str | Path | None, out_dir: str | Path, tokenizer_spec: str = "byte", *,
                   overwrite: bool = False, progress: bool = True) -> Path:
    """Tokenize the corpus ``data`` (None/"default", a file, directory or glob) into ``out_dir``.

    Returns ``out_dir``. With ``"bpe:N"`` the tokenizer is trained on the same
    files first and saved alongside.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"out_dir={str(out_dir)!r} is a file; pass a directory path")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise DataError(f"out_dir={str(out_dir)!r} already exists and is not empty; remove it or pass overwrite=True")
    files, source = corpus_files(data)
    write_prepared(files, source, tokenizer_spec, out_dir, progress=progress, replace=overwrite)
    return out_dir


def write_prepared(files: Sequence[Path], source: str, tokenizer_spec: str, out_dir: Path, *,
                   progress: bool = True, replace: bool = False) -> None:
    """Write a prepared directory for ``files``; if another process commits it first, keep theirs."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tokenizer = load_tokenizer(tokenizer_spec, train_texts=training_texts(files, progress=progress))
        num_tokens = _write_tokens(tmp / TOKENS_FILE, tokenizer, files, progress)
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "dtype": token_dtype(tokenizer.vocab_size).name, "num_tokens": num_tokens,
            "num_documents": len(files), "eos_id": tokenizer.eos_id,
            "tokenizer_spec": tokenizer_spec, "tokenizer": tokenizer.spec,
            "tokenizer_file": tokenizer.save(tmp).name, "source": source,
        }
        # meta.json last: its presence marks a complete directory.
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _commit(tmp, out_dir, replace)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _write_tokens(path: Path, tokenizer: Tokenizer, files: Sequence[Path], progress: bool) -> int:
    """Append the token chunks of ``files`` to ``path``; return the number of tokens."""
    num_tokens = 0
    with open(path, "wb") as f:
        for chunk in tokenize_files(tokenizer, files, progress=progress, desc="preparing"):
            chunk.astype(chunk.dtype.newbyteorder("<"), copy=False).tofile(f)
            num_tokens += len(chunk)
    return num_tokens


def _commit(tmp: Path, out_dir: Path, replace: bool) -> None:
    """Move the finished ``tmp`` directory to ``out_dir``."""
    if replace and out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
        return
    try:
        # Replaces an empty directory; fails on a non-empty one.
        os.rename(tmp, out_dir)
    except OSError:
        if not (out_dir / META_FILE).is_file():
            raise
        # Another process (e.g. another rank filling the same cache entry)
        # finished first; both wrote the same corpus, keep theirs.


def is_prepared_dir(path: str | Path | None) -> bool:
    """Whether ``path`` is a directory written by ``prepare_corpus``."""
    if path is None:
        return False
    path = Path(path)
    return (path / META_FILE).is_file() and (path / TOKENS_FILE).is_file()


def open_prepared(directory: str | Path) -> tuple[np.ndarray, dict, Tokenizer]:
    """Memory-map a prepared directory: (tokens, meta, tokenizer). Reads no tokens."""
    directory = Path(directory)
    meta = _read_meta(directory)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    num_tokens = meta["num_tokens"]
    path = directory / TOKENS_FILE
    if path.stat().st_size != num_tokens * dtype.itemsize:
        raise DataError(f"{str(path)!r} has {path.stat().st_size} bytes but meta.json says {num_tokens} "
                        f"{dtype.name} tokens; prepare the corpus again")
    if num_tokens == 0:
        tokens = np.empty(0, dtype=dtype)  # np.memmap refuses empty files
    else:
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))
    tokenizer = tokenizer_from_file(directory / meta["tokenizer_file"])
    return tokens, meta, tokenizer


def _read_meta(directory: Path) -> dict:
    path = directory / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {str(path)!r} ({exc}); prepare the corpus again") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{str(path)!r} is not a paratrain token directory; prepare the corpus again")
    if meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{str(path)!r} has format version {meta.get('version')}, this paratrain reads "
                        f"{FORMAT_VERSION}; prepare the corpus again")
    if meta.get("dtype") not in ("uint16", "uint32") or not isinstance(meta.get("num_tokens"), int):
        raise DataError(f"{str(path)!r} has a bad dtype or num_tokens; prepare the corpus again")
    if meta.get("tokenizer_file") not in (BPE_FILE, BYTE_FILE):
        raise DataError(f"{str(path)!r} names no tokenizer file of this directory; prepare the corpus again")
    return meta
