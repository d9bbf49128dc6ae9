"""Token streams and the fixed-length samples cut from them.

All documents of a corpus are concatenated into one token stream, each
followed by eos. Sample ``i`` of a ``SequenceDataset`` is the window
``tokens[i*S : i*S + S + 1]``: its first S tokens are the inputs, its last S
the labels (the next token at each position). Consecutive samples share one
boundary token, so no token goes unpredicted. The held-out split is the tail
of the stream, so train and eval never share text.

Chat data (a stream with a loss mask, `paratrain.data.chat`) is packed instead: sample ``i`` of a
``PackedDataset`` holds whole conversations, as many consecutive ones as fit S + 1 tokens, padded with
end-of-text; a label whose token the mask leaves out (a prompt, the padding) is ``IGNORE_INDEX``, which the
loss skips and the step's token count leaves out. Its held-out split is the last conversations.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from paratrain.errors import DataError
from paratrain.data.chat import ChatOptions, fits
from paratrain.data.corpus import corpus_files
from paratrain.data.megatron import megatron_prefix, open_megatron
from paratrain.data.prepare import (
    data_format,
    encode_files,
    file_stamp,
    is_prepared_dir,
    make_encoder,
    open_documents,
    open_mask,
    open_prepared,
    token_dtype,
    tokenize_files,
    training_texts,
    write_prepared,
)
from paratrain.parallel.contract import IGNORE_INDEX
from paratrain.data.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class TokenStream:
    """A contiguous piece of a corpus's token stream.

    ``tokens`` is a 1-D uint16/uint32 array (in memory or ``np.memmap``);
    ``start`` is the position of ``tokens[0]`` in the whole stream, so pieces
    of one stream can be told apart.
    """

    tokens: np.ndarray
    start: int = 0
    # chat data: 1 where a token is a target (None: every token), and where each document starts (relative to
    # tokens[0]) with the number of tokens at the end
    mask: np.ndarray | None = None
    documents: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Stream position one past the last token."""
        return self.start + len(self.tokens)

    def slice(self, lo: int, hi: int) -> "TokenStream":
        """Tokens ``[lo, hi)`` of this piece (a view: a memmap stays unread), with the documents that start in it."""
        mask = None if self.mask is None else self.mask[lo:hi]
        documents = None
        if self.documents is not None:
            inside = self.documents[(self.documents >= lo) & (self.documents < hi)] - lo
            documents = np.append(inside, hi - lo)
        return TokenStream(self.tokens[lo:hi], self.start + lo, mask, documents)


class _Samples:
    """What both kinds of samples share: one sample by index, and the check of a batch's indices."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids[S], labels[S]) of sample ``index``, int64."""
        inputs, labels = self.get_batch([index])
        return inputs[0], labels[0]

    def targets(self, indices: Sequence[int]) -> np.ndarray:
        """How many labels of each of the samples `indices` the loss counts: every one of a text sample."""
        return np.full(len(self._indices(indices)), self.seq_len, dtype=np.int64)

    def _indices(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)}): {idx.min()}..{idx.max()}")
        return idx


