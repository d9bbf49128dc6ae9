"""The documents of a corpus file, whatever it holds: a text file is one document; a record file is one document per
record, its text under `text_key`.

- JSON Lines: ``.jsonl``, gzipped ``.jsonl.gz``, zstandard ``.jsonl.zst`` (the `zstandard` package), read
  line by line; extra fields are ignored.
- Parquet (``.parquet``): the `text_key` column, read a row group at a time with pyarrow.
- a Hugging Face `datasets` dataset saved with ``save_to_disk`` (a directory with ``dataset_info.json`` and
  ``state.json``): its `text_key` column, read in batches through `datasets.load_from_disk`.
- a dataset by its hub name, ``hf:NAME``, ``hf:NAME:SPLIT`` or ``hf:NAME:CONFIG:SPLIT`` (split ``train`` by
  default; NAME may also be a local directory laid out as a hub dataset repository): streamed record by
  record through ``datasets.load_dataset(..., streaming=True)``, nothing downloaded whole.

Everything streams: memory holds one batch of records, never a whole file. A record that is not what the
corpus promises stops the read with one line naming the file and the line (or row) and the key: a JSON Lines
line that is not JSON, a record without the text key or whose value is not a string, a Parquet file or
dataset without the column, a file that cannot be opened.
"""

from __future__ import annotations

import gzip
import importlib
import io
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from paratrain.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
RECORD_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
DATASET_MARKERS = ("dataset_info.json", "state.json")  # what `datasets`' save_to_disk writes
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class HubDataset:
    """A dataset named as on the Hugging Face hub (`parse_hub`): its records stream from the hub (or its cache)."""

    name: str
    config: str | None
    split: str

    def __str__(self) -> str:
        return f"hf:{self.name}" + (f":{self.config}" if self.config else "") + f":{self.split}"


HUB_PREFIX = "hf:"


