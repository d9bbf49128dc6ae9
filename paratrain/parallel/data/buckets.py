"""DDP and ZeRO-1/2's flat gradient buckets: what each holds and where, and ZeRO's way back out.

`ddp.py`'s engine moves gradients into these buckets while backward runs and reduces them;
this module lays the buckets out, once: which parameters share a bucket (`make_buckets`),
where each parameter's rows sit in it (`Slot`), a buffer whose padding is zero
(`new_buffer`); and, after ZeRO's optimizer step, all-gathers the updated parameters
(`all_gather_parameters`): in place where a parameter's rows split evenly over the ranks (its
own storage is then its N chunks), through the same layout for the others.

The shard layout is paratrain.parallel.data.shard's: rank r owns rows
[r·c, (r+1)·c) of every parameter. A bucket's buffer holds N equal chunks;
chunk r packs rank r's (padded) rows of each parameter of the bucket, so a
reduce-scatter leaves in chunk r exactly the gradient rank r's optimizer
needs, and the all-gather of updated parameters through a buffer is the same
layout in the other direction. A gradient's first write into a bucket is a copy and later
ones add, so no bucket is zeroed per step (only the padding, once per buffer,
and the parameters a backward did not reach, when their bucket is launched).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import Axis
from paratrain.parallel.data.shard import as_rows, chunk_padding, chunk_tiles, padded_chunk_numel, row_range


@dataclass
class Slot:
    """Where one parameter lives in its bucket and which of its rows this rank owns."""

    name: str
    param: nn.Parameter
    offset: int  # within every rank's chunk
    chunk_numel: int  # padded rows × row size
    rows: tuple[int, int]  # owned rows [lo, hi)
    master: torch.Tensor | None = None
    value: torch.Tensor | None = None  # where the master's value is when not in it (a host copy)
    filled: bool = False  # a gradient was written into the bucket since it was last reduced
    # Views of a bucket buffer that lives for the run (DDP, ZeRO-1): made once, not per gradient or step.
    span: torch.Tensor | None = None  # DDP: the parameter's gradient in its bucket
    reduced: torch.Tensor | None = None  # this rank's reduced rows, shaped as the master

    def source(self) -> torch.Tensor:
        """The tensor holding the master's value: the master, or its host copy."""
        return self.master if self.value is None else self.value

    def columns(self, buffer: torch.Tensor, shards: int) -> torch.Tensor:
        """This parameter's [N, c·rest] columns of a bucket buffer of N chunks."""
        return buffer.view(shards, -1)[:, self.offset:self.offset + self.chunk_numel]


@dataclass
class Bucket:
    slots: list[Slot]
    chunk_numel: int
    buffer: torch.Tensor | None = None  # N chunks of reduce dtype
    ready: int = 0  # slots written in the current backward (the synced one, for DDP / ZeRO-1)
    work: object = None
    launched_in_backward: bool = False
    shard_grad: torch.Tensor | None = None  # ZeRO-2: this rank's reduced rows, summed over backwards (master dtype)
    launched_at: float = field(default=0.0)
    gather: Gather | None = None  # ZeRO-1: the all-gather of updated parameters through `buffer`, made once


@dataclass
class Gather:
    """The copies around one bucket's all-gather of updated parameters, as lists for foreach kernels.

    A parameter whose rows split evenly over the ranks is its own gather buffer: flat, its storage is the N
    chunks of its rows in rank order, so this rank's rows are written into the parameter itself and gathered
    there in place (`whole`), with nothing to copy out. The others (a first dimension that does not divide,
    whose chunks are padded; the small ones, `IN_PLACE_MIN_ELEMENTS`) go through a buffer of N chunks that hold
    only them (laid out as the bucket's, without the parameters gathered in place) and are copied out of it."""

    buffer: torch.Tensor | None  # N chunks of param dtype, for the parameters not gathered in place (None: none)
    mine: list[torch.Tensor]  # where each master's rows go (flat): this rank's chunk, or its rows of the parameter
    masters: list[torch.Tensor]  # each master, flat
    padding: list[torch.Tensor]  # this rank's chunk: what holds no row (zeroed before the gather)
    rows: list[torch.Tensor]  # each parameter's rows, in tiles
    parts: list[torch.Tensor]  # the gathered buffer's matching tiles
    whole: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (parameter flat, its rows here)
    reuses: bool = False  # `buffer` is the bucket's gradient buffer: its gradients are spent before it gathers


@dataclass
class InFlight:
    """A ZeRO reduce-scatter on its way: its input must live until it completes."""

    bucket: Bucket
    work: object
    buffer: torch.Tensor | None  # None once reduced (hybrid sharding: while the shard is summed over replicas)
    out: torch.Tensor | None  # ZeRO-2's separate output; None for ZeRO-1 (in place)


def make_buckets(named, bucket_mb: float, dtype: torch.dtype, shards: int, rank: int) -> list[Bucket]:
    """Group parameters, in reverse registration order, into buckets of about bucket_mb of `dtype`."""
    limit = max(1, int(bucket_mb * 2**20 / dtype.itemsize))
    buckets, slots, size = [], [], 0
    for name, p in reversed(named):
        numel = padded_chunk_numel(p.shape, shards)
        d0 = p.shape[0] if p.dim() else 1
        slots.append(Slot(name, p, size, numel, row_range(d0, shards, rank)))
        size += numel
        if size * shards >= limit:
            buckets.append(Bucket(slots, size))
            slots, size = [], 0
    if slots:
        buckets.append(Bucket(slots, size))
    return buckets


