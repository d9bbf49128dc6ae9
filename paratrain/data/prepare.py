"""Text to tokens: in memory, or into a self-describing directory on disk.

A prepared directory holds

- ``tokens.bin``: the token stream as raw little-endian uint16 (vocabularies
  up to 65,536) or uint32, every document between what the tokenizer's template puts around one
  (Llama 3's begin-of-text before it) and followed by eos;
- ``documents.bin``: where each document starts in it (little-endian int64),
  and one more entry, the number of tokens;
- ``meta.json``: dtype, numbers of tokens and documents, tokenizer, source,
  text key, eos id;
- the tokenizer file (``tokenizer.json`` for BPE, ``byte_tokenizer.json``
  for bytes), so the directory alone says how to decode it.

A document is a text file, or one record of a JSON Lines or Parquet file or
of a saved `datasets` dataset (`paratrain.data.sources`). Documents stream
through in batches, tokenized by one process or by `workers` (in order: the
directory does not depend on how many), into a temporary directory that is
renamed into place at the end, so a corpus larger than memory prepares in
bounded memory, and an interrupted run leaves no half-written directory
behind. ``build_dataset`` reads it through ``np.memmap``.
"""

from __future__ import annotations

import contextlib
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
from paratrain.data.sources import HubDataset, documents
from paratrain.data.tokenizer import BPE_FILE, BYTE_FILE, Tokenizer, load_tokenizer, tokenizer_from_file

META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.bin"
_PARALLELISM = "TOKENIZERS_PARALLELISM"  # the BPE library's switch between its own threads and one
PROGRESS_FILE = "progress.json"  # in a resumable prepare's .partial directory: the input files it finished
FORMAT = "paratrain.tokens"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no documents.bin

# Texts are handed to the tokenizer in batches of about this many characters:
# large enough for the BPE library's parallel batch encoding, small enough
# that memory stays bounded whatever the corpus size.
_CHUNK_CHARS = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id below ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode_documents(tokenizer: Tokenizer, texts: Iterable[str], dtype: np.dtype,
                     workers: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, tokens per document) of consecutive batches of ``texts``, each text between what the tokenizer's
    template puts around a document and followed by eos (`document_affixes`).

    ``workers``: 0, this process with the tokenizer library's own threads (as many as cores); 1, this process
    on one thread; N > 1, N spawned processes of one thread each, whose batches come back in order. The
    tokens do not depend on it.
    """
    affixes = document_affixes(tokenizer, dtype)
    if workers > 1:
        yield from _encode_in_workers(tokenizer, _text_batches(texts), affixes, workers)
        return
    for batch in _text_batches(texts):
        with _one_thread(workers == 1):
            encoded = _encode_batch(tokenizer, batch, affixes)
        yield encoded


@contextlib.contextmanager
def _one_thread(enabled: bool):
    """The BPE library encodes a batch on one thread while this is in force (it reads the variable per call)."""
    if not enabled:
        yield
        return
    before = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_PARALLELISM, None)
        else:
            os.environ[_PARALLELISM] = before


def document_affixes(tokenizer: Tokenizer, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(before, after) each document: the tokenizer's template (BOS for Llama 3), and eos after the document
    unless the template already ends with it: every document of a stream ends with eos, where
    --document-mask and the document index find its end."""
    if tokenizer.eos_id is None:
        raise DataError(f"tokenizer {tokenizer.spec} has no end-of-text token (looked for </s>, <|endoftext|>, "
                        "<|end_of_text|>, <|eos|>); add one to its tokenizer.json")
    after = tuple(tokenizer.document_suffix)
    if not after or after[-1] != tokenizer.eos_id:
        after += (tokenizer.eos_id,)
    return np.asarray(tokenizer.document_prefix, dtype=dtype), np.asarray(after, dtype=dtype)


