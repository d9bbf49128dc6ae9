"""Where text comes from: the built-in corpus, or the user's files.

The built-in corpus is the running interpreter's own standard-library
sources: real text, present on every machine with Python, no download. It
differs between Python versions, so ``meta.json`` of a prepared corpus
records which one it came from.
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from paratrain.data.sources import HubDataset, documents, is_record_file, is_saved_dataset, parse_hub
from paratrain.errors import DataError

# Directories of the standard library that are not library source (tests,
# third-party packages, the IDLE application, build configuration).
_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__",
    "lib-dynload", "turtledemo",
})

# A directory given as data contributes files with these suffixes (case
# insensitive); other files (images, archives, prepared token files) are
# skipped. A single file or a glob is taken as given, whatever its suffix.
TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".org",
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".java", ".js", ".ts",
    ".go", ".rs", ".rb", ".sh", ".html", ".htm", ".xml", ".csv", ".tsv",
    ".yaml", ".yml", ".toml", ".ini", ".cfg",
})

_GLOB_CHARS = frozenset("*?[")


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` sources, excluding tests and site-packages, sorted."""
    root = stdlib_dir()
    files = []
    # os.walk does not follow directory symlinks, and pruning in place skips
    # walking the (large) test trees at all.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith((".", "config-"))]
        for name in filenames:
            # _sysconfigdata* describes this machine's build, not the library.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                files.append(Path(dirpath) / name)
    if not files:
        raise DataError(f"no standard-library sources found under {str(root)!r}; set data to a file, directory or glob")
    return sorted(files)


def default_corpus_description() -> str:
    """One line naming the built-in corpus, for meta.json and logs."""
    version = ".".join(map(str, sys.version_info[:3]))
    return f"python {version} standard library at {stdlib_dir()}"


def corpus_files(data: str | Path | None) -> tuple[list[Path], str]:
    """Files of the corpus named by ``data`` (None or ``"default"``: the built-in one) and a description."""
    if data is None or str(data) == "default":
        return default_corpus_files(), default_corpus_description()
    hub = parse_hub(str(data))
    if hub is not None:
        return [hub], f"{hub} (streamed)"
    files = resolve_text_files(data)
    return files, f"{data} ({len(files)} files)"


def resolve_text_files(path_or_glob: str | Path) -> list[Path]:
    """Files named by a file path, a directory (recursive, text suffixes only) or a glob.

    Sorted, so the corpus order is the same on every rank and every run.
    """
    text = str(path_or_glob)
    if _GLOB_CHARS & set(text) and not Path(text).exists():
        files = [Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file()]
        if not files:
            raise DataError(f"data={text!r}: the glob matches no files; check the pattern")
        return sorted(files)
    path = Path(text).expanduser()
    if path.is_file() or is_saved_dataset(path):
        return [path]
    if path.is_dir():
        return _text_files_under(path)
    mixture = (" (a mixture is WEIGHT:SOURCE for every source, e.g. 0.7:a.jsonl,0.3:b/)"
               if ":" in text or "," in text else "")
    raise DataError(f"data={text!r} does not exist; pass a file, a directory, a glob or 'default'{mixture}")


def _text_files_under(root: Path) -> list[Path]:
    """Text-suffixed and record files below ``root`` and the saved datasets in it, skipping hidden files and
    directories."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        datasets = [d for d in dirnames if is_saved_dataset(Path(dirpath) / d)]
        files.extend(Path(dirpath) / d for d in datasets)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in datasets]
        files.extend(Path(dirpath) / n for n in filenames
                     if not n.startswith(".") and (Path(n).suffix.lower() in TEXT_SUFFIXES or is_record_file(Path(n))))
    if not files:
        raise DataError(f"data={str(root)!r} holds no text or record files (suffixes like .txt .md .jsonl "
                        ".jsonl.gz .parquet); pass a glob to pick other files")
    return sorted(files)


def iter_texts(files: Iterable[str | Path], text_key: str = "text") -> Iterator[str]:
    """The documents of ``files`` in order: a text file whole (UTF-8, undecodable bytes replaced), a record file
    or saved dataset one record at a time, its text under ``text_key`` (`paratrain.data.sources`)."""
    for f in files:
        yield from documents(f if isinstance(f, HubDataset) else Path(f), text_key)