def new_buffer(bucket: Bucket, shards: int, dtype: torch.dtype) -> torch.Tensor:
    """A bucket buffer whose padding is zero (the rest is written before it is read)."""
    device = bucket.slots[0].param.device
    buffer = torch.empty(bucket.chunk_numel * shards, dtype=dtype, device=device)
    for slot in bucket.slots:
        rows = as_rows(slot.param.detach())
        for pad in chunk_padding(rows.shape[0], rows.shape[1], slot.columns(buffer, shards)):
            pad.zero_()
    return buffer


@torch.no_grad()
def all_gather_parameters(bucket: Bucket, comm: Comm, axis: Axis, shards: int, rank: int, dtype: torch.dtype,
                          buffer_lives: bool) -> None:
    """Every rank sends its updated rows; everyone receives the whole bucket (Ψ_b (N−1)/N).

    Each parameter whose rows split evenly is gathered in place (`Gather`): one collective each, nothing
    copied out. The rest go through one buffer: ZeRO-1's own bucket buffer when it has the parameters'
    dtype (its gradients are spent once the optimizer has stepped; the masters' `.grad`, views of it, are
    released first); ZeRO-2, whose buckets exist only while reduced (not `buffer_lives`), a buffer of its
    own each step. The plan is made once for the run where nothing in it is made per step.
    """
    gather = bucket.gather
    if gather is None:
        reuse = buffer_lives and bucket.buffer.dtype == dtype
        gather = _gather_plan(bucket, bucket.buffer if reuse else None, shards, rank, dtype)
        bucket.gather = gather if reuse or gather.buffer is None else None  # nothing in it made per step
    if gather.reuses:
        for slot in bucket.slots:
            slot.master.grad = None  # the buffer's gradients are about to be parameters
    torch._foreach_copy_(gather.mine, gather.masters, non_blocking=True)  # (from pinned host values: asynchronous)
    if gather.padding:
        torch._foreach_zero_(gather.padding)
    works = [comm.all_gather(flat, own, axis, async_op=True) for flat, own in gather.whole]
    if gather.buffer is not None:
        comm.all_gather(gather.buffer, gather.buffer.view(shards, -1)[rank], axis)
        torch._foreach_copy_(gather.rows, gather.parts)
    comm.wait(works, axis)


def _gather_plan(bucket: Bucket, buffer: torch.Tensor | None, shards: int, rank: int, dtype: torch.dtype) -> Gather:
    """The views around `bucket`'s all-gather of updated parameters: in place for a parameter whose rows split
    evenly, the rest through N chunks that hold only them, in `buffer`'s storage (the bucket's own; None: a new one
    of `dtype`, made only if some parameter needs it)."""
    in_place = [_in_place(slot.param.data, shards, dtype) for slot in bucket.slots]
    chunk = sum(slot.chunk_numel for slot, whole in zip(bucket.slots, in_place) if not whole)
    gather = Gather(None, [], [], [], [], [], reuses=buffer is not None and chunk > 0)
    if chunk:
        gather.buffer = (buffer[:chunk * shards] if buffer is not None else
                         torch.empty(chunk * shards, dtype=dtype, device=bucket.slots[0].param.device))
    offset = 0
    for slot, whole in zip(bucket.slots, in_place):
        numel = slot.master.numel()
        gather.masters.append(slot.source().view(-1))
        if whole:
            flat = slot.param.data.view(-1)
            gather.mine.append(flat[rank * numel:(rank + 1) * numel])
            gather.whole.append((flat, gather.mine[-1]))
            continue
        columns = gather.buffer.view(shards, chunk)[:, offset:offset + slot.chunk_numel]
        gather.mine.append(columns[rank, :numel])
        if numel < slot.chunk_numel:
            gather.padding.append(columns[rank, numel:])
        for rows, part in chunk_tiles(as_rows(slot.param.data), columns):
            gather.rows.append(rows)
            gather.parts.append(part)
        offset += slot.chunk_numel
    return gather


# Parameters smaller than this share one gather through the bucket's buffer: a collective of their own would cost more
# in its launch and latency (~10-50 µs on NCCL) than copying them out of the buffer does (norm gains, biases).
IN_PLACE_MIN_ELEMENTS = 2**12


def _in_place(param: torch.Tensor, shards: int, dtype: torch.dtype) -> bool:
    """Whether `param`'s own storage is its all-gather's output: contiguous, in the gather's dtype, its rows split
    evenly (no padded chunk), and large enough to be worth a collective of its own."""
    return (param.is_contiguous() and param.dtype == dtype and as_rows(param).shape[0] % shards == 0
            and param.numel() >= IN_PLACE_MIN_ELEMENTS)


def storage_bytes(tensors) -> int:
    """Total bytes of the distinct storages behind `tensors` (None entries ignored)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