def _text_batches(texts: Iterable[str]) -> Iterator[list[str]]:
    """``texts`` in batches of about `_CHUNK_CHARS` characters."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= _CHUNK_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(tokenizer: Tokenizer, texts: Sequence[str],
                  affixes: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    before, after = affixes
    parts, lengths = [], []
    for ids in tokenizer.encode_batch(texts):
        parts += [before, ids, after]
        lengths.append(len(before) + len(ids) + len(after))
    return np.concatenate(parts).astype(after.dtype, copy=False), np.asarray(lengths, dtype=np.int64)


_WORKER_TOKENIZER: Tokenizer | None = None


def _worker_start(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer
    os.environ[_PARALLELISM] = "false"  # one thread per worker: the workers are the parallelism


def _worker_encode(batch: list[str], affixes: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return _encode_batch(_WORKER_TOKENIZER, batch, affixes)


def _encode_in_workers(tokenizer: Tokenizer, batches: Iterator[list[str]], affixes: tuple[np.ndarray, np.ndarray],
                       workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The batches encoded by `workers` spawned processes (a fork after the tokenizer's own threads ran can
    deadlock), at most two batches per worker in flight, so memory stays bounded; results in input order, so the
    stream does not depend on `workers`. A worker that dies ends the run with an error, not a hang."""
    import collections
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                               initargs=(tokenizer,))
    try:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_worker_encode, batch, affixes))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise DataError("a tokenizing worker process died (out of memory?); try fewer --workers") from None
    finally:
        pool.shutdown(cancel_futures=True)


def tokenize_files(tokenizer: Tokenizer, files: Sequence[Path], *, progress: bool = True, desc: str = "tokenizing",
                   text_key: str = "text") -> Iterator[np.ndarray]:
    """Token chunks of ``files`` in order, with a progress bar (stderr) if it takes over a second."""
    bar = tqdm(files, desc=desc, unit="file", file=sys.stderr, delay=1.0, disable=not progress)
    for tokens, _ in encode_documents(tokenizer, iter_texts(bar, text_key), token_dtype(tokenizer.vocab_size)):
        yield tokens


def training_texts(files: Sequence[Path], *, progress: bool = True,
                   text_key: str = "text") -> Callable[[], Iterator[str]]:
    """``train_texts`` for ``load_tokenizer``: the texts of ``files``, with a progress bar."""
    def texts() -> Iterator[str]:
        bar = tqdm(files, desc="training tokenizer", unit="file", file=sys.stderr, delay=1.0, disable=not progress)
        return iter_texts(bar, text_key)
    return texts