class SequenceDataset(_Samples):
    """Samples of ``seq_len`` inputs and ``seq_len`` next-token labels cut from a token stream."""

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int):
        _check_seq_len(seq_len)
        self.stream = tokens if isinstance(tokens, TokenStream) else TokenStream(np.asarray(tokens))
        assert self.stream.tokens.ndim == 1, "a token stream is 1-D"
        self.seq_len = seq_len
        self._window = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs[B, S], labels[B, S]) int64 for the sample ``indices``, in that order."""
        idx = self._indices(indices)
        # One fancy-index read of all windows: a memmap reads only these pages.
        windows = self.stream.tokens[idx[:, None] * self.seq_len + self._window]
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len={seq_len!r} must be a positive integer")


class PackedDataset(_Samples):
    """Whole conversations packed into samples of ``seq_len`` inputs and labels, the labels of non-targets
    `IGNORE_INDEX` (a prompt, the end-of-text padding that fills a sample).

    Packing is greedy in stream order (a function of the conversations' lengths and ``seq_len`` alone: any
    layout and a resume see the same samples); a conversation longer than a sample (`fits`) is dropped or cut
    to its first seq_len + 1 tokens (``long``), counted in `dropped` and `truncated`.
    """

    def __init__(self, stream: TokenStream, seq_len: int, long: str = "drop"):
        _check_seq_len(seq_len)
        assert stream.mask is not None and stream.documents is not None, "a packed stream carries mask and documents"
        self.stream, self.seq_len, self.long = stream, seq_len, long
        self.pad_id = int(stream.tokens[stream.documents[1] - 1]) if len(stream.documents) > 1 else 0  # an eos
        self.bounds, self.dropped, self.truncated = _pack(stream.documents, stream.mask, seq_len, long)
        self.conversations = len(stream.documents) - 1 - self.dropped
        # each sample's target count: the mask summed after its first token (read once, in one pass)
        before = np.concatenate(([0], np.cumsum(stream.mask, dtype=np.int64)))
        self._targets = before[self.bounds[:, 1]] - before[self.bounds[:, 0] + 1] if len(self.bounds) else \
            np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.bounds)

    def targets(self, indices: Sequence[int]) -> np.ndarray:
        """How many labels of each of the samples `indices` the loss counts (the targets after its first token)."""
        return self._targets[self._indices(indices)]

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs[B, S], labels[B, S]) int64 for the sample ``indices``, in that order."""
        idx = self._indices(indices)
        window = np.full((len(idx), self.seq_len + 1), self.pad_id, dtype=np.int64)
        targets = np.zeros(window.shape, dtype=bool)
        for row, (lo, hi) in enumerate(self.bounds[idx]):
            window[row, :hi - lo] = self.stream.tokens[lo:hi]
            targets[row, :hi - lo] = self.stream.mask[lo:hi]
        labels = np.where(targets[:, 1:], window[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(labels)


def _pack(documents: np.ndarray, mask: np.ndarray, seq_len: int, long: str) -> tuple[np.ndarray, int, int]:
    """([lo, hi) token bounds of each sample, dropped, truncated): consecutive documents while they fit
    seq_len + 1 tokens; one longer than that alone (truncated) or left out (dropped, closing the sample before;
    also a truncated one whose start holds no target: a step of such samples alone would count no token)."""
    bounds, dropped, truncated = [], 0, 0
    lo = hi = None
    for start, end in zip(documents[:-1].tolist(), documents[1:].tolist()):
        if not fits(end - start, seq_len):
            if lo is not None:
                bounds.append((lo, hi))
                lo = None
            if long == "truncate" and mask[start:start + seq_len + 1].any():
                bounds.append((start, start + seq_len + 1))
                truncated += 1
            else:
                dropped += 1
            continue
        if lo is not None and end - lo <= seq_len + 1:
            hi = end
            continue
        if lo is not None:
            bounds.append((lo, hi))
        lo, hi = start, end
    if lo is not None:
        bounds.append((lo, hi))
    return np.asarray(bounds, dtype=np.int64).reshape(-1, 2), dropped, truncated


def split_documents(stream: TokenStream, eval_fraction: float, *, seq_len: int,
                    long: str = "drop") -> tuple[TokenStream, TokenStream]:
    """Split a chat stream into (train, eval) by conversations: eval holds the last ``eval_fraction`` of those that
    train (under ``long="drop"``, those that fit a sequence), at least one; train the rest, at least one."""
    _check_seq_len(seq_len)
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction!r} must be in [0, 1)")
    lengths = np.diff(stream.documents)
    kept = np.flatnonzero([fits(n, seq_len) for n in lengths.tolist()] if long == "drop" else lengths >= 0)
    held = max(math.ceil(len(kept) * eval_fraction), 1)
    if len(kept) - held < 1:
        raise DataError(f"the chat data has {len(kept)} conversation(s) that fit --seq-len {seq_len}, too few for a "
                        f"training and a held-out split; add conversations, raise --seq-len or pass --long truncate")
    cut = int(stream.documents[kept[len(kept) - held]])
    return stream.slice(0, cut), stream.slice(cut, len(stream))


def sequences(stream: TokenStream, seq_len: int, long: str = "drop") -> SequenceDataset | PackedDataset:
    """The samples of a stream: packed conversations for chat data (a mask), fixed windows for text."""
    return PackedDataset(stream, seq_len, long) if stream.mask is not None else SequenceDataset(stream, seq_len)


def split_train_eval(tokens: TokenStream | np.ndarray, eval_fraction: float = 0.02, *,
                     seq_len: int) -> tuple[TokenStream, TokenStream]:
    """Split a stream into (train, eval): eval is the last ``eval_fraction`` of the tokens.

    Eval gets at least one sample of ``seq_len`` and train keeps at least one.
    """
    _check_seq_len(seq_len)
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction!r} must be in [0, 1)")
    stream = tokens if isinstance(tokens, TokenStream) else TokenStream(np.asarray(tokens))
    n = len(stream)
    min_piece = seq_len + 1
    eval_len = max(math.ceil(n * eval_fraction), min_piece)
    if n - eval_len < min_piece:
        raise DataError(f"corpus has {n} tokens, too few for seq_len={seq_len}: train and eval need at least "
                        f"{2 * min_piece}; add data or lower seq_len")
    return stream.slice(0, n - eval_len), stream.slice(n - eval_len, n)


