"""Token streams and the fixed-length samples cut from them.

All documents of a corpus are concatenated into one token stream, each
followed by eos. Sample ``i`` of a ``SequenceDataset`` is the window
``tokens[i*S : i*S + S + 1]``: its first S tokens are the inputs, its last S
the labels (the next token at each position). Consecutive samples share one
boundary token, so no token goes unpredicted. The held-out split is the tail
of the stream, so train and eval never share text.
"""

from __future__ import annotations

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
from paratrain.data.corpus import corpus_files
from paratrain.data.megatron import megatron_prefix, open_megatron
from paratrain.data.prepare import (
    file_stamp,
    is_prepared_dir,
    open_prepared,
    token_dtype,
    tokenize_files,
    training_texts,
    write_prepared,
)
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

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Stream position one past the last token."""
        return self.start + len(self.tokens)

    def slice(self, lo: int, hi: int) -> "TokenStream":
        """Tokens ``[lo, hi)`` of this piece (a view: a memmap stays unread)."""
        return TokenStream(self.tokens[lo:hi], self.start + lo)


class SequenceDataset:
    """Samples of ``seq_len`` inputs and ``seq_len`` next-token labels cut from a token stream."""

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int):
        _check_seq_len(seq_len)
        self.stream = tokens if isinstance(tokens, TokenStream) else TokenStream(np.asarray(tokens))
        assert self.stream.tokens.ndim == 1, "a token stream is 1-D"
        self.seq_len = seq_len
        self._window = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids[S], labels[S]) of sample ``index``, int64."""
        inputs, labels = self.get_batch([index])
        return inputs[0], labels[0]

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs[B, S], labels[B, S]) int64 for the sample ``indices``, in that order."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)}): {idx.min()}..{idx.max()}")
        # One fancy-index read of all windows: a memmap reads only these pages.
        windows = self.stream.tokens[idx[:, None] * self.seq_len + self._window]
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len={seq_len!r} must be a positive integer")


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
                  *, eval_fraction: float = 0.02, progress: bool = True,
                  text_key: str = "text") -> tuple[SequenceDataset, SequenceDataset, Tokenizer]:
    """(train, eval, tokenizer) for the corpus ``data``.

    ``data``: None or ``"default"`` (the interpreter's standard library), a
    directory written by ``prepare_corpus`` (memory-mapped; its own tokenizer
    is used and ``tokenizer_spec`` must match it or be ``"auto"``), or a text
    file, directory or glob (tokenized in memory). With ``cache_dir``, text
    corpora are prepared once into ``cache_dir`` and memory-mapped from there
    on, keyed by the files (path, size, mtime) and the tokenizer spec.
    """
    _check_seq_len(seq_len)
    stream, tokenizer = load_token_stream(data, tokenizer_spec, cache_dir, progress=progress, text_key=text_key)
    train, held_out = split_train_eval(stream, eval_fraction, seq_len=seq_len)
    return SequenceDataset(train, seq_len), SequenceDataset(held_out, seq_len), tokenizer


def load_token_stream(data: str | Path | None, tokenizer_spec: str, cache_dir: str | Path | None = None, *,
                      progress: bool = True, text_key: str = "text") -> tuple[TokenStream, Tokenizer]:
    """The whole token stream of ``data`` and its tokenizer (see ``build_dataset``)."""
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
    if cache_dir is not None:
        entry = Path(cache_dir) / _cache_key(files, tokenizer_spec, text_key)
        if not is_prepared_dir(entry):
            write_prepared(files, source, tokenizer_spec, entry, progress=progress, text_key=text_key)
        return _open_prepared_stream(entry, tokenizer_spec)
    tokenizer = load_tokenizer(tokenizer_spec, train_texts=training_texts(files, progress=progress, text_key=text_key))
    chunks = list(tokenize_files(tokenizer, files, progress=progress, text_key=text_key))
    tokens = np.concatenate(chunks) if chunks else np.empty(0, dtype=token_dtype(tokenizer.vocab_size))
    return TokenStream(tokens), tokenizer


def _open_prepared_stream(directory: Path, tokenizer_spec: str) -> tuple[TokenStream, Tokenizer]:
    tokens, meta, tokenizer = open_prepared(directory)
    stored = meta["tokenizer_spec"]
    if tokenizer_spec not in ("auto", stored) and not _same_file(tokenizer_spec, stored):
        raise DataError(f"data={str(directory)!r} was prepared with tokenizer={stored!r}; "
                        f"set tokenizer to {stored!r} or 'auto'")
    return TokenStream(tokens), tokenizer


def _same_file(a: str, b: str) -> bool:
    """Whether two tokenizer specs are paths to one existing file or directory."""
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _cache_key(files: Sequence[Path], tokenizer_spec: str, text_key: str = "text") -> str:
    """Directory name of a cache entry: changes when any file, the tokenizer or the text key changes."""
    digest = hashlib.sha256()
    spec_path = Path(tokenizer_spec)
    spec_stat = file_stamp(spec_path) if spec_path.exists() else None
    digest.update(json.dumps([tokenizer_spec, spec_stat] + ([text_key] if text_key != "text" else [])).encode())
    for f in files:
        digest.update(json.dumps(file_stamp(f)).encode())
    tag = "file" if spec_stat else re.sub(r"[^A-Za-z0-9]+", "-", tokenizer_spec)[:24]
    return f"{tag}-{digest.hexdigest()[:16]}"