def prepare_corpus(data: str | Path | None, out_dir: str | Path, tokenizer_spec: str = "byte", *,
                   overwrite: bool = False, progress: bool = True, text_key: str = "text", workers: int = 0) -> Path:
    """Tokenize the corpus ``data`` (None/"default", a file, directory or glob of text or record files, or a saved
    dataset) into ``out_dir``, with ``workers`` (`encode_documents`: 0, this process and the tokenizer library's
    threads, the fastest on 2 cores in `benchmarks/bench_prepare.py`); the result does not depend on how many.

    Returns ``out_dir``. With ``"bpe:N"`` the tokenizer is trained on the same
    files first and saved alongside.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"out_dir={str(out_dir)!r} is a file; pass a directory path")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise DataError(f"out_dir={str(out_dir)!r} already exists and is not empty; remove it, choose another "
                        f"--out, or pass --overwrite to replace it")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise DataError(f"workers={workers!r}: use 0 (this process, the library's threads) or a number of processes")
    files, source = corpus_files(data)
    write_prepared(files, source, tokenizer_spec, out_dir, progress=progress, replace=overwrite, text_key=text_key,
                   workers=workers, resumable=True)
    return out_dir


def write_prepared(files: Sequence[Path], source: str, tokenizer_spec: str, out_dir: Path, *,
                   progress: bool = True, replace: bool = False, text_key: str = "text", workers: int = 0,
                   resumable: bool = False) -> None:
    """Write a prepared directory for ``files``; if another process commits it first, keep theirs.

    ``resumable``: the work goes to ``.OUT.partial`` beside ``out_dir``, which records after each input file
    the tokens and documents it holds (`PROGRESS_FILE`); a run that stops (killed, a bad record) leaves it,
    and the next run for the same files, tokenizer and text key continues after the last finished file.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if resumable:
        tmp = out_dir.parent / f".{out_dir.name}.partial"
        key = {"files": [file_stamp(f)[0] for f in files], "tokenizer_spec": tokenizer_spec, "text_key": text_key}
        resume = _resume_point(tmp, key, files)
    else:
        tmp, key, resume = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}", None, None
    tmp.mkdir(exist_ok=resume is not None)
    done = False
    try:
        if resume is not None:
            tokenizer = tokenizer_from_file(tmp / resume["tokenizer_file"])
            print(f"prepare: continuing after {resume['files_done']} of {len(files)} finished file(s) in {tmp}",
                  file=sys.stderr, flush=True)
        else:
            tokenizer = load_tokenizer(tokenizer_spec, train_texts=training_texts(files, progress=progress,
                                                                                  text_key=text_key))
        tokenizer_file = tokenizer.save(tmp).name
        record = _progress_recorder(tmp, key, tokenizer_file, files, resume) if resumable else None
        num_tokens, num_documents = _write_tokens(tmp, tokenizer, files, progress, text_key, workers, resume, record)
        if num_documents == 0:
            raise DataError(f"data {source}: no documents (empty files or no records); check the source")
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "dtype": token_dtype(tokenizer.vocab_size).name, "num_tokens": num_tokens,
            "num_documents": num_documents, "documents_file": DOCUMENTS_FILE, "eos_id": tokenizer.eos_id,
            "document_template": [list(tokenizer.document_prefix), list(tokenizer.document_suffix)],
            "tokenizer_spec": absolute_spec(tokenizer_spec), "tokenizer": tokenizer.spec,
            "tokenizer_file": tokenizer_file, "source": source, "text_key": text_key,
        }
        (tmp / PROGRESS_FILE).unlink(missing_ok=True)
        # meta.json last: its presence marks a complete directory.
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _commit(tmp, out_dir, replace)
        done = True
    finally:
        if tmp.exists() and (done or not resumable):  # a resumable prepare keeps what it finished
            shutil.rmtree(tmp)


def absolute_spec(tokenizer_spec: str) -> str:
    """A tokenizer spec that names a file or directory, made absolute: meta.json is read from wherever a later run
    starts, where a path relative to the directory `prepare` ran in names nothing (or another file)."""
    path = Path(tokenizer_spec).expanduser()
    return str(path.resolve()) if path.exists() else tokenizer_spec


def file_stamp(path: Path | HubDataset) -> list:
    """What identifies an input file's content without reading it: its path, size and modification time (a hub
    dataset: its name, config and split)."""
    if isinstance(path, HubDataset):
        return [str(path)]
    st = Path(path).stat()
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]


def _resume_point(tmp: Path, key: dict, files: Sequence[Path]) -> dict | None:
    """The progress a `.partial` directory recorded for the same inputs (`key`) whose finished files are unchanged
    since, else None (and it is cleared)."""
    try:
        progress = json.loads((tmp / PROGRESS_FILE).read_text())
        finished = [file_stamp(f) for f in files[:progress["files_done"]]]
        if progress["key"] == key and progress["stamps"] == finished and (tmp / progress["tokenizer_file"]).is_file():
            return progress
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if tmp.exists():
        shutil.rmtree(tmp)
    return None


