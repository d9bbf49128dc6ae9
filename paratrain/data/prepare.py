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
import dataclasses
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
from paratrain.data.chat import (ChatEncoder, ChatOptions, Encoded, detect_format, load_chat_template, record_batches,
                                 status_counts)
from paratrain.data.sources import HubDataset, documents, is_record_file, is_saved_dataset, records
from paratrain.data.tokenizer import BPE_FILE, BYTE_FILE, Tokenizer, load_tokenizer, tokenizer_from_file

META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.bin"
_PARALLELISM = "TOKENIZERS_PARALLELISM"  # the BPE library's switch between its own threads and one
PROGRESS_FILE = "progress.json"  # in a resumable prepare's .partial directory: the input files it finished
FORMAT = "paratrain.tokens"
MASK_FILE = "mask.bin"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1: no documents.bin; 2: no mask.bin (every token a target)

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
    template puts around a document and followed by eos (`document_affixes`); `encode_batches` for `workers`."""
    for encoded in encode_batches(TextEncoder(tokenizer, dtype), _text_batches(texts), workers):
        yield encoded.tokens, encoded.lengths


def encode_batches(encoder: Callable[[list], Encoded], batches: Iterable[list], workers: int = 0) -> Iterator[Encoded]:
    """``encoder`` (a `TextEncoder` or a `paratrain.data.chat.ChatEncoder`) over ``batches``, in order.

    ``workers``: 0, this process with the tokenizer library's own threads (as many as cores); 1, this process
    on one thread; N > 1, N spawned processes of one thread each, whose batches come back in order. The
    tokens do not depend on it.
    """
    if workers > 1:
        yield from _encode_in_workers(encoder, iter(batches), workers)
        return
    for batch in batches:
        with _one_thread(workers == 1):
            encoded = encoder(batch)
        yield encoded


class TextEncoder:
    """Texts to tokens, each between the tokenizer template's affixes and followed by eos; every token a target."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype):
        self.tokenizer, self.dtype, self.affixes = tokenizer, np.dtype(dtype), document_affixes(tokenizer, dtype)

    def __call__(self, texts: Sequence[str]) -> Encoded:
        before, after = self.affixes
        parts, lengths = [], []
        for ids in self.tokenizer.encode_batch(texts):
            parts += [before, ids, after]
            lengths.append(len(before) + len(ids) + len(after))
        return Encoded(np.concatenate(parts).astype(after.dtype, copy=False), np.asarray(lengths, dtype=np.int64))


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


_WORKER_ENCODER = None


def _worker_start(encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder
    os.environ[_PARALLELISM] = "false"  # one thread per worker: the workers are the parallelism


def _worker_encode(batch: list) -> Encoded:
    return _WORKER_ENCODER(batch)


def _encode_in_workers(encoder, batches: Iterator[list], workers: int) -> Iterator[Encoded]:
    """The batches encoded by `workers` spawned processes (a fork after the tokenizer's own threads ran can
    deadlock), at most two batches per worker in flight, so memory stays bounded; results in input order, so the
    stream does not depend on `workers`. A worker that dies ends the run with an error, not a hang."""
    import collections
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                               initargs=(encoder,))
    try:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_worker_encode, batch))
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
                   overwrite: bool = False, progress: bool = True, text_key: str = "text", workers: int = 0,
                   chat: ChatOptions | None = None) -> Path:
    """Tokenize the corpus ``data`` (None/"default", a file, directory or glob of text or record files, or a saved
    dataset) into ``out_dir``, with ``workers`` (`encode_batches`: 0, this process and the tokenizer library's
    threads, the fastest on 2 cores in `benchmarks/bench_prepare.py`); the result does not depend on how many.
    ``chat``: how chat records become tokens and a loss mask (`paratrain.data.chat`; default: detected).

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
                   workers=workers, resumable=True, chat=chat)
    return out_dir


def data_format(files: Sequence[Path], chat: ChatOptions) -> str:
    """'chat' or 'text': as `chat.format` says, or detected from the first record of the first file."""
    if chat.format != "auto":
        return chat.format
    first = files[0] if files else None
    if first is None or not (isinstance(first, HubDataset) or is_record_file(Path(first)) or is_saved_dataset(Path(first))):
        return "text"
    return detect_format(next(iter(records(first)), (None, ""))[0])


def source_format(data: str, chat: ChatOptions) -> str:
    """'chat' or 'text' of one --data source without tokenizing it: a prepared directory's meta.json says, a corpus's
    first record tells (`data_format`); a hub dataset or Megatron's files count as text until they are read."""
    if is_prepared_dir(data):
        return _read_meta(Path(data)).get("data_format", "text")
    if chat.format != "auto":
        return chat.format
    if data == "default" or str(data).startswith("hf:"):
        return "text"
    try:
        files, _ = corpus_files(data)
    except DataError:
        return "text"  # not a corpus of files (Megatron's PREFIX): its tokens are text
    return data_format(files, chat)


