"""How the ranks of one save agree: a small interface, one process-group implementation, one for a single process.

A save needs three meetings: rank 0 announces the temporary directory
(`broadcast_object`), every rank reports what it wrote (`gather_objects`), and
rank 0 announces the outcome (`broadcast_object`). The objects are small
JSON values (dicts, lists, strings, numbers) built by the checkpoint code;
they travel as UTF-8 JSON in uint8 tensors, never pickled.

`DistCoordinator` talks over a torch.distributed group of its own choosing
rather than through `paratrain.comm`: these are control messages of the
storage layer, not training traffic on a mesh axis, and a background save
must not share a group with training collectives. The group must take CPU
tensors (gloo); under NCCL pass ``dist.new_group(backend="gloo")``, which
`dedicated_coordinator` creates.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from paratrain.checkpoint.format import CheckpointError


@runtime_checkable
class Coordinator(Protocol):
    """The collective operations a save uses. `rank` is the rank within the saving group."""

    rank: int
    world_size: int

    def barrier(self) -> None:
        """Return once every rank has called barrier()."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (a JSON value), returned on every rank; other ranks' arguments are ignored."""

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (a JSON value) in rank order on rank 0; None on the other ranks."""


class LocalCoordinator:
    """The coordinator of a job with one process. Objects still round-trip through JSON, as between ranks."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any) -> Any:
        return _decode(_encode(obj))

    def gather_objects(self, obj: Any) -> list[Any]:
        return [_decode(_encode(obj))]


class DistCoordinator:
    """A coordinator over a torch.distributed group (None: the default group) that takes CPU tensors."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise CheckpointError("DistCoordinator needs torch.distributed initialised; "
                                  "use LocalCoordinator for a single process")
        backend = str(dist.get_backend(group))
        if "gloo" not in backend:
            raise CheckpointError(f"DistCoordinator needs a group with the gloo backend (CPU tensors), got "
                                  f"{backend!r}; pass dist.new_group(backend='gloo') or use dedicated_coordinator()")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Collectives take global ranks as src/dst, whatever the group.
        self._root = 0 if group is None else dist.get_global_rank(group, 0)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    # Every tensor here is a CPU tensor named so: this group is gloo's, whatever the default device.
    def broadcast_object(self, obj: Any) -> Any:
        payload = _encode(obj) if self.rank == 0 else None
        size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device="cpu")
        dist.broadcast(size, src=self._root, group=self.group)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
        dist.broadcast(payload, src=self._root, group=self.group)
        return _decode(payload)

    def gather_objects(self, obj: Any) -> list[Any] | None:
        payload = _encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64, device="cpu") for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device="cpu"), group=self.group)
        longest = max(int(s.item()) for s in sizes)
        # gather needs equal sizes: pad every payload to the longest one.
        padded = torch.zeros(longest, dtype=torch.uint8, device="cpu")
        padded[: payload.numel()] = payload
        if self.rank != 0:
            dist.gather(padded, None, dst=self._root, group=self.group)
            return None
        received = [torch.empty(longest, dtype=torch.uint8, device="cpu") for _ in range(self.world_size)]
        dist.gather(padded, received, dst=self._root, group=self.group)
        return [_decode(r[: int(s.item())]) for r, s in zip(received, sizes)]


def dedicated_coordinator(group: dist.ProcessGroup | None = None, timeout: timedelta | None = None) -> DistCoordinator:
    """A DistCoordinator on a new gloo group with the ranks of `group` (None: the world).

    Collective: every rank of the world must call it, in the same order as
    other group creations (torch.distributed's rule for `new_group`).
    `timeout` bounds each meeting (None: torch's default for new groups).
    """
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return DistCoordinator(dist.new_group(ranks=ranks, backend="gloo", timeout=timeout))


def _encode(obj: Any) -> torch.Tensor:
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    return json.loads(payload.numpy().tobytes().decode("utf-8"))