def parse_hub(spec: str) -> HubDataset | None:
    """The hub dataset of ``hf:NAME[:CONFIG][:SPLIT]``, None for anything else."""
    if not spec.startswith(HUB_PREFIX):
        return None
    parts = spec[len(HUB_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise DataError(f"data={spec!r}: write hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    name, config, split = parts[0], parts[1] if len(parts) == 3 else None, parts[-1] if len(parts) > 1 else "train"
    return HubDataset(name, config, split)


def is_record_file(path: Path) -> bool:
    return path.name.lower().endswith(RECORD_SUFFIXES)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk`."""
    return path.is_dir() and all((path / marker).is_file() for marker in DATASET_MARKERS)


def documents(path: Path | HubDataset, text_key: str) -> Iterator[str]:
    """The documents of one source, in order (see the module's docstring)."""
    if isinstance(path, HubDataset):
        return _hub_documents(path, text_key)
    path = Path(path)
    name = path.name.lower()
    if is_saved_dataset(path):
        return _dataset_documents(path, text_key)
    if name.endswith(JSONL_SUFFIXES):
        return _jsonl_documents(path, text_key)
    if name.endswith(PARQUET_SUFFIXES):
        return _parquet_documents(path, text_key)
    return iter([_read_text(path)])


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read data file {str(path)!r} ({exc.strerror or exc}); check its permissions") from exc


def _open_lines(path: Path):
    """A text stream of a (possibly compressed) JSON Lines file."""
    try:
        if path.name.lower().endswith(".gz"):
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
        if path.name.lower().endswith(".zst"):
            zstandard = _optional("zstandard", "zstandard", f"{str(path)!r} is zstandard-compressed")
            raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
            return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        return open(path, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read data file {str(path)!r} ({exc.strerror or exc}); check its permissions") from exc


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    for record, where in _jsonl_records(path):
        yield _text_of(record, text_key, where)


def _jsonl_records(path: Path) -> Iterator[tuple[object, str]]:
    with _open_lines(path) as lines:
        try:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{number}: not a JSON object ({exc.msg}); every line of a JSON Lines file "
                                    f"is one record") from None
                yield record, f"{path}:{number}"
        except (OSError, EOFError) as exc:  # a truncated or corrupt compressed file
            raise DataError(f"cannot read data file {str(path)!r} ({exc}); is it complete?") from None


def records(path: Path | HubDataset) -> Iterator[tuple[object, str]]:
    """(record, where) of each record of a record source, whole (every field), `where` naming its file and line
    (or row) for an error message: what chat data (`paratrain.data.chat`) reads. A text file has no records."""
    if isinstance(path, HubDataset):
        return _hub_records(path)
    path = Path(path)
    if is_saved_dataset(path):
        datasets = _optional("datasets", "datasets", f"{str(path)!r} is a saved `datasets` dataset")
        return _numbered(path, (row for batch in datasets.load_from_disk(str(path)).iter(batch_size=_BATCH_ROWS)
                                for row in _rows(batch)))
    if path.name.lower().endswith(JSONL_SUFFIXES):
        return _jsonl_records(path)
    if path.name.lower().endswith(PARQUET_SUFFIXES):
        pq = _optional("pyarrow.parquet", "pyarrow", f"{str(path)!r} is Parquet")
        return _numbered(path, (row for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS)
                                for row in batch.to_pylist()))
    raise DataError(f"{path}: a text file holds no records; chat data is JSON Lines, Parquet or a `datasets` dataset")


def _rows(columns: dict) -> Iterator[dict]:
    """The rows of a batch of columns ({name: [values]})."""
    names = list(columns)
    return (dict(zip(names, values)) for values in zip(*(columns[n] for n in names)))


def _numbered(path: Path, rows: Iterator) -> Iterator[tuple[object, str]]:
    return ((row, f"{path}: row {n}") for n, row in enumerate(rows, 1))


def _optional(module: str, package: str, what: str):
    """The optional `module` a source needs, or one line saying which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what}: pip install {package} (or pip install 'paratrain[corpora]')") from None


def _text_of(record, text_key: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    if text_key not in record:
        keys = ", ".join(list(record)[:8]) or "none"
        raise DataError(f"{where}: the record has no {text_key!r} (its keys: {keys}); pass --text-key KEY")
    text = record[text_key]
    if not isinstance(text, str):
        raise DataError(f"{where}: {text_key!r} is a {type(text).__name__}, not text")
    return text


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    pq = _optional("pyarrow.parquet", "pyarrow", f"{str(path)!r} is Parquet")
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a file that is not Parquet vary
        raise DataError(f"cannot read Parquet file {str(path)!r} ({type(exc).__name__}: {exc})") from None
    _require_column(path, text_key, table.schema_arrow.names)
    batches = table.iter_batches(batch_size=_BATCH_ROWS, columns=[text_key])
    return _column_texts((batch.column(0).to_pylist() for batch in batches), path, text_key)


def _require_column(path: Path, text_key: str, columns: list[str]) -> None:
    if text_key not in columns:
        raise DataError(f"{path}: no column {text_key!r} (its columns: {', '.join(columns)}); pass --text-key KEY")


def _column_texts(batches: Iterator[list], path: Path, text_key: str) -> Iterator[str]:
    """The texts of a column read in batches, each checked to be text (one line naming the row if not)."""
    row = 0
    for texts in batches:
        for text in texts:
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{path}: row {row}: {text_key!r} is {text!r}, not text")
            yield text


def _dataset_documents(path: Path, text_key: str) -> Iterator[str]:
    datasets = _optional("datasets", "datasets", f"{str(path)!r} is a saved `datasets` dataset")
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict of splits {list(dataset)}; pass one split's directory")
    _require_column(path, text_key, dataset.column_names)
    batches = dataset.select_columns([text_key]).iter(batch_size=_BATCH_ROWS)
    return _column_texts((batch[text_key] for batch in batches), path, text_key)


def _hub_documents(source: HubDataset, text_key: str) -> Iterator[str]:
    return (_text_of(record, text_key, where) for record, where in _hub_records(source))


def _hub_records(source: HubDataset) -> Iterator[tuple[object, str]]:
    datasets = _optional("datasets", "datasets", f"{source} is a hub dataset")
    try:
        stream = datasets.load_dataset(source.name, source.config, split=source.split, streaming=True)
        records = iter(stream)
        first = next(records, None)
    except Exception as exc:  # noqa: BLE001 - offline, unknown name, gated, bad split: the library's errors vary
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise DataError(f"{source}: cannot stream it ({type(exc).__name__}: {reason}); on a machine that reaches the "
                        f"hub, `datasets.load_dataset(...).save_to_disk(DIR)` and pass DIR") from None
    if first is None:
        return iter(())
    return ((record, f"{source} record {n}") for n, record in enumerate(itertools.chain([first], records), 1))