def make_encoder(tokenizer: Tokenizer, tokenizer_spec: str, fmt: str, chat: ChatOptions):
    """The encoder of one format: `TextEncoder`, or a `ChatEncoder` with the template of the --tokenizer
    directory (or --chat-template); chat data whose tokenizer has no template and whose records need one is
    refused at its first such record."""
    dtype = token_dtype(tokenizer.vocab_size)
    if fmt == "text":
        return TextEncoder(tokenizer, dtype)
    directory = Path(tokenizer_spec) if tokenizer_spec and Path(tokenizer_spec).exists() else None
    template = load_chat_template(directory, chat.chat_template)
    if template is not None and hasattr(tokenizer, "chat_template"):
        tokenizer.chat_template = template  # what the data is rendered with travels with the tokenizer (--chat-template)
    return ChatEncoder(tokenizer, template, chat, dtype)


def encode_files(encoder, files: Sequence[Path], text_key: str, workers: int = 0, *, first: int = 1,
                 ends: list | None = None, items_before: int = 0) -> Iterator[Encoded]:
    """The documents of ``files`` encoded (texts; chat records for a `ChatEncoder`), in order, in batches.

    ``ends``: (file number, items read through its end) is appended as the reading finishes each file, the
    files numbered from ``first`` and the items counted from ``items_before``.
    """
    chat = isinstance(encoder, ChatEncoder)

    def items():
        count = items_before
        for i, path in enumerate(files, start=first):
            for item in records(path) if chat else documents(path, text_key):
                count += 1
                yield item
            if ends is not None:
                ends.append((i, count))
    return encode_batches(encoder, record_batches(items()) if chat else _text_batches(items()), workers)


def write_prepared(files: Sequence[Path], source: str, tokenizer_spec: str, out_dir: Path, *,
                   progress: bool = True, replace: bool = False, text_key: str = "text", workers: int = 0,
                   resumable: bool = False, chat: ChatOptions | None = None) -> None:
    """Write a prepared directory for ``files``; if another process commits it first, keep theirs.

    ``resumable``: the work goes to ``.OUT.partial`` beside ``out_dir``, which records after each input file
    the tokens and documents it holds (`PROGRESS_FILE`); a run that stops (killed, a bad record) leaves it,
    and the next run for the same files, tokenizer, text key and chat options continues after the last finished
    file.
    """
    chat = chat or ChatOptions()
    fmt = data_format(files, chat)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if resumable:
        tmp = out_dir.parent / f".{out_dir.name}.partial"
        key = {"files": [file_stamp(f)[0] for f in files], "tokenizer_spec": tokenizer_spec, "text_key": text_key,
               **({"chat": dataclasses.asdict(chat)} if fmt == "chat" else {})}
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
        encoder = make_encoder(tokenizer, tokenizer_spec, fmt, chat)
        tokenizer_file = tokenizer.save(tmp).name
        record = _progress_recorder(tmp, key, tokenizer_file, files, resume) if resumable else None
        num_tokens, num_documents, counts = _write_tokens(tmp, encoder, files, progress, text_key, workers, resume,
                                                          record)
        if num_documents == 0:
            raise DataError(f"data {source}: no documents (empty files, no records"
                            + (", or no conversation with an assistant turn" if fmt == "chat" else "")
                            + "); check the source")
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "dtype": token_dtype(tokenizer.vocab_size).name, "num_tokens": num_tokens,
            "num_documents": num_documents, "documents_file": DOCUMENTS_FILE, "eos_id": tokenizer.eos_id,
            "document_template": [list(tokenizer.document_prefix), list(tokenizer.document_suffix)],
            "tokenizer_spec": absolute_spec(tokenizer_spec), "tokenizer": tokenizer.spec,
            "tokenizer_file": tokenizer_file, "source": source, "text_key": text_key,
            "data_format": fmt, "mask_file": MASK_FILE if fmt == "chat" else None,
            **({"chat": {**dataclasses.asdict(chat), "template": encoder.template.source if encoder.template else None,
                         **counts}} if fmt == "chat" else {}),
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
    """A function that records, durably, that the first `files_done` input files are in the output files (each
    flushed and fsynced first, then the progress file replaced atomically): (files_done, tokens, documents, items
    read, counts, *outputs). Each finished file's stamp is taken once, as it is recorded (a resumed run keeps the
    stamps it was resumed with, so a corpus of many shards is not stat'ed over and over).
    """
    stamps = list(resume["stamps"]) if resume else []

    def record(files_done: int, num_tokens: int, num_documents: int, num_items: int, counts: dict, *outputs) -> None:
        for f in outputs:
            f.flush()
            os.fsync(f.fileno())
        stamps.extend(file_stamp(f) for f in files[len(stamps):files_done])
        state = {"key": key, "tokenizer_file": tokenizer_file, "files_done": files_done, "num_tokens": num_tokens,
                 "num_documents": num_documents, "num_items": num_items, "counts": counts, "stamps": stamps}
        part = tmp / f".{PROGRESS_FILE}.tmp"
        part.write_text(json.dumps(state) + "\n")
        os.replace(part, tmp / PROGRESS_FILE)
    return record


