"""Data path: sampler order and resume, tokenizers, corpora, datasets, prepared directories."""

from __future__ import annotations

import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from paratrain.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    DataSampler,
    SequenceDataset,
    TokenStream,
    build_dataset,
    default_corpus_files,
    load_tokenizer,
    prepare_corpus,
    resolve_text_files,
    split_train_eval,
)

NUM_SAMPLES = 50
GLOBAL_BATCH = 12

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n" * 5,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 4,
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀.\n" * 3,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n" * 6,
]


# --------------------------------------------------------------------------- sampler


def global_sequence(dp_size: int, steps: int, seed: int = 0, shuffle: bool = True,
                    num_samples: int = NUM_SAMPLES, global_batch: int = GLOBAL_BATCH) -> list[int]:
    """Stream read by all ranks of a dp_size layout, each step's rank slices concatenated in rank order."""
    samplers = [DataSampler(num_samples, global_batch, r, dp_size, seed=seed, shuffle=shuffle)
                for r in range(dp_size)]
    out = []
    for _ in range(steps):
        for s in samplers:
            out.extend(s.next_batch())
    return out


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_sampler_epoch_uses_every_sample_once(dp_size):
    steps = math.ceil(NUM_SAMPLES / GLOBAL_BATCH)
    seq = global_sequence(dp_size, steps)
    assert len(seq) == steps * GLOBAL_BATCH
    assert sorted(seq[:NUM_SAMPLES]) == list(range(NUM_SAMPLES))
    # The batch straddling the boundary continues into the next epoch's permutation.
    assert len(set(seq[NUM_SAMPLES:])) == len(seq) - NUM_SAMPLES


