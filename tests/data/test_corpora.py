"""Real corpora through `paratrain prepare` and `train --data`: JSON Lines (plain, gzipped, zstandard), Parquet,
a saved `datasets` dataset; one record one document, counted exactly; the same token stream whatever the number
of workers; bounded memory; one line for each kind of bad input."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.data import build_dataset, prepare_corpus
from paratrain.data.prepare import open_prepared
from paratrain.errors import DataError

TEXTS = [f"record {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 5 + 1) + "é" * (i % 3)
         for i in range(240)]


def _byte_tokens(texts) -> int:
    return sum(len(t.encode("utf-8")) + 1 for t in texts)  # every document and its eos


def _write_jsonl(path: Path, texts, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, key: text, "meta": {"source": "test", "n": i}}) + "\n")
    return path


def _check(out: Path, texts, text_key="text"):
    tokens, meta, tokenizer = open_prepared(out)
    assert (meta["num_documents"], meta["num_tokens"], meta["text_key"]) == (len(texts), _byte_tokens(texts), text_key)
    starts = np.fromfile(out / "documents.bin", dtype="<i8")
    assert len(starts) == len(texts) + 1 and starts[-1] == len(tokens)
    for i in (0, 7, len(texts) - 1):  # each document decodes back from where the index says it is
        assert tokenizer.decode(tokens[starts[i]:starts[i + 1] - 1]) == texts[i]


def _word_tokenizer(path: Path, template: tuple[str, str] | None) -> Path:
    """A word-level tokenizer.json with <s> and </s>, and a post-processor of `template` (single, pair) or none."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for t in TEXTS for w in t.split()} | {"document"})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template:
        tokenizer.post_processor = processors.TemplateProcessing(single=template[0], pair=template[1],
                                                                 special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("template, before, after", [
    (("<s> $A", "<s> $A <s> $B"), [1], [2]),  # Llama 3's: begin-of-text before each document; eos added after
    (("<s> $A </s>", "<s> $A </s> $B </s>"), [1], [2]),  # the template's own eos, not doubled
    (None, [], [2]),  # no post-processor: eos after each document, as paratrain's own BPE
])
def test_documents_are_delimited_as_the_tokenizers_template_says(tmp_path, template, before, after):
    spec = _word_tokenizer(tmp_path / "tokenizer.json", template)
    texts = TEXTS[:20]
    out = prepare_corpus(_write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "out", str(spec), progress=False)
    tokens, meta, _ = open_prepared(out)
    starts = np.fromfile(out / "documents.bin", dtype="<i8")
    for i, text in enumerate(texts):
        document = tokens[starts[i]:starts[i + 1]].tolist()
        assert document[:len(before)] == before and document[len(document) - len(after):] == after
        assert len(document) == len(before) + len(text.split()) + len(after)
    assert meta["num_tokens"] == sum(len(t.split()) for t in texts) + len(texts) * (len(before) + len(after))


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_prepare_continues_after_its_finished_files(tmp_path, capsys, monkeypatch, workers):
    """A bad record in the third of four files stops prepare; the files before it stay finished in .out.partial
    (nothing that looks done), and the rerun after the fix reads only from the third file on, to the same bytes
    as a prepare that never stopped."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    parts = [TEXTS[i::4] for i in range(4)]
    for i, part in enumerate(parts):
        _write_jsonl(corpus / f"part-{i}.jsonl", part)
    clean = prepare_corpus(corpus, tmp_path / "clean", "byte", progress=False, workers=workers)
    monkeypatch.setattr("paratrain.data.prepare._CHUNK_CHARS", 256)  # batches of a few records, as a large corpus
    good = (corpus / "part-2.jsonl").read_text()
    (corpus / "part-2.jsonl").write_text(good + "{not json\n")
    with pytest.raises(DataError, match="part-2.jsonl"):
        prepare_corpus(corpus, tmp_path / "out", "byte", progress=False, workers=workers)
    partial = tmp_path / ".out.partial"
    assert not (tmp_path / "out").exists() and not (partial / "meta.json").exists()
    assert json.loads((partial / "progress.json").read_text())["files_done"] == 2
    (corpus / "part-2.jsonl").write_text(good)
    capsys.readouterr()
    prepare_corpus(corpus, tmp_path / "out", "byte", progress=False, workers=workers)
    assert "continuing after 2 of 4 finished file(s)" in capsys.readouterr().err
    for name in ("tokens.bin", "documents.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (clean / name).read_bytes()
    assert not partial.exists()
    (corpus / "part-0.jsonl").write_text(good)  # a finished file changed since: start over, not continue
    (corpus / "part-3.jsonl").write_text("{not json\n")
    with pytest.raises(DataError):
        prepare_corpus(corpus, tmp_path / "again", "byte", progress=False, workers=workers)
    _write_jsonl(corpus / "part-0.jsonl", parts[2])
    _write_jsonl(corpus / "part-3.jsonl", parts[3])
    capsys.readouterr()
    prepare_corpus(corpus, tmp_path / "again", "byte", progress=False, workers=workers)
    assert "continuing" not in capsys.readouterr().err


@pytest.mark.single_process
def test_a_dataset_by_its_hub_name_streams_and_an_unreachable_one_is_refused_in_one_line(tmp_path):
    """`hf:NAME[:CONFIG][:SPLIT]` streams through `datasets.load_dataset(..., streaming=True)`; a local directory
    laid out as a hub repository stands in for the hub here (no network). Offline, a hub name ends in one line."""
    repo = tmp_path / "corpus-repo"
    repo.mkdir()
    _write_jsonl(repo / "train.jsonl", TEXTS[:30], key="content")
    _write_jsonl(repo / "validation.jsonl", TEXTS[30:45], key="content")
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for spec, texts in ((f"hf:{repo}", TEXTS[:30]), (f"hf:{repo}:validation", TEXTS[30:45])):
        out = tmp_path / spec.rsplit(":", 1)[-1].replace("/", "_")
        result = subprocess.run([sys.executable, "-m", "paratrain", "prepare", "--data", spec, "--text-key", "content",
                                 "--out", str(out)], capture_output=True, text=True, env=offline, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        _check(out, texts, "content")
    result = subprocess.run([sys.executable, "-m", "paratrain", "prepare", "--data", "hf:someone/no-such-corpus",
                             "--out", str(tmp_path / "x")], capture_output=True, text=True, env=offline, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "hf:someone/no-such-corpus:train: cannot stream it" in result.stderr and "save_to_disk" in result.stderr
    with pytest.raises(DataError, match="write hf:NAME"):
        prepare_corpus("hf:a:b:c:d", tmp_path / "y", progress=False)


def test_gzipped_jsonl_with_extra_fields(tmp_path):
    source = _write_jsonl(tmp_path / "part-0.jsonl.gz", TEXTS, opener=gzip.open)
    _check(prepare_corpus(str(source), tmp_path / "out", "byte", progress=False), TEXTS)


def test_zstandard_jsonl_and_a_directory_of_record_files_in_name_order(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_jsonl(corpus / "b.jsonl", TEXTS[120:])
    raw = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:120]).encode()
    (corpus / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    _check(prepare_corpus(str(corpus), tmp_path / "out", "byte", progress=False), TEXTS)


def test_parquet_with_another_key(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"content": TEXTS, "score": list(range(len(TEXTS)))}), path, row_group_size=50)
    _check(prepare_corpus(str(path), tmp_path / "out", "byte", progress=False, text_key="content"), TEXTS, "content")
    with pytest.raises(DataError, match=r"data.parquet: no column 'text' \(its columns: content, score\); pass "
                                        r"--text-key KEY$"):
        prepare_corpus(str(path), tmp_path / "out2", "byte", progress=False)


def test_a_datasets_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": TEXTS, "label": [0] * len(TEXTS)}).save_to_disk(str(tmp_path / "saved"))
    _check(prepare_corpus(str(tmp_path / "saved"), tmp_path / "out", "byte", progress=False), TEXTS)


def test_the_token_stream_does_not_depend_on_the_number_of_workers(tmp_path):
    source = _write_jsonl(tmp_path / "c.jsonl", TEXTS * 40)  # several tokenizer batches
    from paratrain.data.tokenizer import BPETokenizer

    BPETokenizer.train(TEXTS, 400).save(tmp_path)  # a 400-token tokenizer.json
    streams = []
    for workers in (0, 1, 2):
        out = prepare_corpus(str(source), tmp_path / f"w{workers}", str(tmp_path / "tokenizer.json"),
                             progress=False, workers=workers)
        tokens, meta, _ = open_prepared(out)
        streams.append((np.asarray(tokens).copy(), (out / "documents.bin").read_bytes(), meta["num_documents"]))
    for other in streams[1:]:
        assert np.array_equal(streams[0][0], other[0]) and streams[0][1:] == other[1:]
    assert streams[0][2] == 40 * len(TEXTS)


def test_train_reads_jsonl_directly(tmp_path):
    source = _write_jsonl(tmp_path / "c.jsonl", TEXTS)
    train, held_out, tokenizer = build_dataset(str(source), "byte", 32, None, progress=False)
    assert len(train.stream) + len(held_out.stream) == _byte_tokens(TEXTS)


_CAPPED = """
import re, sys
from paratrain.data import prepare_corpus
import numpy, tokenizers, paratrain.data.prepare, paratrain.data.sources  # all that prepare loads, before the baseline


def status(key):  # this process's own memory (ru_maxrss would carry the forking parent's over the exec)
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024


baseline = status("VmRSS")
prepare_corpus(sys.argv[1], sys.argv[2], "byte", progress=False)
print(status("VmHWM") - baseline)
"""
ALLOWED = 48 * 2**20  # the working memory prepare may use beyond its imports


@pytest.mark.single_process
def test_a_corpus_four_times_the_allowed_memory_prepares_under_it(tmp_path):
    """A 192 MB corpus, four times the 48 MB of working memory allowed: prepare's peak resident memory beyond its
    imports stays under the 48 MB (one batch of records and its tokens at a time, never a file or the stream)."""
    line = json.dumps({"text": "a line of a real corpus, repeated to make it large. " * 20}) + "\n"
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        f.write(line * (4 * ALLOWED // len(line)))
    # Large allocations straight from mmap, as every peak-memory measurement here (glibc's default raises the
    # threshold as arrays are freed, and then keeps freed heap pages in the resident set).
    result = subprocess.run([sys.executable, "-c", _CAPPED, str(path), str(tmp_path / "out")], capture_output=True,
                            text=True, timeout=300, check=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    used = int(result.stdout.split()[-1])
    assert used < ALLOWED, f"{used / 2**20:.0f} MB beyond the imports for a {4 * ALLOWED / 2**20:.0f} MB corpus"
    assert open_prepared(tmp_path / "out")[1]["num_documents"] == 4 * ALLOWED // len(line)


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_corpora_are_refused_in_one_line_naming_the_file_and_line(tmp_path, capsys):
    def prepare(path, *extra):
        return _one_line(capsys, ["prepare", "--data", str(path), "--out", str(tmp_path / "out"), *extra])

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    assert f"{bad}:2: not a JSON object" in prepare(bad)
    keyless = tmp_path / "keyless.jsonl"
    keyless.write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    assert f"{keyless}:1: the record has no 'text' (its keys: body, id); pass --text-key KEY" in prepare(keyless)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text(json.dumps({"text": 3}) + "\n")
    assert f"{numbers}:1: 'text' is a int, not text" in prepare(numbers)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "no documents" in prepare(empty)
    assert "does not exist" in prepare(tmp_path / "missing.jsonl")
    assert not (tmp_path / "out").exists(), "nothing half-written"


# -- Megatron's indexed dataset --------------------------------------------------------------------------------

def _write_megatron(prefix: Path, documents: list[list[int]], dtype=np.uint16, code=8, magic=b"MMIDIDX\x00\x00",
                    version=1) -> None:
    """A reference writer of Megatron-Core's indexed dataset ("MMIDIDX", version 1), one sequence per document, as
    its documentation lays the files out."""
    import struct

    arrays = [np.asarray(d, dtype=dtype) for d in documents]
    prefix.with_suffix(".bin").write_bytes(b"".join(a.tobytes() for a in arrays))
    lengths = np.asarray([len(a) for a in arrays], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths.astype(np.int64))[:-1])) * np.dtype(dtype).itemsize
    document_index = np.arange(len(arrays) + 1, dtype=np.int64)
    header = magic + struct.pack("<QB", version, code) + struct.pack("<QQ", len(arrays), len(document_index))
    prefix.with_suffix(".idx").write_bytes(header + lengths.tobytes() + pointers.astype(np.int64).tobytes()
                                           + document_index.tobytes())


def test_a_megatron_indexed_dataset_trains_without_tokenizing_again(tmp_path):
    from paratrain.data.tokenizer import BYTE_FILE, ByteTokenizer

    ByteTokenizer().save(tmp_path)
    tokenizer = str(tmp_path / BYTE_FILE)
    texts = TEXTS[:100]
    documents = [list(t.encode("utf-8")) + [257] for t in texts]  # Megatron's --append-eod: the eos after each
    _write_megatron(tmp_path / "corpus_text_document", documents)
    for name in ("corpus_text_document", "corpus_text_document.bin"):
        train, held_out, tok = build_dataset(str(tmp_path / name), tokenizer, 32, None, progress=False)
        assert len(train.stream) + len(held_out.stream) == _byte_tokens(texts)
    stream = np.concatenate([np.asarray(train.stream.tokens), np.asarray(held_out.stream.tokens)])
    assert np.array_equal(stream, np.concatenate([np.asarray(d, dtype=np.uint16) for d in documents]))
    _write_megatron(tmp_path / "int32", documents, dtype=np.int32, code=4)  # vocabularies over 65,536
    assert build_dataset(str(tmp_path / "int32"), tokenizer, 32, None, progress=False)[0].stream.tokens.dtype == "<u4"


@pytest.mark.parametrize("change, message", [
    ({"magic": b"NOTANIDX\x00"}, "not a Megatron index"),
    ({"version": 2}, "version 2; paratrain reads Megatron's indexed dataset version 1"),
    ({"dtype": np.float32, "code": 7}, "dtype code 7 is not an integer token type"),
])
def test_a_bad_megatron_index_is_refused_in_one_line(tmp_path, change, message):
    from paratrain.data.tokenizer import BYTE_FILE, ByteTokenizer

    ByteTokenizer().save(tmp_path)
    _write_megatron(tmp_path / "c", [[1, 2, 3, 257]] * 50, **change)
    with pytest.raises(DataError, match=message) as refused:
        build_dataset(str(tmp_path / "c"), str(tmp_path / BYTE_FILE), 8, None, progress=False)
    assert "\n" not in str(refused.value)


def test_megatron_ids_beyond_the_tokenizer_are_refused(tmp_path):
    from paratrain.data.tokenizer import BYTE_FILE, ByteTokenizer

    ByteTokenizer().save(tmp_path)
    _write_megatron(tmp_path / "c", [[1, 2, 3, 50000]] * 50)
    with pytest.raises(DataError, match=r"token id 50000 is not below the tokenizer's vocabulary of 259"):
        build_dataset(str(tmp_path / "c"), str(tmp_path / BYTE_FILE), 8, None, progress=False)
    with pytest.raises(DataError, match="is a Megatron indexed dataset: pass --tokenizer"):
        build_dataset(str(tmp_path / "c"), "auto", 8, None, progress=False)
