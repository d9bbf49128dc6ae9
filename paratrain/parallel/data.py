"""Data parallelism and ZeRO-1/2: gradients in flat buckets, reduced while backward runs.

Every rank holds the whole model and computes on its slice of the batch.
Gradients are added, as autograd finishes each parameter's gradient, into
flat buckets (in the order they become ready: reverse registration order) and
dropped from `.grad`, so a gradient exists once; under gradient accumulation
(`no_sync`) every micro-batch adds into the same buckets. In the synced
backward, the moment a bucket is complete its collective is launched
asynchronously, so communication overlaps the rest of backward. Buckets are launched strictly in
bucket order, so every rank issues the same collectives in the same order
even when different ranks finish parameters in a different order.

Per stage, with Ψ parameters and N data ranks (bytes per rank, Adam):

=======  ====================================  ===========================  =================
stage    gradient communication per step       after backward, each rank    master + moments
=======  ====================================  ===========================  =================
0 (DDP)  all-reduce: 2Ψ(N−1)/N                 full gradients               full (12Ψ / 8Ψ)
1        reduce-scatter Ψ(N−1)/N after          full gradient buffers        1/N
         backward + all-gather of updated
         parameters Ψ(N−1)/N
2        as 1, reduce-scatter bucket by bucket  only its gradient shard      1/N
=======  ====================================  ===========================  =================

The shard layout is paratrain.parallel.shard's: rank r owns rows
[r·c, (r+1)·c) of every parameter. A bucket's buffer holds N equal chunks;
chunk r packs rank r's (padded) rows of each parameter of the bucket, so a
reduce-scatter leaves in chunk r exactly the gradient rank r's optimizer
needs, and the all-gather of updated parameters is the same layout in the
other direction.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import Mesh
from paratrain.parallel.shard import as_rows, padded_chunk_numel, row_range, rows_per_rank
from paratrain.precision import Precision


@dataclass
class Slot:
    """Where one parameter lives in its bucket and which of its rows this rank owns."""

    name: str
    param: nn.Parameter
    offset: int  # within every rank's chunk
    chunk_numel: int  # padded rows × row size
    rows: tuple[int, int]  # owned rows [lo, hi)
    master: torch.Tensor | None = None


@dataclass
class Bucket:
    slots: list[Slot]
    chunk_numel: int
    buffer: torch.Tensor | None = None  # N chunks of reduce dtype
    ready: int = 0
    work: object = None
    launched_in_backward: bool = False
    shard_grad: torch.Tensor | None = None  # this rank's reduced chunk (stage 2: a persistent copy)
    launched_at: float = field(default=0.0)


class DataParallelEngine:
    """DDP (stage 0) and ZeRO-1/2 over the `dp` axis of a mesh, for any nn.Module (an `Engine`, see engine.py)."""

    params_sharded = False  # every data rank holds every parameter whole

    def __init__(self, model: nn.Module, mesh: Mesh, comm: Comm, precision: Precision, stage: int = 0,
                 bucket_mb: float = 25.0, grad_reduction: str = "mean"):
        assert stage in (0, 1, 2) and grad_reduction in ("mean", "sum")
        self.model, self.comm, self.precision, self.stage = model, comm, precision, stage
        self.dp = mesh.size("dp")
        self.shards = self.dp if stage > 0 else 1
        self.rank = mesh.coord("dp") if stage > 0 else 0
        self.pre_divide = self.dp if grad_reduction == "mean" else 1
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._broadcast_parameters([p for _, p in named])
        self.buckets = self._make_buckets(named, bucket_mb)
        order = {id(p): i for i, (_, p) in enumerate(named)}
        self.slots = sorted((s for b in self.buckets for s in b.slots), key=lambda s: order[id(s.param)])
        self._make_masters()
        for slot in self.slots:
            slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._where = {s.param: (b, s) for b in self.buckets for s in b.slots}
        self._index = {s.param: i for i, s in enumerate(self.slots)}
        self._sync = True
        # A step's gradients are being collected: from its first gradient to finish_gradients().
        self._accumulating = False
        self._in_backward = False  # the synced backward has begun launching buckets
        self._next_launch = 0
        self._used_mask = torch.zeros(len(self.slots), device=self.slots[0].param.device if self.slots else None)

    # -- construction ---------------------------------------------------------
    def _broadcast_parameters(self, params: list[nn.Parameter]) -> None:
        """Start every replica from dp rank 0's values (one flat broadcast)."""
        if self.dp == 1:
            return
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in params])
            self.comm.broadcast(flat, "dp", src=0)
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _make_buckets(self, named, bucket_mb: float) -> list[Bucket]:
        """Group parameters, in reverse registration order, into buckets of about bucket_mb."""
        limit = max(1, int(bucket_mb * 2**20 / self.precision.reduce_dtype.itemsize))
        buckets, slots, size = [], [], 0
        for name, p in reversed(named):
            numel = padded_chunk_numel(p.shape, self.shards)
            d0 = p.shape[0] if p.dim() else 1
            slots.append(Slot(name, p, size, numel, row_range(d0, self.shards, self.rank)))
            size += numel
            if size * self.shards >= limit:
                buckets.append(Bucket(slots, size))
                slots, size = [], 0
        if slots:
            buckets.append(Bucket(slots, size))
        return buckets

    def _make_masters(self) -> None:
        """fp32 master rows of each parameter: the parameter's own storage when it is fp32."""
        for slot in self.slots:
            lo, hi = slot.rows
            with torch.no_grad():
                rows = as_rows(slot.param.detach())[lo:hi]
                if self.precision.mixed:
                    # copy=True: a view would keep the whole fp32 parameter alive after the cast below.
                    master = rows.to(self.precision.master_dtype, copy=True)
                    slot.master = master.reshape(hi - lo, *slot.param.shape[1:])
                    slot.param.data = slot.param.data.to(self.precision.param_dtype)
                elif self.stage == 0:
                    slot.master = slot.param  # plain DDP: the optimizer updates the parameters themselves
                else:
                    slot.master = slot.param.detach()[lo:hi] if slot.param.dim() else slot.param.detach().reshape(1)[lo:hi]
        if self.stage > 0 or self.precision.mixed:
            for bucket in self.buckets:
                if self.stage < 2:
                    bucket.buffer = self._new_buffer(bucket)

    def _new_buffer(self, bucket: Bucket) -> torch.Tensor:
        device = bucket.slots[0].param.device
        return torch.zeros(bucket.chunk_numel * self.shards, dtype=self.precision.reduce_dtype, device=device)

    # -- the engine contract --------------------------------------------------
    def masters(self) -> list[torch.Tensor]:
        return [s.master for s in self.slots]

    def master_names(self) -> list[str]:
        return [s.name for s in self.slots]

    def master_rows(self) -> list[tuple[str, tuple[int, int], torch.Size]]:
        """Per master (in `masters()` order): parameter name, the rows [lo, hi) of the parameter it holds, the parameter's shape.

        For checkpoints: DDP masters hold every row (and are equal on all dp ranks); ZeRO-1/2
        masters hold this rank's rows of `shard.py`'s layout.
        """
        return [(s.name, s.rows, s.param.shape) for s in self.slots]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (in the buckets) without communicating; the next synced backward reduces all."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # -- backward: buckets fill and launch -------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._accumulating:
            self._start_accumulation()
        if self._sync and not self._in_backward:
            self._start_backward()
        bucket, slot = self._where[param]
        self._pack(bucket, slot, param.grad)
        self._used_mask[self._index[param]] = 1.0
        param.grad = None  # the bucket holds it now: gradients never exist twice
        if self._sync:
            bucket.ready += 1
            self._launch_ready_buckets(in_backward=True)

    def _start_accumulation(self) -> None:
        """The first gradient of a step: zeroed buckets collect every micro-batch's gradients until the synced one."""
        self._accumulating = True
        self._used_mask.zero_()
        for bucket in self.buckets:
            if bucket.buffer is None:
                bucket.buffer = self._new_buffer(bucket)
            else:
                bucket.buffer.zero_()

    def _start_backward(self) -> None:
        self._in_backward = True
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None

    def _pack(self, bucket: Bucket, slot: Slot, grad: torch.Tensor) -> None:
        """Add a gradient into the bucket (÷ the pre-division): rank r's padded rows into chunk r."""
        rows = as_rows(grad)
        c = rows_per_rank(rows.shape[0], self.shards)
        chunks = bucket.buffer.view(self.shards, bucket.chunk_numel)
        for r in range(self.shards):
            piece = rows[r * c:(r + 1) * c].reshape(-1)
            chunks[r, slot.offset:slot.offset + piece.numel()].add_(piece, alpha=1.0 / self.pre_divide)

    def _launch_ready_buckets(self, in_backward: bool) -> None:
        """Launch complete buckets in bucket order (a later bucket waits for an earlier one)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if in_backward and bucket.ready < len(bucket.slots):
                return
            self._launch(bucket, in_backward)
            self._next_launch += 1

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        bucket.launched_in_backward, bucket.launched_at = in_backward, time.perf_counter()
        if self.stage == 0:
            bucket.work = self.comm.all_reduce(bucket.buffer, "dp", async_op=True)
        elif self.stage == 1 or self.stage == 2:
            # Stage 1 reduces in place (this rank's chunk of the persistent buffer);
            # stage 2 reduces into a separate shard so the full buffer can be freed.
            chunk = bucket.buffer.view(self.shards, -1)[self.rank]
            out = chunk if self.stage == 1 else torch.empty_like(chunk)
            bucket.shard_grad = out
            bucket.work = self.comm.reduce_scatter(out, bucket.buffer, "dp", async_op=True)

    def finish_gradients(self) -> torch.Tensor:
        """Launch the buckets still waiting (parameters the synced backward did not reach, whose gradients
        came from earlier micro-batches or from none; all of them when every backward ran under no_sync),
        wait for every reduction, and point the master gradients at the reduced rows.

        Returns, per master, how many data ranks reached it this step (the last step's counts when no
        gradient came since).
        """
        if not self._accumulating:
            return self._used_mask
        if not self._in_backward:
            self._start_backward()
        self._launch_ready_buckets(in_backward=False)
        mask_work = self.comm.all_reduce(self._used_mask, "dp", async_op=True)
        self.comm.wait([b.work for b in self.buckets] + [mask_work], "dp")
        self._assign_master_grads()
        self._in_backward = self._accumulating = False
        return self._used_mask

    def drop_gradients(self, indices: list[int]) -> None:
        for i in indices:
            self.slots[i].master.grad = None

    def _assign_master_grads(self) -> None:
        for bucket in self.buckets:
            source = bucket.buffer if self.stage == 0 else bucket.shard_grad
            for slot in bucket.slots:
                lo, hi = slot.rows
                shape = slot.master.shape
                grad = source[slot.offset:slot.offset + (hi - lo) * _row_numel(slot.param)].view(shape)
                slot.master.grad = grad if grad.dtype == slot.master.dtype else grad.to(slot.master.dtype)
            if self.stage == 2:
                bucket.buffer = None  # the full gradient is gone; only this rank's shard remains

    # -- after the optimizer step ------------------------------------------------
    def after_step(self) -> None:
        """Bring the model's parameters up to date with the masters."""
        if self.precision.mixed:
            for slot in self.slots:
                slot.master.grad = None  # fp32 copies made for this step only
        if self.stage == 0:
            if self.precision.mixed:
                with torch.no_grad():
                    for slot in self.slots:
                        slot.param.copy_(slot.master.view_as(slot.param))
            return
        for bucket in self.buckets:
            self._all_gather_parameters(bucket)

    @torch.no_grad()
    def _all_gather_parameters(self, bucket: Bucket) -> None:
        """Every rank sends its updated rows; everyone receives the whole bucket (Ψ_b (N−1)/N)."""
        dtype, device = self.precision.param_dtype, bucket.slots[0].param.device
        gathered = torch.zeros(bucket.chunk_numel * self.shards, dtype=dtype, device=device)
        chunks = gathered.view(self.shards, bucket.chunk_numel)
        mine = chunks[self.rank]
        for slot in bucket.slots:
            flat = slot.master.reshape(-1)
            mine[slot.offset:slot.offset + flat.numel()].copy_(flat)
        self.comm.all_gather(gathered, mine, "dp")
        for slot in bucket.slots:
            rows = as_rows(slot.param.data)
            width = rows.shape[1]
            for r in range(self.shards):
                lo, hi = row_range(rows.shape[0], self.shards, r)
                if hi > lo:
                    rows[lo:hi].copy_(chunks[r, slot.offset:slot.offset + (hi - lo) * width].view(hi - lo, width))

    # -- accounting ----------------------------------------------------------------
    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's master gradients (its shard for ZeRO, everything for DDP)."""
        total = torch.zeros((), dtype=torch.float64, device=self.slots[0].param.device)
        for slot in self.slots:
            grad = slot.master.grad
            if grad is not None:  # each square in at least fp32, the sum over tensors in fp64
                total += grad.to(torch.promote_types(grad.dtype, torch.float32)).pow(2).sum()
        return total

    @property
    def grads_sharded(self) -> bool:
        return self.stage > 0

    def zero_grad(self) -> None:
        for slot in self.slots:
            slot.master.grad = None
            slot.param.grad = None

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every trainable parameter whole, as the model computes with it (every data rank holds it)."""
        for slot in self.slots:
            yield slot.name, slot.param.detach()

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and master copies that exist on this rank now.

        Counted by storage, so a gradient that is a view of a bucket (DDP) is counted once.
        """
        params = _storage_bytes(s.param for s in self.slots)
        # A bucket holds the full gradients while they accumulate; ZeRO-2 frees it once reduced.
        grads = _storage_bytes([b.buffer for b in self.buckets] + [b.shard_grad for b in self.buckets]
                               + [s.param.grad for s in self.slots] + [s.master.grad for s in self.slots])
        master = _storage_bytes(s.master for s in self.slots) if self.precision.mixed else 0
        return {"params": params, "grads": grads, "master": master}


def _storage_bytes(tensors) -> int:
    """Total bytes of the distinct storages behind `tensors` (None entries ignored)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _row_numel(t: torch.Tensor) -> int:
    return as_rows(t).shape[1]


