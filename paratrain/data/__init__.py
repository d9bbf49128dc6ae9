"""Data path: tokenizers, text corpora, token datasets and the data-parallel sampler.

The pieces, in the order one training step uses them:

- ``load_tokenizer`` gives a ``ByteTokenizer`` or ``BPETokenizer``;
- ``build_dataset`` turns a corpus (the interpreter's own standard library by
  default, text files, or a directory written by ``prepare_corpus``) into one
  token stream, split into train and held-out ``SequenceDataset``s;
- ``DataSampler`` decides which sample indices each data rank reads at each
  step; the global order depends only on the seed, never on the number of
  data ranks, so any layout sees the same global batches and resume is exact.
"""

from paratrain.errors import ParatrainError


class DataError(ParatrainError, ValueError):
    """Bad data configuration or input (a path, a tokenizer spec, a batch size)."""


# DataError is defined before these imports because the submodules import it
# from this package while it is still initializing.
from paratrain.data.tokenizer import (  # noqa: E402
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
)
from paratrain.data.corpus import (  # noqa: E402
    default_corpus_files,
    iter_texts,
    resolve_text_files,
)
from paratrain.data.dataset import (  # noqa: E402
    SequenceDataset,
    TokenStream,
    build_dataset,
    split_train_eval,
)
from paratrain.data.sampler import DataSampler  # noqa: E402
from paratrain.data.prepare import prepare_corpus  # noqa: E402

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
