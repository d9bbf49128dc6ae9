"""Replicas: parameters that must be bit-for-bit equal on the ranks of an axis, checked and made so.

A 64-bit hash of the exact bits of a list of tensors tells whether replicas agree: computed in
pieces, so that hashing a 7B model never holds more than a few tens of MB beside it, and with each
element weighted by its position, so that two tensors holding the same values in a different
order differ. Start-up uses it to skip the broadcast of the whole model when every rank
initialized identically (the usual case: the same seed), and otherwise broadcasts it a bucket at
a time; the run's guard uses it to detect replicas that drifted apart. Under hybrid sharding the
replicas of a ZeRO shard group sum their reduced shards (`ReplicaSum`).
"""

from __future__ import annotations

from typing import Callable

import torch

from paratrain.comm import Comm
from paratrain.mesh import Axis

_PIECE = 1 << 22  # elements hashed at once: 32 MB of int64 temporaries per piece
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def bit_hash(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 64-bit hash (0-d int64 on the tensors' device) of the exact bits of `tensors`, in order."""
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros((), dtype=torch.int64, device=device)
    weights = None
    for i, t in enumerate(tensors):
        bits = t.detach().reshape(-1).view(INT_OF_SIZE[t.element_size()])
        for start in range(0, bits.numel(), _PIECE):
            piece = bits[start:start + _PIECE].to(torch.int64)
            if weights is None or weights.numel() < piece.numel():
                # odd multipliers of the golden ratio (mod 2^64): every position weighs differently
                weights = torch.arange(min(bits.numel(), _PIECE), dtype=torch.int64, device=device) * 2 + 1
                weights *= -7046029254386353131
            total = total * 1_000_003 + (piece * weights[:piece.numel()]).sum() + (start + 1)
        total = total * 1_000_003 + (i + 1)  # wraps modulo 2^64
    return total


@torch.no_grad()
def make_replicas(params: list[torch.Tensor], comm: Comm, axis: Axis, bucket_bytes: int) -> bool:
    """Make `params` equal to the first rank's of `axis`; returns whether anything was broadcast.

    Nothing moves when every rank already holds the same bits (checked by hash: one small
    all-gather and one host read, once, at start-up). Otherwise the parameters are broadcast in
    groups of about `bucket_bytes`, so at most one group's flat copy exists beside the model.
    """
    n = comm.mesh.size(axis)
    if n == 1 or not params:
        return False
    mine = bit_hash(params).reshape(1)
    every = torch.empty(n, dtype=torch.int64, device=mine.device)
    comm.all_gather(every, mine, axis)
    if bool((every == every[0]).all()):
        return False
    group: list[torch.Tensor] = []
    size = 0
    for p in params:
        if group and p.dtype != group[0].dtype:  # one flat buffer holds one dtype
            _broadcast_group(group, comm, axis)
            group, size = [], 0
        group.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            _broadcast_group(group, comm, axis)
            group, size = [], 0
    if group:
        _broadcast_group(group, comm, axis)
    return True


def _broadcast_group(tensors: list[torch.Tensor], comm: Comm, axis: Axis) -> None:
    if len(tensors) == 1 and tensors[0].is_contiguous():
        comm.broadcast(tensors[0].data, axis, src=0)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.broadcast(flat, axis, src=0)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class ReplicaSum:
    """Hybrid sharding's sum of each reduced ZeRO shard over the replicas (`dp_replicate`), one in flight.

    `push(shard, then)` lands the sum in flight, if any, then launches the asynchronous all-reduce
    of `shard`; `then()` runs once its sum has landed (at the next `push`, or at `land()` when the
    round or step ends). A 1/dp_shard shard is small enough to leave on its way while the next
    bucket or unit computes, on any device. Both ZeRO engines sum their shards through this.
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        self._pending: tuple[object, torch.Tensor, Callable[[], None]] | None = None  # (work, shard, then)

    def push(self, shard: torch.Tensor, then: Callable[[], None]) -> None:
        self.land()
        self._pending = (self.comm.all_reduce(shard, Axis.DP_REPLICATE, async_op=True), shard, then)

    def land(self) -> None:
        if self._pending is not None:
            work, _, then = self._pending
            self._pending = None
            self.comm.wait([work], Axis.DP_REPLICATE)
            then()

    @property
    def in_flight(self) -> torch.Tensor | None:
        """The shard being summed now (for memory accounting), or None."""
        return self._pending[1] if self._pending is not None else None