@pytest.mark.parametrize("dp_size", [2, 3, 4])
def test_sampler_global_order_independent_of_dp_size(dp_size):
    steps = 11  # crosses two epoch boundaries
    reference = global_sequence(1, steps)
    assert global_sequence(dp_size, steps) == reference
    ranks = [DataSampler(NUM_SAMPLES, GLOBAL_BATCH, r, dp_size) for r in range(dp_size)]
    for step in range(steps):
        expected = reference[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        assert ranks[0].global_batch_indices() == expected
        parts = [s.next_batch() for s in ranks]
        assert all(len(p) == GLOBAL_BATCH // dp_size for p in parts)
        assert sum(parts, []) == expected


def test_sampler_epochs_are_permutations_and_differ():
    seq = global_sequence(1, math.ceil(3 * NUM_SAMPLES / GLOBAL_BATCH))
    epochs = [seq[e * NUM_SAMPLES:(e + 1) * NUM_SAMPLES] for e in range(3)]
    for ep in epochs:
        assert sorted(ep) == list(range(NUM_SAMPLES))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(NUM_SAMPLES))


def test_sampler_seed_and_shuffle():
    assert global_sequence(1, 4, seed=0) == global_sequence(1, 4, seed=0)
    assert global_sequence(1, 4, seed=0) != global_sequence(1, 4, seed=1)
    plain = global_sequence(2, 6, shuffle=False)
    assert plain == [i % NUM_SAMPLES for i in range(6 * GLOBAL_BATCH)]


def test_sampler_batch_larger_than_dataset():
    seq = global_sequence(3, 5, num_samples=5, global_batch=12)
    for e in range(12):
        assert sorted(seq[e * 5:(e + 1) * 5]) == list(range(5))


@pytest.mark.parametrize("dp_before,dp_after", [(2, 3), (4, 1), (1, 4), (3, 3)])
def test_sampler_resume_matches_uninterrupted(dp_before, dp_after):
    k, more = 7, 6
    reference = global_sequence(1, k + more)
    before = [DataSampler(NUM_SAMPLES, GLOBAL_BATCH, r, dp_before, seed=0) for r in range(dp_before)]
    for _ in range(k):
        for s in before:
            s.next_batch()
    states = [s.state_dict() for s in before]
    assert all(st == states[0] for st in states)  # the state is global, not per rank
    state = json.loads(json.dumps(states[0]))
    assert state == states[0] and all(type(v) is int for v in state.values())
    assert state["epoch"] * NUM_SAMPLES + state["position"] == k * GLOBAL_BATCH

    after = [DataSampler(NUM_SAMPLES, GLOBAL_BATCH, r, dp_after, seed=0) for r in range(dp_after)]
    for s in after:
        s.load_state_dict(state)
        assert s.samples_consumed == k * GLOBAL_BATCH and s.epoch == state["epoch"]
    resumed = []
    for _ in range(more):
        for s in after:
            resumed.extend(s.next_batch())
    assert resumed == reference[k * GLOBAL_BATCH:]


def test_sampler_rejects_bad_config_and_state():
    with pytest.raises(DataError, match=r"global_batch=10 .*dp_size=4.*8 or 12"):
        DataSampler(NUM_SAMPLES, 10, 0, 4)
    with pytest.raises(DataError, match="num_samples"):
        DataSampler(0, 12)
    with pytest.raises(DataError, match="dp_rank"):
        DataSampler(NUM_SAMPLES, 12, 2, 2)
    state = DataSampler(NUM_SAMPLES, 12, seed=1).state_dict()
    with pytest.raises(DataError, match="num_samples"):
        DataSampler(NUM_SAMPLES + 1, 12, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        DataSampler(NUM_SAMPLES, 12, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="position"):
        DataSampler(NUM_SAMPLES, 12, seed=1).load_state_dict({**state, "position": NUM_SAMPLES})


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🙂\n\ttabs\x00"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a truncated character is replaced, not an error
    assert tok.vocab_size == 259 and (tok.bos_id, tok.eos_id, tok.pad_id) == (256, 257, 258)
    assert [a.tolist() for a in tok.encode_batch(["ab", "é"])] == [[97, 98], [0xC3, 0xA9]]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(iter(TEXTS), 300)


def test_bpe_trains_round_trips_and_reloads(bpe, tmp_path):
    assert 259 < bpe.vocab_size <= 300
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)
    text = "The lazy fox returns 日本 🚀 and an unseen char ∮ <|eos|>"
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned
    assert bpe.eos_id not in ids  # a special token's text in a document is plain text
    assert bpe.decode(ids) == text
    path = bpe.save(tmp_path)
    assert path.name == "tokenizer.json"
    for loaded in (BPETokenizer.from_file(path), load_tokenizer(str(tmp_path)), load_tokenizer(str(path))):
        assert isinstance(loaded, BPETokenizer)
        assert loaded.encode(text) == ids and loaded.spec == bpe.spec


def test_bpe_round_trip_plain_text(bpe):
    text = "Grüße aus Köln 🙂\n    return a + b\n"
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_training_is_deterministic(bpe):
    again = BPETokenizer.train(iter(TEXTS), 300)
    assert again.backend.to_str() == bpe.backend.to_str()


def foreign_tokenizer(path: Path, specials: list[str]) -> Path:
    vocab = {"hello": 0, "world": 1, "[UNK]": 2}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    backend.save(str(path))
    return path


def test_foreign_tokenizer_file_finds_common_eos(tmp_path):
    tok = load_tokenizer(str(foreign_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"])))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (3, 4, None)
    assert tok.encode("hello world") == [0, 1]
    tok = load_tokenizer(str(foreign_tokenizer(tmp_path / "gpt.json", ["<|endoftext|>"])))
    assert tok.eos_id == 3 and tok.vocab_size == 4


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    tok = load_tokenizer("bpe:280", train_texts=lambda: iter(TEXTS))
    assert isinstance(tok, BPETokenizer) and tok.vocab_size <= 280
    ByteTokenizer().save(tmp_path / "bytes")
    assert isinstance(load_tokenizer(str(tmp_path / "bytes")), ByteTokenizer)
    bad = {
        "bpe": "bpe:N", "bpe:x": "bpe:N", "bpe:10": "259", "wordpiece": "'byte'",
        str(tmp_path / "missing" / "tokenizer.json"): "'byte'", str(tmp_path): "holds no",
    }
    for spec, message in bad.items():
        with pytest.raises(DataError, match=message):
            load_tokenizer(spec, train_texts=lambda: iter(TEXTS))
    with pytest.raises(DataError, match="train_texts"):
        load_tokenizer("bpe:300")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(str(tmp_path / "broken.json"))


# --------------------------------------------------------------------------- corpus


def test_default_corpus_files():
    files = default_corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert files == sorted(files)
    assert all(f.suffix == ".py" and f.is_relative_to(stdlib) for f in files)
    excluded = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    assert not any(excluded & set(f.relative_to(stdlib).parts) for f in files)
    assert stdlib / "os.py" in files


@pytest.fixture
def text_dir(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    for i, text in enumerate(TEXTS):
        (root / ("sub" if i % 2 else ".") / f"doc{i}.txt").write_text(text * 3, encoding="utf-8")
    (root / "notes.md").write_text("# Notes\n\nSome *markdown* text.\n" * 20)
    (root / "image.bin").write_bytes(bytes(range(256)))
    (root / ".hidden" / "secret.txt").write_text("not part of the corpus")
    return root


def test_resolve_text_files(text_dir):
    files = resolve_text_files(str(text_dir))
    assert [f.relative_to(text_dir).as_posix() for f in files] == [
        "doc0.txt", "doc2.txt", "notes.md", "sub/doc1.txt", "sub/doc3.txt"]
    assert resolve_text_files(str(text_dir / "image.bin")) == [text_dir / "image.bin"]
    assert len(resolve_text_files(str(text_dir / "**" / "*.txt"))) == 4
    with pytest.raises(DataError, match="nowhere"):
        resolve_text_files(str(text_dir / "nowhere"))
    with pytest.raises(DataError, match="matches no files"):
        resolve_text_files(str(text_dir / "*.nothing"))
    (text_dir / "binaries").mkdir()
    (text_dir / "binaries" / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(DataError, match="no text or record files"):
        resolve_text_files(str(text_dir / "binaries"))


# --------------------------------------------------------------------------- datasets


def test_sequence_dataset_windows():
    tokens = np.arange(103, dtype=np.uint16)
    ds = SequenceDataset(tokens, seq_len=10)
    assert len(ds) == 10  # (103 - 1) // 10
    x, y = ds[3]
    assert x.dtype == torch.int64 and x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))
    inputs, labels = ds.get_batch([9, 0, 9])
    assert inputs.shape == labels.shape == (3, 10) and inputs.is_contiguous() and labels.is_contiguous()
    assert inputs[0].tolist() == list(range(90, 100)) and labels[0, -1].item() == 100
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    with pytest.raises(IndexError):
        ds.get_batch([10])
    assert len(SequenceDataset(np.arange(10), seq_len=10)) == 0


def test_split_train_eval():
    stream = TokenStream(np.arange(10_000, dtype=np.uint16))
    train, held = split_train_eval(stream, 0.02, seq_len=64)
    assert (train.start, train.end, held.start, held.end) == (0, 9800, 9800, 10_000)
    train, held = split_train_eval(stream, 0.0, seq_len=64)
    assert len(held) == 65 and len(SequenceDataset(held, 64)) == 1  # minimum: one eval sample
    with pytest.raises(DataError, match="seq_len=64"):
        split_train_eval(np.arange(129), 0.02, seq_len=64)
    with pytest.raises(DataError, match="eval_fraction"):
        split_train_eval(stream, 1.5, seq_len=64)


def test_build_dataset_default_corpus_is_fast_and_disjoint():
    start = time.perf_counter()
    train, held, tok = build_dataset(None, "byte", 256, None, progress=False)
    elapsed = time.perf_counter() - start
    assert elapsed < 15, f"default corpus took {elapsed:.1f}s"
    assert isinstance(tok, ByteTokenizer)
    assert len(train) > 1000 and len(held) >= 1
    assert train.stream.tokens.dtype == np.uint16
    # Eval starts after the last token any train sample touches.
    last_train_token = train.stream.start + len(train) * train.seq_len
    assert last_train_token < held.stream.start == train.stream.end
    n_total = len(train.stream) + len(held.stream)
    assert abs(len(held.stream) - 0.02 * n_total) <= 1
    text = tok.decode(train[0][0])
    assert text.isprintable() or "\n" in text
    assert tok.eos_id in train.stream.tokens[:1_000_000]


def samples(ds: SequenceDataset) -> torch.Tensor:
    return ds.get_batch(range(len(ds)))[0]


def test_prepare_matches_in_memory(text_dir, tmp_path):
    out = prepare_corpus(str(text_dir), tmp_path / "prepared", "byte", progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["eos_id"] == 257 and meta["num_documents"] == 5
    assert (out / "tokens.bin").stat().st_size == 2 * meta["num_tokens"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind

    mem_train, mem_eval, _ = build_dataset(str(text_dir), "byte", 32, None, progress=False)
    disk_train, disk_eval, tok = build_dataset(str(out), "byte", 32, None, progress=False)
    assert isinstance(disk_train.stream.tokens, np.memmap) and isinstance(tok, ByteTokenizer)
    assert meta["num_tokens"] == len(mem_train.stream) + len(mem_eval.stream)
    assert torch.equal(samples(disk_train), samples(mem_train))
    assert torch.equal(samples(disk_eval), samples(mem_eval))
    # Documents are separated by eos, in sorted file order.
    first = (text_dir / "doc0.txt").read_text().encode()
    assert bytes(mem_train.stream.tokens[:len(first)].astype(np.uint8)) == first
    assert mem_train.stream.tokens[len(first)] == 257


def test_prepare_bpe_is_self_describing(text_dir, tmp_path):
    out = prepare_corpus(str(text_dir), tmp_path / "prepared", "bpe:300", progress=False)
    assert (out / "tokenizer.json").is_file()
    disk_train, _, tok = build_dataset(str(out), "auto", 16, None, progress=False)
    mem_train, _, mem_tok = build_dataset(str(text_dir), "bpe:300", 16, None, progress=False)
    assert isinstance(tok, BPETokenizer) and tok.spec == mem_tok.spec
    assert torch.equal(samples(disk_train), samples(mem_train))
    with pytest.raises(DataError, match="prepared with tokenizer='bpe:300'"):
        build_dataset(str(out), "byte", 16, None)


def test_prepare_refuses_to_clobber(text_dir, tmp_path):
    out = prepare_corpus(str(text_dir), tmp_path / "prepared", progress=False)
    num_tokens = json.loads((out / "meta.json").read_text())["num_tokens"]
    with pytest.raises(DataError, match="not empty"):
        prepare_corpus(str(text_dir), out, progress=False)
    (text_dir / "doc0.txt").write_text("short\n")
    prepare_corpus(str(text_dir), out, overwrite=True, progress=False)
    shrunk = len(TEXTS[0] * 3) - len("short\n")
    assert json.loads((out / "meta.json").read_text())["num_tokens"] == num_tokens - shrunk
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cache_dir_prepares_once(text_dir, tmp_path):
    cache = tmp_path / "cache"
    first, _, _ = build_dataset(str(text_dir), "byte", 32, cache, progress=False)
    entries = list(cache.iterdir())
    assert len(entries) == 1 and isinstance(first.stream.tokens, np.memmap)
    mtime = (entries[0] / "tokens.bin").stat().st_mtime_ns
    second, _, _ = build_dataset(str(text_dir), "byte", 32, cache, progress=False)
    assert (entries[0] / "tokens.bin").stat().st_mtime_ns == mtime
    assert torch.equal(samples(first), samples(second))
    (text_dir / "doc0.txt").write_text("changed\n" * 100)
    build_dataset(str(text_dir), "byte", 32, cache, progress=False)
    assert len(list(cache.iterdir())) == 2  # a changed file is a new cache entry


def test_build_dataset_errors(text_dir, tmp_path):
    with pytest.raises(DataError, match="does-not-exist"):
        build_dataset(str(tmp_path / "does-not-exist"), "byte", 32, None)
    (tmp_path / "tiny.txt").write_text("tiny")
    with pytest.raises(DataError, match=r"too few for seq_len=32"):
        build_dataset(str(tmp_path / "tiny.txt"), "byte", 32, None)
    with pytest.raises(DataError, match="seq_len"):
        build_dataset(str(text_dir), "byte", 0, None)
    no_eos = foreign_tokenizer(tmp_path / "tokenizer.json", [])
    with pytest.raises(DataError, match="end-of-text"):
        build_dataset(str(text_dir), str(no_eos), 8, None)
