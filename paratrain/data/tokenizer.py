"""Tokenizers: raw UTF-8 bytes (no training, no files) and byte-level BPE.

Both satisfy the small ``Tokenizer`` protocol below; the rest of paratrain
uses nothing else. ``load_tokenizer`` turns a config string into one:

- ``"byte"``: ``ByteTokenizer``, ids 0..255 are bytes, then bos/eos/pad;
- ``"bpe:N"``: a byte-level BPE with N tokens trained here on the corpus;
- a path to a ``tokenizer.json`` (or a directory holding one): any local
  Hugging Face ``tokenizers`` file, or a file written by ``save``.

A tokenizer file's BOS and EOS are what its model directory states (``generation_config.json``'s
``bos_token_id`` / ``eos_token_id``, else ``config.json``'s; the first of a list), else the one token
its post-processor puts before (after) a sequence, else a token of a known name (`_BOS_NAMES`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from paratrain.errors import DataError

BPE_FILE = "tokenizer.json"
BYTE_FILE = "byte_tokenizer.json"
CHAT_CONFIG_FILE = "tokenizer_config.json"  # a model directory's, where its chat template is
# A model directory's files that state its BOS and EOS ids, in the order they are read.
SPECIALS_FILES = ("generation_config.json", "config.json")
_BYTE_TYPE = "paratrain.byte"

# Looked up in this order in tokenizer files that someone else trained, so
# that common model families work without configuration.
_BOS_NAMES = ("<|bos|>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[CLS]")
_EOS_NAMES = ("<|eos|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


class Tokenizer(Protocol):
    """What the data path and the trainer need from a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    # What the tokenizer puts around one document (its post-processor's template: BOS, sometimes EOS)
    document_prefix: tuple[int, ...]
    document_suffix: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    @property
    def spec(self) -> dict: ...

    def save(self, directory: str | Path) -> Path: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then bos=256, eos=257, pad=258 (vocab 259)."""

    name = "byte"
    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258
    document_prefix: tuple[int, ...] = ()  # documents are separated by eos alone (`paratrain.data.prepare`)
    document_suffix: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        """Ids of the UTF-8 bytes of ``text`` (unencodable surrogates become '?')."""
        return list(text.encode("utf-8", errors="replace"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One uint8 array per text; no Python loop over characters."""
        return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids, skipping specials; invalid UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).ravel()
        arr = arr[(arr >= 0) & (arr < 256)]
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    @property
    def spec(self) -> dict:
        """JSON description for config.json and meta.json."""
        return {"kind": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}

    def save(self, directory: str | Path) -> Path:
        """Write ``byte_tokenizer.json`` into ``directory``; return its path."""
        path = Path(directory) / BYTE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"type": _BYTE_TYPE, **self.spec}, indent=2) + "\n")
        return path


class BPETokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` behind the ``Tokenizer`` protocol.

    Special tokens are never added by ``encode``; the dataset places them around each document as
    the file's post-processor defines (`document_prefix`, `document_suffix`: Llama 3's
    ``<|begin_of_text|>`` before each document, say), and eos after it.
    """

    name = "bpe"
    SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
    MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

    def __init__(self, backend: HFTokenizer):
        self.backend = backend
        # Text such as "<|endoftext|>" inside a document is encoded as plain
        # text: the only special tokens in a stream are those the dataset
        # places. (The attribute is missing in tokenizers < 0.19.)
        if hasattr(backend, "encode_special_tokens"):
            backend.encode_special_tokens = True
        # Max id + 1 rather than get_vocab_size(): some files leave holes in
        # the id range, and the embedding must cover every id.
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.document_prefix, self.document_suffix = _template_affixes(backend)
        # the post-processor's one token before (after) a sequence, else a token of a known name
        self.bos_id = self.document_prefix[0] if len(self.document_prefix) == 1 else _find_token(backend, _BOS_NAMES)
        self.eos_id = self.document_suffix[0] if len(self.document_suffix) == 1 else _find_token(backend, _EOS_NAMES)
        self.pad_id = _find_token(backend, _PAD_NAMES)
        self.stated: dict[str, int] = {}  # the ids a model directory stated (`stated_specials`), kept by `save`
        # The model directory's chat template (`paratrain.data.chat.ChatTemplate`, with the special tokens it is
        # rendered with), carried wherever the tokenizer is saved: a prepared directory, a run's final/, an export.
        self.chat_template = None

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Train a byte-level BPE with ``vocab_size`` tokens (specials included) on ``texts``.

        Deterministic for the same texts. A small corpus may stop short of
        ``vocab_size`` when no pair is left to merge.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < cls.MIN_VOCAB:
            raise DataError(f"BPE vocab_size={vocab_size!r} is too small; use an integer >= {cls.MIN_VOCAB}")
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(cls.SPECIAL_TOKENS),
            # The full byte alphabet up front: any text stays encodable,
            # even bytes the training corpus never contained.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        return cls(backend)

    @classmethod
    def from_file(cls, path: str | Path) -> "BPETokenizer":
        """Load any local ``tokenizer.json`` written by the ``tokenizers`` library."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist; pass an existing tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"tokenizer file {str(path)!r} is not a valid tokenizer.json ({first_line})") from exc
        tokenizer = cls(backend)
        tokenizer.stated = stated_specials(path.parent, backend)
        tokenizer.bos_id = tokenizer.stated.get("bos_token_id", tokenizer.bos_id)
        tokenizer.eos_id = tokenizer.stated.get("eos_token_id", tokenizer.eos_id)
        from paratrain.data.chat import load_chat_template

        tokenizer.chat_template = load_chat_template(path.parent)  # tokenizer_config.json's or chat_template.jinja
        return tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One uint32 array per text, encoded in parallel by the library."""
        # encode_batch_fast skips offset tracking; older library versions lack it.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, skipping special tokens."""
        ids = np.asarray(ids, dtype=np.int64).ravel().tolist()
        return self.backend.decode(ids, skip_special_tokens=True)

    @property
    def spec(self) -> dict:
        """JSON description for config.json and meta.json."""
        return {"kind": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` into ``directory`` (and its chat template, if it has one, as the
        ``tokenizer_config.json`` of a model directory); return its path."""
        path = Path(directory) / BPE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path))
        if self.stated:  # the ids the model directory stated, stated again beside the copy
            (path.parent / SPECIALS_FILES[0]).write_text(json.dumps(self.stated, indent=2) + "\n")
        if self.chat_template is not None:
            (path.parent / CHAT_CONFIG_FILE).write_text(json.dumps(self.chat_config(), indent=2) + "\n")
        return path

    def chat_config(self) -> dict:
        """What tokenizer_config.json says of chats: the template and the special tokens it is rendered with."""
        if self.chat_template is None:
            return {}
        return {**self.chat_template.special, "chat_template": self.chat_template.text}


def _template_affixes(backend: HFTokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the post-processor adds before and after one sequence (none without a post-processor)."""
    if backend.post_processor is None:
        return (), ()
    bare = backend.encode("document", add_special_tokens=False).ids
    full = backend.encode("document", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return tuple(full[:start]), tuple(full[start + len(bare):])
    return (), ()  # a post-processor that rewrites the text's own ids: leave it out


def stated_specials(directory: Path, backend: HFTokenizer) -> dict[str, int]:
    """{"bos_token_id": id, "eos_token_id": id} as far as the first of `SPECIALS_FILES` in `directory` that states
    them says (the first of a list); an id that is no token of the tokenizer is refused in one line."""
    for name in SPECIALS_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: not valid JSON ({exc})") from None
        doc = doc if isinstance(doc, dict) else {}
        stated = {}
        for key in ("bos_token_id", "eos_token_id"):
            value = doc.get(key)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                if backend.id_to_token(value) is None:
                    raise DataError(f"{path}: {key} {value} is no token of the tokenizer beside it "
                                    f"({backend.get_vocab_size(with_added_tokens=True)} tokens); fix the file")
                stated[key] = value
        if stated:
            return stated
    return {}


def _find_token(backend: HFTokenizer, names: Sequence[str]) -> int | None:
    """Id of the first of ``names`` present in the vocabulary, else None."""
    for name in names:
        token_id = backend.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def tokenizer_from_file(path: str | Path) -> Tokenizer:
    """Load a tokenizer file: ours (``byte_tokenizer.json``) or any ``tokenizer.json``."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / BPE_FILE, path / BYTE_FILE]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise DataError(f"tokenizer directory {str(path)!r} holds no {BPE_FILE} or {BYTE_FILE}; "
                            "pass the tokenizer file itself")
        path = found[0]
    if path.name == BYTE_FILE or _is_byte_file(path):
        return ByteTokenizer()
    return BPETokenizer.from_file(path)


def _is_byte_file(path: Path) -> bool:
    """Whether ``path`` is a file written by ``ByteTokenizer.save``."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    # A full parse of a large tokenizer.json just to read one key is wasteful;
    # our own file is tiny and starts with its type.
    return _BYTE_TYPE.encode() in head


def load_tokenizer(spec: str, train_texts: Callable[[], Iterable[str]] | None = None) -> Tokenizer:
    """Build the tokenizer named by ``spec``: ``"byte"``, ``"bpe:N"`` or a tokenizer file/directory.

    ``train_texts`` is called (once) only for ``"bpe:N"``, to get the texts
    to train on.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"tokenizer={spec!r} is empty; use 'byte', 'bpe:N' or a path to a tokenizer.json")
    spec = spec.strip()
    if spec == "byte":
        return ByteTokenizer()
    match = re.fullmatch(r"bpe:(\d+)", spec)
    if match:
        if train_texts is None:
            raise DataError(f"tokenizer={spec!r} must be trained on texts; pass train_texts or a prepared data directory")
        return BPETokenizer.train(train_texts(), int(match.group(1)))
    if Path(spec).exists():
        return tokenizer_from_file(spec)
    if spec.startswith("bpe"):
        raise DataError(f"tokenizer={spec!r}: write 'bpe:N' with N the vocabulary size, e.g. 'bpe:8192'")
    raise DataError(f"tokenizer={spec!r} is neither 'byte', 'bpe:N' nor an existing tokenizer.json path")