def build_dataset(data: str | Path | None, tokenizer_spec: str, seq_len: int, cache_dir: str | Path | None = None,
                  *, eval_fraction: float = 0.02, progress: bool = True, text_key: str = "text",
                  chat: ChatOptions | None = None) -> tuple[SequenceDataset, SequenceDataset, Tokenizer]:
    """(train, eval, tokenizer) for the corpus ``data``.

    ``data``: None or ``"default"`` (the interpreter's standard library), a
    directory written by ``prepare_corpus`` (memory-mapped; its own tokenizer
    is used and ``tokenizer_spec`` must match it or be ``"auto"``), or a text
    file, directory or glob (tokenized in memory). With ``cache_dir``, text
    corpora are prepared once into ``cache_dir`` and memory-mapped from there
    on, keyed by the files (path, size, mtime) and the tokenizer spec. Chat data (`chat`: detected by default)
    gives `PackedDataset`s, split by conversations.
    """
    _check_seq_len(seq_len)
    chat = chat or ChatOptions()
    stream, tokenizer = load_token_stream(data, tokenizer_spec, cache_dir, progress=progress, text_key=text_key,
                                          chat=chat)
    if stream.mask is not None:
        train, held_out = split_documents(stream, eval_fraction, seq_len=seq_len, long=chat.long)
        return PackedDataset(train, seq_len, chat.long), PackedDataset(held_out, seq_len, chat.long), tokenizer
    train, held_out = split_train_eval(stream, eval_fraction, seq_len=seq_len)
    return SequenceDataset(train, seq_len), SequenceDataset(held_out, seq_len), tokenizer


