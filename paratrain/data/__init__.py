"""Data path: tokenizers, text corpora, token datasets and the data-parallel sampler.

The pieces, in the order one training step uses them:

- ``load_tokenizer`` gives a ``ByteTokenizer`` or ``BPETokenizer``;
- ``build_dataset`` turns a corpus (the interpreter's own standard library by
  default, text files, or a directory written by ``prepare_corpus``) into one
  token stream, split into train and held-out ``SequenceDataset``s;
- ``DataSampler`` decides which sample indices each data rank reads at each
  step; the global order depends only on the seed, never on the number of
  data ranks, so any layout sees the same global batches and resume is exact.

The dataset module (`build_dataset` and the sequence datasets) imports torch; its names are looked up on
first use (PEP 562), so `paratrain prepare` and its worker processes tokenize without importing torch.
"""

from __future__ import annotations

from paratrain.errors import DataError  # noqa: F401
from paratrain.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
)
from paratrain.data.corpus import (
    default_corpus_files,
    iter_texts,
    resolve_text_files,
)
from paratrain.data.sampler import DataSampler
from paratrain.data.prepare import prepare_corpus
from paratrain.lazy import lazy_getattr

_EXPORTS = {name: "paratrain.data.dataset" for name in ("SequenceDataset", "TokenStream", "build_dataset",
                                                        "split_train_eval")}

__all__ = [
    "DataError",
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "load_tokenizer",
    "default_corpus_files",
    "resolve_text_files",
    "iter_texts",
    "TokenStream",
    "SequenceDataset",
    "split_train_eval",
    "build_dataset",
    "DataSampler",
    "prepare_corpus",
]

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