def _write_tokens(directory: Path, encoder, files: Sequence[Path], progress: bool, text_key: str, workers: int,
                  resume: dict | None = None, record=None) -> tuple[int, int, dict]:
    """Append the documents of ``files``, encoded, to tokens.bin (and their loss mask to mask.bin, one byte per
    token, for chat) and each document's first token's position to documents.bin (int64, one more at the end: the
    number of tokens); return (tokens, documents, what became of chat records: `status_counts`).

    From `resume` (a `.partial` directory's progress) the files are cut back to the last finished input file
    and the inputs after it are read; `record` is called as each input file's last document is written.
    """
    dtype = encoder.dtype
    done = resume["files_done"] if resume else 0
    num_tokens, num_documents = (resume["num_tokens"], resume["num_documents"]) if resume else (0, 0)
    num_items = resume.get("num_items", num_documents) if resume else 0
    counts = dict(resume.get("counts") or {}) if resume else {}
    bar = tqdm(desc="preparing", unit="tok", unit_scale=True, file=sys.stderr, delay=1.0, disable=not progress,
               initial=num_tokens)
    ends: list = []  # (files finished, items up to their end), as the reading passes them
    chat = isinstance(encoder, ChatEncoder)
    mode = "r+b" if resume else "wb"
    with contextlib.ExitStack() as stack:
        tokens_out, docs_out = (stack.enter_context(open(directory / name, mode)) for name in (TOKENS_FILE,
                                                                                               DOCUMENTS_FILE))
        mask_out = stack.enter_context(open(directory / MASK_FILE, mode)) if chat else None
        outputs = [f for f in (tokens_out, docs_out, mask_out) if f is not None]
        for out, size in ((tokens_out, num_tokens * dtype.itemsize), (docs_out, num_documents * 8),
                          (mask_out, num_tokens)):
            if out is not None:
                out.truncate(size)
                out.seek(size)
        for encoded in encode_files(encoder, files[done:], text_key, workers, first=done + 1, ends=ends,
                                    items_before=num_items):
            lengths, kept = encoded.lengths, encoded.lengths > 0
            encoded.tokens.astype(dtype.newbyteorder("<"), copy=False).tofile(tokens_out)
            if mask_out is not None:
                encoded.mask.astype(np.uint8, copy=False).tofile(mask_out)
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            documents_before = np.concatenate(([0], np.cumsum(kept)))
            (num_tokens + offsets[:-1][kept]).astype("<i8").tofile(docs_out)
            while record and ends and ends[0][1] <= num_items + len(lengths):  # an input file is all written
                files_done, at = ends.pop(0)
                j = at - num_items
                record(files_done, int(num_tokens + offsets[j]), int(num_documents + documents_before[j]), at,
                       _add_counts(counts, encoded.status, j), *outputs)
            counts = _add_counts(counts, encoded.status, len(lengths))
            num_tokens += len(encoded.tokens)
            num_documents += int(kept.sum())
            num_items += len(lengths)
            bar.update(len(encoded.tokens))
            bar.set_postfix(documents=num_documents, refresh=False)
        np.asarray([num_tokens], dtype="<i8").tofile(docs_out)
    bar.close()
    return num_tokens, num_documents, counts if chat else {}


def _add_counts(counts: dict, status: np.ndarray | None, upto: int) -> dict:
    """`counts` plus the `status_counts` of the first `upto` items of a batch."""
    if status is None:
        return counts
    more = status_counts(status[:upto])
    return {name: counts.get(name, 0) + more[name] for name in more}


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


def open_mask(directory: str | Path, meta: dict) -> np.ndarray | None:
    """The loss mask of a prepared directory (uint8 per token, 1: a target), memory-mapped; None where every token
    is a target (text, and every directory of format version 1 or 2)."""
    if not meta.get("mask_file"):
        return None
    path = Path(directory) / meta["mask_file"]
    if not path.is_file() or path.stat().st_size != meta["num_tokens"]:
        raise DataError(f"{str(path)!r} is missing or does not hold one byte per token; prepare the corpus again")
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(meta["num_tokens"],)) if meta["num_tokens"] else \
        np.empty(0, dtype=np.uint8)


def open_documents(directory: str | Path, meta: dict) -> np.ndarray | None:
    """Where each document of a prepared directory starts, and the number of tokens at the end (int64); None for
    format version 1, which has no documents.bin."""
    path = Path(directory) / meta.get("documents_file", DOCUMENTS_FILE)
    if "documents_file" not in meta or not path.is_file():
        return None
    return np.fromfile(path, dtype="<i8")


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
