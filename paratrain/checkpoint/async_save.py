"""Saving in the background: training pauses only while this rank's shards are copied into CPU memory.

    saver = AsyncCheckpointer(root, keep_latest=2)      # collective: creates its own gloo group
    for step in ...:
        ...
        if step % every == 0:
            saver.save(step, shards, rank_state, shared_state)   # returns after the copy
    saver.close()                                                # waits for the last save

At most one save is in flight: `save` first waits for the previous one.
The background thread runs the same protocol as `save_checkpoint`, so
`latest` and retention move only once its commit is complete, and a crash
while it runs leaves the previous checkpoints as they were. An error of the
background save is raised by the next `save`, `wait` or `close` call.
`abandon` (the caller failed) stops a save in flight before it commits, as a
crash would.

The ranks coordinate over a process group created for the checkpointer
alone: collectives of a background thread on the training group would
interleave with the training's own and deadlock or mismatch.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from paratrain.checkpoint.coordinator import Coordinator, LocalCoordinator, dedicated_coordinator
from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.save import (
    EventHook, PinnedStaging, RankPayload, Shards, check_save_options, prepare_payload, run_save,
)


class AsyncCheckpointer:
    """Checkpoints written and committed by a background thread, one at a time.

    `coordinator` must not be used by anything else while a save runs; by
    default a dedicated gloo group over the ranks of `group` (None: the
    world) is created here, collectively, or a LocalCoordinator without
    torch.distributed.
    """

    def __init__(self, root: str | os.PathLike, *, keep_latest: int | None = None,
                 coordinator: Coordinator | None = None, group: dist.ProcessGroup | None = None,
                 on_event: EventHook = None, after_commit: Callable[[int, Path | None], None] | None = None):
        check_save_options(0, keep_latest)
        self.on_event, self.after_commit = on_event, after_commit
        self._staging = PinnedStaging()  # this saver's host buffers: another saver's may be in flight
        self._abandoned = threading.Event()
        self._gave_up = False  # the background thread failed its save because of `abandon`
        self.root = Path(root)
        self.keep_latest = keep_latest
        self._owns_group = coordinator is None and dist.is_initialized()
        if coordinator is None:
            coordinator = dedicated_coordinator(group) if dist.is_initialized() else LocalCoordinator()
        self.coordinator = coordinator
        self._thread: threading.Thread | None = None
        self._step: int | None = None  # of the last save started
        self._error: BaseException | None = None
        self._last: Path | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still running."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, shards: Shards, rank_state: dict | None = None, shared_state: dict | None = None,
             *, overwrite: bool = False, assets: dict[str, bytes] | None = None) -> float:
        """Start saving checkpoint `step` (arguments as `save_checkpoint`); return once the tensors are copied.

        Collective like `save_checkpoint`. Waits for the previous save first
        and raises its error, if it failed. Returns the seconds the copy took (what the caller's step waited
        beyond the previous save).
        """
        self.wait()
        check_save_options(step, self.keep_latest)
        start = time.perf_counter()
        payload = prepare_payload(self.coordinator.rank, shards, rank_state, shared_state, copy=True,
                                  staging=self._staging, assets=assets)
        copied = time.perf_counter() - start
        self._step = step
        self._thread = threading.Thread(target=self._run, args=(step, payload, overwrite),
                                        name=f"paratrain-checkpoint-{step}", daemon=True)
        self._thread.start()
        return copied

    def _run(self, step: int, payload: RankPayload, overwrite: bool) -> None:
        path = None
        try:
            self._last = path = run_save(self.root, step, payload, self.coordinator, self.keep_latest, overwrite,
                                         self._event)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by wait()
            self._error = exc
        if self.after_commit is not None:
            try:
                self.after_commit(step, path)
            except BaseException as exc:  # noqa: BLE001 - as the save's own
                self._error = self._error or exc

    def _event(self, name: str, step: int) -> None:
        # The two points where a failure makes every rank give the save up cleanly: this rank's
        # shard file (its fragment reports the error) and rank 0's commit (it removes the
        # temporary directory and tells every rank).
        if self._abandoned.is_set() and name in ("writing_data", "committing"):
            self._gave_up = True
            raise CheckpointError(f"abandoned at {name.replace('_', ' ')}: the training loop failed")
        if self.on_event is not None:
            self.on_event(name, step)

    def abandon(self) -> int | None:
        """The caller failed: a save in flight is not to be committed; `latest` and retention stay where they are.

        The background thread fails the save at its next point (a shard file's data, the commit),
        as a crash there would; this rank waits for that only without peers (a peer may be gone,
        and the thread with it). With peers, rank 0 decides: a save whose commit had begun may
        still complete, whole. Returns the step of a save abandoned here (known only without peers), else None.
        """
        self._abandoned.set()
        # A save replicated to other ranks is never waited for either: the replication may wait on one that is gone.
        alone = self.coordinator.world_size == 1 and self.after_commit is None
        if self._thread is not None and alone:
            self._thread.join()
        abandoned = alone and self._gave_up and self._error is not None
        self._thread = self._error = None
        return self._step if abandoned else None

    def wait(self) -> Path | None:
        """Block until no save is in flight; return the last committed directory, or raise the background error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"background checkpoint save failed: {type(error).__name__}: {error}") from error
        return self._last

    def close(self) -> Path | None:
        """Wait for the save in flight, then release the dedicated group. Returns what `wait` returns."""
        try:
            return self.wait()
        finally:
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group(self.coordinator.group)
                self._owns_group = False

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
