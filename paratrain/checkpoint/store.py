"""The checkpoint root as a whole: listing, verification, finding the resume point, clean-up, retention.

    root/
      step-00000004/          committed (renamed into place after its manifest was written)
      step-00000008/
      latest                  "step-00000008\\n", replaced atomically after each commit
      .tmp-step-00000012-…    a save in flight, or one that died (see quarantine_incomplete)
      .incomplete-…           quarantined leftovers of saves that died
      .deleting-…             an old checkpoint being purged

Only names ``step-<8+ digits>`` are checkpoints; every other entry is hidden
from `list_checkpoints` and `find_latest`. Resuming follows the step number,
not the `latest` pointer, which is there for people and tools: the two agree
unless a run saved a lower step than one already present.

Problems that leave training able to go on (an invalid newer checkpoint
skipped, a purge that failed, a leftover quarantined) are reported with
`warnings.warn(..., CheckpointWarning)`, which a trainer can route to its
log or turn into errors with a warnings filter.
"""

from __future__ import annotations

import os
import secrets
import shutil
import warnings
from pathlib import Path

from paratrain.checkpoint.files import file_digest, write_atomic
from paratrain.checkpoint.format import (
    INDEX_FILE, LATEST_FILE, MANIFEST_FILE, TEMP_PREFIX, CheckpointError, CheckpointWarning,
    CorruptCheckpointError, Index, Manifest, parse_step_dirname,
)

