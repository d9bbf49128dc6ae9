"""Saving a checkpoint from every rank, committed atomically by rank 0.

The protocol, with the coordinator's three meetings:

1. rank 0 creates ``root/.tmp-step-00000008-<nonce>`` and broadcasts its name
   (or why it could not, e.g. the step exists and ``overwrite`` is off);
2. every rank writes ``rank-<r>.safetensors`` of its shards there, fsyncs
   it, and sends rank 0 a fragment: the boxes it wrote, the file's size and
   sha256, its per-rank state (rank 0 adds the shared state, and writes the
   assets under ``assets/`` with their digests);
3. rank 0 merges the fragments (refusing overlapping or incomplete tensors),
   writes ``index.json``, then ``manifest.json`` (the commit marker, last),
   fsyncs the directory, renames it to ``root/step-00000008``, points
   ``latest`` at it, and broadcasts the outcome; every rank returns the same
   path or raises the same CheckpointError;
4. rank 0 then deletes all but the newest ``keep_latest`` checkpoints.

A rank that fails while writing does not raise on its own (its peers would
wait in the next meeting until the process-group timeout): it reports the
error in its fragment, rank 0 removes the temporary directory, and every
rank raises. A rank that dies makes the meeting fail on the others, which
raise a CheckpointError naming the interrupted save; the temporary
directory stays for `quarantine_incomplete`.

Re-saving a step that is already committed is refused unless
``overwrite=True``; then the new checkpoint is written to a fresh temporary
directory like any other and swapped with the old one only once it is
committed (see `_install`), so a crash at any point leaves one of the two
complete.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from paratrain.checkpoint.coordinator import Coordinator
from paratrain.checkpoint.files import exchange_dirs, fsync_dir, write_durable, write_shard_file
from paratrain.checkpoint.format import (
    ASSETS_DIR, INDEX_FILE, MANIFEST_FILE, TEMP_PREFIX, CheckpointError, CheckpointWarning, Manifest, ShardSpec,
    dtype_name, parse_step_dirname, rank_filename, step_dirname,
)
from paratrain.checkpoint.merge import build_index, file_digests
from paratrain.checkpoint.state import encode_state
from paratrain.checkpoint.store import apply_retention, describe_last_good, list_checkpoints, update_latest_pointer

Shards = dict[str, tuple[ShardSpec, torch.Tensor]]
# on_event(name, step): told when a save reaches one of its points (`paratrain.faults.CHECKPOINT_EVENTS`
# lists them); the fault-injection tests kill or slow the save there.
EventHook = Callable[[str, int], None] | None


@dataclass(frozen=True)
class RankPayload:
    """What one rank contributes to a save, checked and encoded; `error` instead when that failed."""

    shards: Shards
    rank_state: Any
    shared_state: Any
    error: str | None = None
    assets: dict[str, bytes] | None = None  # rank 0's: file name -> content, written under assets/


def save_checkpoint(root: str | os.PathLike, step: int, shards: Shards, rank_state: dict | None = None,
                    shared_state: dict | None = None, *, coordinator: Coordinator,
                    keep_latest: int | None = None, overwrite: bool = False, on_event: EventHook = None,
                    assets: dict[str, bytes] | None = None) -> Path:
    """Save this rank's shards and state as part of checkpoint `step` under `root`; return the committed directory.

    Collective: every rank of the coordinator calls it with the same root,
    step and options. `shards` maps a key (unique on this rank; it names the
    tensor inside the rank's file) to the ShardSpec placing a local tensor in
    its global tensor, and that tensor. `rank_state` is this rank's own
    state (RNG, sampler; restored to the same rank), `shared_state` the state
    common to all ranks (step, tokens, config, schedule; only rank 0's is
    stored). Both may hold JSON values, bytes and small tensors (see
    `paratrain.checkpoint.state`). `assets` (rank 0's; file name -> bytes) are
    files kept whole under ``assets/``, listed in the manifest like the data
    files (a tokenizer, a model's description). `keep_latest` (None: keep all) bounds the
    committed checkpoints left under root. `on_event` is told of each point of
    the save it reaches (for fault-injection tests). Raises CheckpointError on
    every rank when the save fails; the previous checkpoints are then untouched.
    """
    check_save_options(step, keep_latest)
    payload = prepare_payload(coordinator.rank, shards, rank_state, shared_state, copy=False, assets=assets)
    return run_save(Path(root), step, payload, coordinator, keep_latest, overwrite, on_event)


def check_save_options(step: int, keep_latest: int | None) -> None:
    """Raise CheckpointError for a step or retention the save cannot honour (same answer on every rank)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if keep_latest is not None and (not isinstance(keep_latest, int) or keep_latest < 1):
        raise CheckpointError(f"keep_latest must be a positive int or None (keep all), got {keep_latest!r}")


def prepare_payload(rank: int, shards: Shards, rank_state: dict | None, shared_state: dict | None,
                    copy: bool, staging: PinnedStaging | None = None,
                    assets: dict[str, bytes] | None = None) -> RankPayload:
    """Check the shards, states and assets and encode the states; with `copy`, snapshot the tensors into CPU memory
    (into `staging`'s buffers: one per saver, so that two savers in flight never share one)."""
    staging = staging or _STAGING
    try:
        assets = _check_assets(assets) if rank == 0 else None
        checked = {key: _check_shard(key, value) for key, value in shards.items()}
        if copy:
            checked = {key: (spec, staging.snapshot(key, t)) for key, (spec, t) in checked.items()}
            staging.wait()
        encoded_rank = encode_state(_as_dict(rank_state, "rank_state"), "rank_state")
        encoded_shared = encode_state(_as_dict(shared_state, "shared_state"), "shared_state") if rank == 0 else None
    except Exception as exc:  # noqa: BLE001 - becomes this rank's report, so that no peer waits in vain
        return RankPayload({}, None, None, error=f"rank {rank}: {_describe(exc, rank_filename(rank))}")
    return RankPayload(checked, encoded_rank, encoded_shared, assets=assets)


def _check_assets(assets: dict[str, bytes] | None) -> dict[str, bytes] | None:
    """The assets as bytes, each named by a plain file name (CheckpointError otherwise)."""
    if not assets:
        return None
    for name, data in assets.items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointError(f"asset {name!r} is not a plain file name")
        if not isinstance(data, (bytes, bytearray)):
            raise CheckpointError(f"asset {name!r} is a {type(data).__name__}, not bytes")
    return {name: bytes(data) for name, data in assets.items()}


class PinnedStaging:
    """CPU snapshots of tensors for a save in flight. A GPU tensor is copied into page-locked memory,
    kept from one save to the next (pinning is slow), without blocking; `wait` then waits once for
    all the copies. A CPU tensor is copied as it is."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending = False

    def snapshot(self, key: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cuda":
            return t.to("cpu", copy=True)
        host = self._buffers.get(key)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        self._pending = True
        return host

    def wait(self) -> None:
        if self._pending:
            torch.cuda.current_stream().synchronize()
            self._pending = False


_STAGING = PinnedStaging()


def _as_dict(state: dict | None, what: str) -> dict:
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise CheckpointError(f"{what} must be a dict or None, got {type(state).__name__}")
    return state


def _check_shard(key: Any, value: Any) -> tuple[ShardSpec, torch.Tensor]:
    if not isinstance(key, str) or not key or key == "__metadata__":
        raise CheckpointError(f"shard key {key!r} must be a non-empty string other than '__metadata__'")
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], ShardSpec)
            and isinstance(value[1], torch.Tensor)):
        raise CheckpointError(f"shard {key!r} must be a (ShardSpec, Tensor) pair, got {type(value).__name__}")
    spec, tensor = value
    spec.check(tuple(tensor.shape))
    dtype_name(tensor.dtype)
    return spec, tensor


def run_save(root: Path, step: int, payload: RankPayload, coordinator: Coordinator,
             keep_latest: int | None, overwrite: bool, on_event: EventHook = None) -> Path:
    """The collective part of a save (steps 1-4 of the module docstring), shared by sync and async saves."""
    rank, name = coordinator.rank, step_dirname(step)
    announced = _meet(coordinator.broadcast_object, _start(root, step, overwrite) if rank == 0 else None,
                      name, "agreeing on the temporary directory")
    if "error" in announced:
        raise CheckpointError(announced["error"])
    tmp = root / announced["tmp"]
    event = on_event or (lambda name, step: None)
    fragment = _write_fragment(tmp, step, rank, payload, event)
    event("shard_written", step)
    fragments = _meet(coordinator.gather_objects, fragment, name,
                      f"collecting what every rank wrote (temporary directory {tmp.name} left in place)")
    outcome = _commit(root, tmp, step, fragments, overwrite, event) if rank == 0 else None
    try:
        outcome = coordinator.broadcast_object(outcome)
    except Exception as exc:  # noqa: BLE001 - any transport failure means a peer is gone
        done = (f"{name} was committed" if rank == 0 and "path" in outcome
                else f"the outcome is unknown (temporary directory {tmp.name})")
        raise CheckpointError(f"saving {name}: lost contact with another rank while announcing the "
                              f"outcome ({exc}); {done}") from exc
    if "error" in outcome:
        raise CheckpointError(outcome["error"])
    path = root / outcome["path"]
    if rank == 0 and keep_latest is not None:
        apply_retention(root, keep_latest, protect=path, on_event=on_event)
    return path


def _meet(collective, obj: Any, name: str, phase: str) -> Any:
    try:
        return collective(obj)
    except Exception as exc:  # noqa: BLE001 - any transport failure means a peer is gone
        raise CheckpointError(f"saving {name} interrupted: lost contact with another rank while {phase} "
                              f"({type(exc).__name__}: {exc}); nothing was committed") from exc


def _start(root: Path, step: int, overwrite: bool) -> dict:
    """Rank 0: create the temporary directory; {"tmp": name} or {"error": message}."""
    name = step_dirname(step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if (root / name).exists() and not overwrite:
            return {"error": f"{root / name} already exists; pass overwrite=True to replace it once the new "
                             f"save of step {step} is committed, or remove it"}
        tmp_name = f"{TEMP_PREFIX}{name}-{secrets.token_hex(4)}"
        (root / tmp_name).mkdir()
    except OSError as exc:
        return {"error": f"saving {name} failed: {_describe(exc, str(root))}; {describe_last_good(root)}"}
    return {"tmp": tmp_name}


def _write_fragment(tmp: Path, step: int, rank: int, payload: RankPayload, event) -> dict:
    """Write this rank's file; the fragment describing it, or {"rank", "error"}."""
    if payload.error is not None:
        return {"rank": rank, "error": payload.error}
    file = rank_filename(rank)
    tensors = {key: t for key, (_, t) in payload.shards.items()}

    try:
        digest = write_shard_file(tmp / file, tensors, lambda: event("writing_data", step))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 so that no peer waits for this rank in vain
        return {"rank": rank, "error": f"rank {rank}: {_describe(exc, file)}"}
    try:
        assets = _write_assets(tmp, payload.assets or {})
    except OSError as exc:
        return {"rank": rank, "error": f"rank {rank}: {_describe(exc, ASSETS_DIR)}"}
    shards = [{"key": key, "name": spec.name, "dtype": dtype_name(t.dtype), "global_shape": list(spec.global_shape),
               "offset": list(spec.offset), "shape": list(t.shape)} for key, (spec, t) in payload.shards.items()]
    return {"rank": rank, "step": step, "file": file, "size": digest.size, "sha256": digest.sha256, "shards": shards,
            "rank_state": payload.rank_state, "shared_state": payload.shared_state, "assets": assets}


def _write_assets(tmp: Path, assets: dict[str, bytes]) -> dict[str, list]:
    """Write the assets under tmp/assets/ (fsynced); {"assets/<name>": [size, sha256]}."""
    if not assets:
        return {}
    (tmp / ASSETS_DIR).mkdir()
    digests = {f"{ASSETS_DIR}/{name}": write_durable(tmp / ASSETS_DIR / name, data) for name, data in assets.items()}
    fsync_dir(tmp / ASSETS_DIR)
    return {name: [d.size, d.sha256] for name, d in digests.items()}


def _commit(root: Path, tmp: Path, step: int, fragments: list[dict], overwrite: bool, event) -> dict:
    """Rank 0: index, manifest, rename, `latest`; {"path": name} or {"error": message}."""
    name = step_dirname(step)
    errors = [f["error"] for f in fragments if "error" in f]
    try:
        if errors:
            more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
            raise CheckpointError(errors[0] + more)
        index = build_index(step, fragments)
        digests = file_digests(fragments)
        digests[INDEX_FILE] = write_durable(tmp / INDEX_FILE, index.to_json())
        event("committing", step)
        write_durable(tmp / MANIFEST_FILE, Manifest(step, digests).to_json())
        fsync_dir(tmp)
        _install(tmp, root / name, overwrite)
    except Exception as exc:  # noqa: BLE001 - every rank must hear the outcome, whatever went wrong
        shutil.rmtree(tmp, ignore_errors=True)
        return {"error": f"saving {name} failed: {_describe(exc, name)}; {describe_last_good(root)}"}
    _point_latest(root, name)
    newer = [p.name for p in list_checkpoints(root) if parse_step_dirname(p.name) > step]
    if newer:
        warnings.warn(f"committed {name} while newer {newer[-1]} exists in {root}; find_latest() resumes from "
                      f"the highest step", CheckpointWarning, stacklevel=4)
    return {"path": name}


def _install(tmp: Path, final: Path, overwrite: bool) -> None:
    """Put the committed temporary directory in place as `final`, replacing an old save only with `overwrite`."""
    if not final.exists():
        os.rename(tmp, final)
        fsync_dir(final.parent)
        return
    if not overwrite:
        raise CheckpointError(f"{final} appeared while the save ran; it was not replaced")
    if not exchange_dirs(tmp, final):
        # No atomic swap here: for a moment between the two renames `final`
        # does not exist, and a crash then leaves both checkpoints under
        # hidden names (quarantine_incomplete keeps them; resume falls back
        # to an older step).
        aside = tmp.with_name(tmp.name + "-replaced")
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(aside, final)  # the old checkpoint goes back; the save fails
            raise
        tmp = aside
    fsync_dir(final.parent)
    # The old checkpoint now sits under the temporary name: discard it.
    shutil.rmtree(tmp, ignore_errors=True)


def _point_latest(root: Path, name: str) -> None:
    try:
        update_latest_pointer(root, name)
    except OSError as exc:
        # The checkpoint is committed and find_latest() scans directories;
        # a stale pointer only misleads people, so it must not fail the save.
        warnings.warn(f"committed {name} but could not update {root / 'latest'}: {exc.strerror}",
                      CheckpointWarning, stacklevel=4)


def _describe(exc: Exception, file: str) -> str:
    """One line for an error of a save; `file` names what was being written when the error does not."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    if isinstance(exc, OSError):
        file = os.path.basename(exc.filename) if exc.filename else file
        if exc.errno == errno.ENOSPC:
            return f"no space left on device while writing {file}"
        return f"could not write {file}: {exc.strerror or exc}"
    return f"internal error while writing {file}: {type(exc).__name__}: {exc}"