def _progress_recorder(tmp: Path, key: dict, tokenizer_file: str, files: Sequence[Path], resume: dict | None):
    """A function recording that the first `files_done` inputs are in the token files, durably (data first).

    Each finished file is stamped once, as it finishes (a corpus of many shards is not stat'ed over and over).
    """
    stamps = list(resume["stamps"]) if resume else []

    def record(files_done: int, num_tokens: int, num_documents: int, *outputs) -> None:
        for f in outputs:
            f.flush()
            os.fsync(f.fileno())
        stamps.extend(file_stamp(f) for f in files[len(stamps):files_done])
        state = {"key": key, "tokenizer_file": tokenizer_file, "files_done": files_done, "num_tokens": num_tokens,
                 "num_documents": num_documents, "stamps": stamps}
        part = tmp / f".{PROGRESS_FILE}.tmp"
        part.write_text(json.dumps(state) + "\n")
        os.replace(part, tmp / PROGRESS_FILE)
    return record


def _write_tokens(directory: Path, tokenizer: Tokenizer, files: Sequence[Path], progress: bool, text_key: str,
                  workers: int, resume: dict | None = None, record=None) -> tuple[int, int]:
    """Append the documents of ``files``, tokenized, to tokens.bin and each document's first token's position to
    documents.bin (int64, one more at the end: the number of tokens); return (tokens, documents).

    From `resume` (a `.partial` directory's progress) the files are cut back to the last finished input file
    and the inputs after it are read; `record` is called as each input file's last document is written.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    done = resume["files_done"] if resume else 0
    num_tokens, num_documents = (resume["num_tokens"], resume["num_documents"]) if resume else (0, 0)
    bar = tqdm(desc="preparing", unit="tok", unit_scale=True, file=sys.stderr, delay=1.0, disable=not progress,
               initial=num_tokens)
    read, ends = [0], []  # characters read; (files finished, documents up to their end), as the reading passes them

    def texts() -> Iterator[str]:
        count = num_documents
        for i, path in enumerate(files[done:], start=done + 1):
            for text in documents(path, text_key):
                read[0] += len(text)
                count += 1
                yield text
            ends.append((i, count))

    mode = "r+b" if resume else "wb"
    with open(directory / TOKENS_FILE, mode) as tokens_out, open(directory / DOCUMENTS_FILE, mode) as docs_out:
        for out, size in ((tokens_out, num_tokens * dtype.itemsize), (docs_out, num_documents * 8)):
            out.truncate(size)
            out.seek(size)
        for chunk, lengths in encode_documents(tokenizer, texts(), dtype, workers):
            chunk.astype(chunk.dtype.newbyteorder("<"), copy=False).tofile(tokens_out)
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            (num_tokens + offsets[:-1]).astype("<i8").tofile(docs_out)
            while record and ends and ends[0][1] <= num_documents + len(lengths):  # an input file is all written
                files_done, at = ends.pop(0)
                record(files_done, int(num_tokens + offsets[at - num_documents]), at, tokens_out, docs_out)
            num_tokens += len(chunk)
            num_documents += len(lengths)
            bar.update(len(chunk))
            bar.set_postfix(documents=num_documents, MB_per_s=f"{read[0] / 1e6 / max(bar.format_dict['elapsed'], 1e-9):.1f}",
                            refresh=False)
        np.asarray([num_tokens], dtype="<i8").tofile(docs_out)
    bar.close()
    return num_tokens, num_documents


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
    if meta.get("version") not in READABLE_VERSIONS:
        raise DataError(f"{str(path)!r} has format version {meta.get('version')}, this paratrain reads "
                        f"{FORMAT_VERSION}; prepare the corpus again")
    if meta.get("dtype") not in ("uint16", "uint32") or not isinstance(meta.get("num_tokens"), int):
        raise DataError(f"{str(path)!r} has a bad dtype or num_tokens; prepare the corpus again")
    if meta.get("tokenizer_file") not in (BPE_FILE, BYTE_FILE):
        raise DataError(f"{str(path)!r} names no tokenizer file of this directory; prepare the corpus again")
    return meta