INCOMPLETE_PREFIX = ".incomplete-"
DELETING_PREFIX = ".deleting-"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The committed checkpoint directories under `root`, oldest step first (none if root does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := parse_step_dirname(p.name)) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse the manifest of the checkpoint at `path`; CorruptCheckpointError if it is missing or malformed."""
    path = Path(path)
    data = _read(path, MANIFEST_FILE, missing="incomplete checkpoint, no commit marker (manifest.json missing)")
    return Manifest.from_json(data, f"{path.name} invalid: {MANIFEST_FILE}")


def read_index(path: str | os.PathLike) -> Index:
    """Parse the index of the checkpoint at `path`; CorruptCheckpointError if it is missing or malformed."""
    path = Path(path)
    data = _read(path, INDEX_FILE, missing="index.json is missing")
    return Index.from_json(data, f"{path.name} invalid: {INDEX_FILE}")


def _read(path: Path, name: str, missing: str) -> bytes:
    if not path.is_dir():
        raise CorruptCheckpointError(f"{path} is not a checkpoint directory (it does not exist or is a file)")
    try:
        return (path / name).read_bytes()
    except FileNotFoundError:
        if list_checkpoints(path):
            raise CorruptCheckpointError(f"{path} is a checkpoint root, not a checkpoint; pass one of its step-* "
                                         f"directories, e.g. find_latest({str(path)!r})") from None
        raise CorruptCheckpointError(f"{path.name} invalid: {missing}") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path.name} invalid: cannot read {name}: {exc.strerror}") from None


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> Manifest:
    """Check a checkpoint against its manifest; return the manifest, or raise CorruptCheckpointError listing every bad file.

    Checks that the commit marker is there and parses, that every listed file
    exists with the recorded size and (unless ``checksums=False``, which skips
    reading the data) sha256, and that the index parses and refers only to
    listed files.
    """
    path = Path(path)
    manifest = read_manifest(path)
    problems = []
    if INDEX_FILE not in manifest.files:
        problems.append(f"{MANIFEST_FILE} does not list {INDEX_FILE}")
    for name, expected in manifest.files.items():
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != expected.size:
            problems.append(f"{name} size {size} ≠ expected {expected.size}")
        elif checksums and _sha256(path / name) != expected.sha256:
            problems.append(f"checksum mismatch in {name}")
    if problems:
        raise CorruptCheckpointError(f"{path.name} invalid: {'; '.join(problems)}")
    index = read_index(path)
    unlisted = sorted({box.file for t in index.tensors.values() for box in t.boxes} - set(manifest.files))
    if unlisted:
        raise CorruptCheckpointError(f"{path.name} invalid: {INDEX_FILE} refers to {', '.join(unlisted)}, "
                                     f"which {MANIFEST_FILE} does not list")
    step = parse_step_dirname(path.name)
    if step is not None and not step == manifest.step == index.step:
        raise CorruptCheckpointError(f"{path.name} invalid: {MANIFEST_FILE} says step {manifest.step} and "
                                     f"{INDEX_FILE} step {index.step}; was the directory renamed?")
    return manifest


def _sha256(path: Path) -> str:
    try:
        return file_digest(path).sha256
    except OSError as exc:
        raise CorruptCheckpointError(f"{path.parent.name} invalid: cannot read {path.name}: {exc.strerror}") from None


def find_latest(root: str | os.PathLike, *, checksums: bool = True) -> Path | None:
    """The newest committed checkpoint under `root` that verifies, or None; warns for each newer invalid one skipped.

    For auto-resume. Call it on one rank and broadcast the answer: verifying
    reads every file. An explicitly named checkpoint is opened with
    `CheckpointReader` instead, which raises when it is invalid.
    """
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path, checksums=checksums)
            return path
        except CheckpointError as exc:
            warnings.warn(f"{exc}; skipping it and trying an older checkpoint", CheckpointWarning, stacklevel=2)
    return None


def quarantine_incomplete(root: str | os.PathLike, *, delete: bool = False) -> list[Path]:
    """Move the leftovers of saves that died out of the way; return where they went (or what was deleted).

    Temporary directories (``.tmp-*``) and step directories without a commit
    marker are renamed to ``.incomplete-<name>`` (kept for a post-mortem) or,
    with ``delete=True``, removed. Old checkpoints whose purge was
    interrupted (``.deleting-*``) are removed. Committed checkpoints that fail
    verification are left alone: `find_latest` skips them.

    Call on one rank, at start-up, before any save: a save in flight has a
    temporary directory that this would take away.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    handled = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(DELETING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            handled.append(entry)
            continue
        committed = parse_step_dirname(entry.name) is not None and entry.is_dir()
        if committed and (entry / MANIFEST_FILE).exists():
            continue
        if not (committed or entry.name.startswith(TEMP_PREFIX)):
            continue
        target = _set_aside(entry, delete)
        warnings.warn(f"{entry.name}: incomplete checkpoint, no commit marker; "
                      f"{'deleted' if delete else f'quarantined as {target.name}'}", CheckpointWarning, stacklevel=2)
        handled.append(target)
    (root / f".{LATEST_FILE}.tmp").unlink(missing_ok=True)
    return handled


def _set_aside(entry: Path, delete: bool) -> Path:
    if delete:
        shutil.rmtree(entry, ignore_errors=True)
        return entry
    base = entry.name.removeprefix(TEMP_PREFIX)
    target = entry.with_name(f"{INCOMPLETE_PREFIX}{base}")
    if target.exists():
        target = entry.with_name(f"{INCOMPLETE_PREFIX}{base}-{secrets.token_hex(3)}")
    os.rename(entry, target)
    return target


def apply_retention(root: str | os.PathLike, keep_latest: int, protect: Path, on_event=None) -> list[Path]:
    """Delete all but the newest `keep_latest` checkpoints, never `protect`; return those deleted.

    Each is first renamed to ``.deleting-*`` (atomic), then removed, so a
    crash mid-purge never leaves a half-deleted ``step-*`` that looks
    committed. A failure is a warning: training goes on with one more
    checkpoint on disk. Runs on rank 0; `on_event("purging", step of protect)`
    is told of each rename (see `paratrain.checkpoint.save.EventHook`).
    """
    root = Path(root)
    committed = list_checkpoints(root)
    keep = set(committed[max(len(committed) - keep_latest, 0):]) | {Path(protect)}
    deleted = []
    for path in committed:
        if path in keep:
            continue
        try:
            trash = root / f"{DELETING_PREFIX}{path.name}-{secrets.token_hex(3)}"
            os.rename(path, trash)
            if on_event is not None:
                on_event("purging", parse_step_dirname(Path(protect).name) or 0)
            shutil.rmtree(trash)
            deleted.append(path)
        except OSError as exc:
            warnings.warn(f"could not delete old checkpoint {path.name}: {exc}; it stays on disk",
                          CheckpointWarning, stacklevel=2)
    return deleted


def check_free_space(root: str | os.PathLike, needed_bytes: int) -> None:
    """Raise CheckpointError when the file system of `root` has less than `needed_bytes` free (a pre-flight check).

    `needed_bytes` is the caller's estimate of one checkpoint (the bytes of
    every shard of every rank, plus a margin for JSON); checked at start-up
    it turns a save that would fail hours later into an error now.
    """
    root = Path(root)
    probe = next((p for p in (root, *root.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise CheckpointError(f"{root}: a checkpoint needs about {_size(needed_bytes)} but only {_size(free)} is "
                              f"free on its file system; free space or choose another checkpoint directory")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def read_latest_pointer(root: str | os.PathLike) -> str | None:
    """The directory name the `latest` file points to, or None when there is none."""
    try:
        return (Path(root) / LATEST_FILE).read_text(encoding="utf-8").strip() or None
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def update_latest_pointer(root: str | os.PathLike, name: str) -> None:
    """Point `latest` at the checkpoint directory `name`, atomically."""
    write_atomic(Path(root) / LATEST_FILE, name + "\n")


def newest_committed_name(root: str | os.PathLike) -> str | None:
    """Name of the newest committed checkpoint (not verified): what a failed save left as the last good one."""
    committed = list_checkpoints(root)
    return committed[-1].name if committed else None


def describe_last_good(root: str | os.PathLike) -> str:
    """The end of a failed-save message: which checkpoint is still intact."""
    name = newest_committed_name(root)
    return f"last good checkpoint {name} intact" if name else f"no earlier checkpoint in {root}"