def load_token_stream(data: str | Path | None, tokenizer_spec: str, cache_dir: str | Path | None = None, *,
                      progress: bool = True, text_key: str = "text",
                      chat: ChatOptions | None = None) -> tuple[TokenStream, Tokenizer]:
    """The whole token stream of ``data`` and its tokenizer (see ``build_dataset``); for chat data with its mask
    and documents."""
    chat = chat or ChatOptions()
    if str(data) != "default" and is_prepared_dir(data):
        return _open_prepared_stream(Path(data), tokenizer_spec)
    prefix = megatron_prefix(data)
    if prefix is not None:  # Megatron's indexed dataset: its tokens as they are, with the tokenizer they came from
        if tokenizer_spec.startswith("bpe:") or tokenizer_spec == "auto":
            raise DataError(f"data={str(data)!r} is a Megatron indexed dataset: pass --tokenizer the tokenizer.json "
                            f"it was made with")
        tokenizer = load_tokenizer(tokenizer_spec)
        return TokenStream(open_megatron(prefix, tokenizer.vocab_size)), tokenizer
    files, source = corpus_files(data)
    fmt = data_format(files, chat)
    if cache_dir is not None:
        entry = Path(cache_dir) / _cache_key(files, tokenizer_spec, text_key, chat if fmt == "chat" else None)
        if not is_prepared_dir(entry):
            write_prepared(files, source, tokenizer_spec, entry, progress=progress, text_key=text_key, chat=chat)
        return _open_prepared_stream(entry, tokenizer_spec)
    tokenizer = load_tokenizer(tokenizer_spec, train_texts=training_texts(files, progress=progress, text_key=text_key))
    if fmt == "chat":
        return _chat_stream(make_encoder(tokenizer, tokenizer_spec, fmt, chat), files, text_key), tokenizer
    chunks = list(tokenize_files(tokenizer, files, progress=progress, text_key=text_key))
    tokens = np.concatenate(chunks) if chunks else np.empty(0, dtype=token_dtype(tokenizer.vocab_size))
    return TokenStream(tokens), tokenizer


def _chat_stream(encoder, files: Sequence[Path], text_key: str) -> TokenStream:
    """Chat records encoded in memory: the tokens, their mask and where each conversation starts."""
    parts = list(encode_files(encoder, files, text_key))
    lengths = np.concatenate([e.lengths[e.lengths > 0] for e in parts]) if parts else np.empty(0, dtype=np.int64)
    if not len(lengths):
        raise DataError(f"chat data {', '.join(map(str, files[:3]))}: no conversation with an assistant turn")
    tokens = np.concatenate([e.tokens for e in parts])
    mask = np.concatenate([e.mask for e in parts])
    return TokenStream(tokens, mask=mask, documents=np.concatenate(([0], np.cumsum(lengths))))


def _open_prepared_stream(directory: Path, tokenizer_spec: str) -> tuple[TokenStream, Tokenizer]:
    tokens, meta, tokenizer = open_prepared(directory)
    stored = meta["tokenizer_spec"]
    if tokenizer_spec not in ("auto", stored) and not _same_file(tokenizer_spec, stored):
        raise DataError(f"data={str(directory)!r} was prepared with tokenizer={stored!r}; "
                        f"set tokenizer to {stored!r} or 'auto'")
    mask = open_mask(directory, meta)
    return TokenStream(tokens, mask=mask, documents=open_documents(directory, meta) if mask is not None else None), \
        tokenizer


def _same_file(a: str, b: str) -> bool:
    """Whether two tokenizer specs are paths to one existing file or directory."""
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _cache_key(files: Sequence[Path], tokenizer_spec: str, text_key: str = "text",
               chat: ChatOptions | None = None) -> str:
    """Directory name of a cache entry: changes when any file, the tokenizer, the text key or the chat options
    change."""
    digest = hashlib.sha256()
    spec_path = Path(tokenizer_spec)
    spec_stat = file_stamp(spec_path) if spec_path.exists() else None
    digest.update(json.dumps([tokenizer_spec, spec_stat] + ([text_key] if text_key != "text" else [])
                             + ([dataclasses.asdict(chat)] if chat else [])).encode())
    for f in files:
        digest.update(json.dumps(file_stamp(f)).encode())
    tag = "file" if spec_stat else re.sub(r"[^A-Za-z0-9]+", "-", tokenizer_spec)[:24]
    return f"{tag}-{digest.hexdigest()[:16]}"
