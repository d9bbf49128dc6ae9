"""Data parallelism and ZeRO-1/2: gradients in flat buckets, reduced while backward runs.

Every rank holds the whole model and computes on its slice of the batch.
As autograd finishes each parameter's gradient, it is taken from `.grad` and
written into flat buckets (in the order they become ready: reverse
registration order), small ones a batch at a time by foreach kernels (at most
`PENDING_BYTES` of them wait), so a gradient exists once. The moment a bucket is
complete its collective is launched asynchronously, so communication overlaps
the rest of backward. Buckets are launched strictly in bucket order, so every
rank issues the same collectives in the same order even when different ranks
finish parameters in a different order.

DDP and ZeRO-1 keep their buckets for the whole run: under gradient
accumulation (`no_sync`) every micro-batch adds into them and only the last
backward communicates. ZeRO-2 is the stage whose point is that the full
gradient never exists: a bucket's buffer is allocated when its first gradient
arrives, reduce-scattered as soon as it is complete, and freed when that
completes (on CUDA one reduce-scatter in flight, overlapping the backward
that makes the next bucket's gradients and landed when that bucket launches,
as ZeRO-1's: one bucket filling beside the one in flight; on the CPU each
lands at once);
each rank keeps only its 1/N shard of the reduced gradients, adding each
backward's into it. So ZeRO-2 reduces in every backward, as the ZeRO paper
and DeepSpeed do: a backward under `no_sync` is reduced when the
context exits (deferring would need the full gradients that ZeRO-2 exists
not to keep).

Per stage, with Ψ parameters and N data ranks (bytes per rank, fp32, Adam):

=======  ====================================  ================================  =================
stage    gradient communication per backward   gradient memory                   master + moments
=======  ====================================  ================================  =================
0 (DDP)  all-reduce: 2Ψ(N−1)/N (last only)     4Ψ (buckets)                      full (12Ψ / 8Ψ)
1        reduce-scatter Ψ(N−1)/N (last only)   4Ψ (buckets; one reduced at once) 1/N
         + all-gather of updated parameters
         Ψ(N−1)/N per step
2        as 1, in every backward               4Ψ/N + one bucket filling         1/N
                                               (CUDA: + one in flight)
=======  ====================================  ================================  =================

Hybrid sharding (a mesh with dp_replicate > 1): N above is the shard group
(`Mesh.shard_axis`, dp_shard ranks). Each reduce-scatter within the group is
followed by an all-reduce of the 1/N shard over dp_replicate (2·(Ψ/N)(R−1)/R
more per reduction), and the all-gather of updated parameters stays within
the group; the loss, the pre-division and the used flags are over all dp ranks.

A bucket's layout (which rows of which parameter sit where in its N chunks, and
why only padding is ever zeroed) is `buckets.py`'s, as is ZeRO's all-gather of
updated parameters through it; this engine moves the gradients into the
buckets and reduces them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from typing import Iterator

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.compat import at_backward_end, backward_pass_id
from paratrain.mesh import Axis
from paratrain.parallel.data.buckets import (Bucket, InFlight, Slot, all_gather_parameters, make_buckets, new_buffer,
                                            storage_bytes)
from paratrain.parallel.data.engine import (GradReduction, add_to_master, sum_of_squares, sum_of_squares_flat,
                                            used_flags, weak_hook)
from paratrain.parallel.data.replicas import ReplicaSum, make_replicas
from paratrain.parallel.data.shard import as_rows, chunk_tiles
from paratrain.precision import Precision

# Gradients wait, this many bytes of them at most, to be written into their buckets together: a few
# foreach kernels per batch of small parameters instead of one kernel launched from Python for each.
# A bucket's waiting gradients are written before it is launched, and every one when its backward ends.
PENDING_BYTES = 2**18


class DataParallelEngine:
    """DDP (zero=0) and ZeRO-1/2 over the `dp` axis of the comm's mesh (ZeRO: over its shard groups), for any
    nn.Module (an `Engine`, see engine.py)."""

    params_sharded = False  # every data rank holds every parameter whole

    def __init__(self, model: nn.Module, comm: Comm, precision: Precision, zero: int = 0,
                 bucket_mb: float = 25.0, grad_reduction: GradReduction = GradReduction.MEAN,
                 params: list[tuple[str, nn.Parameter]] | None = None, axis: Axis | None = None):
        """`params` (name, parameter): the ones this engine reduces (None: every trainable one of `model`);
        `axis`: the ranks that hold copies of them, over which their gradients are reduced and ZeRO shards them
        (None: the data axis, split for hybrid sharding). A mean divides by the whole data axis whatever the
        axis: a group of parameters held by fewer data ranks (an axis of their own) already sums, through its
        forward, the contributions of the tokens of the others."""
        assert zero in (0, 1, 2)
        grad_reduction = GradReduction(grad_reduction)
        mesh = comm.mesh
        # The data axis: dp, or dp × cp with context parallelism (cp ranks' gradients are partial sums too).
        self.data_axis = axis or mesh.data_axis
        self.dp = mesh.size(self.data_axis)
        # One data rank has nothing to reduce or shard: its gradients accumulate where autograd leaves
        # them (no bucket held between steps). In fp32 the optimizer steps the parameters themselves; in mixed
        # precision each 16-bit gradient is added into its fp32 master's as autograd leaves it (`add_to_master`).
        # Every ZeRO stage is that one (a single shard is the whole model).
        self.local = self.dp == 1
        zero = 0 if self.local else zero
        self.model, self.comm, self.precision, self.zero = model, comm, precision, zero
        # ZeRO shards over the shard group (the data axis, or its dp_shard part under hybrid sharding).
        self.shard_axis = axis or mesh.shard_axis
        self.shards = mesh.size(self.shard_axis) if zero > 0 else 1
        self.rank = mesh.coord(self.shard_axis) if zero > 0 else 0
        self.replicas = (1 if axis else mesh.replicas) if zero > 0 else 1
        self.pre_divide = mesh.size(mesh.data_axis) if grad_reduction is GradReduction.MEAN else 1
        self.per_backward = zero == 2  # reduces every backward; buffers exist only while filled or reduced
        named = [(n, p) for n, p in (model.named_parameters() if params is None else params) if p.requires_grad]
        # Every replica starts from dp rank 0's values: nothing moves when they already agree.
        make_replicas([p.data for _, p in named], comm, self.data_axis, int(bucket_mb * 2**20))
        self.buckets = make_buckets(named, bucket_mb, self.precision.reduce_dtype, self.shards, self.rank)
        order = {id(p): i for i, (_, p) in enumerate(named)}
        self.slots = sorted((s for b in self.buckets for s in b.slots), key=lambda s: order[id(s.param)])
        self._make_masters()
        for slot in self.slots:
            if not self.local:
                slot.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
            elif precision.mixed:  # the hook holds the master alone, not the engine (see `weak_hook`)
                slot.param.register_post_accumulate_grad_hook(functools.partial(add_to_master, slot.master))
        index = {id(s.param): i for i, s in enumerate(self.slots)}
        self._where = {s.param: (b, s, index[id(s.param)]) for b in self.buckets for s in b.slots}
        self._sync = True
        # A step's gradients are being collected: from its first gradient to finish_gradients().
        self._accumulating = False
        self._in_backward = False  # DDP / ZeRO-1: the synced backward has begun; ZeRO-2: a backward's round is open
        self._next_launch = 0
        self._in_flight: deque[InFlight] = deque()
        self._in_flight_limit = comm.reductions_in_flight()
        self._replica_sum = ReplicaSum(comm)  # hybrid sharding: each reduced shard summed over the replicas
        self._used_mask = torch.zeros(len(self.slots), device=self.slots[0].param.device if self.slots else None)
        self._used = [False] * len(self.slots)  # on the host while backward runs: no kernel per gradient
        # Gradients autograd handed over that are not yet in their buckets: (bucket, slot, gradient, whether
        # the slot held one already, so that it is added rather than copied). Empty between backward passes.
        self._pending: list[tuple[Bucket, Slot, torch.Tensor, bool]] = []
        self._pending_bytes = 0
        # The backward (autograd's graph task) whose end will write what still waits. An id, not a flag: a
        # backward that raises never runs its end callback, and the next one must queue its own.
        self._end_queued_for: int | None = None
        self._reduced: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # see _assign_master_grads
        self._ungathered = []  # ZeRO-1/2: buckets whose updated rows wait for `bring`
        self._ready, self._defer = None, False  # how `after_step` waits for the masters' values (`await_values`)

    # -- construction ---------------------------------------------------------
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
                elif self.zero == 0:
                    slot.master = slot.param  # plain DDP: the optimizer updates the parameters themselves
                else:
                    slot.master = slot.param.detach()[lo:hi] if slot.param.dim() else slot.param.detach().reshape(1)[lo:hi]
        if not self.per_backward and (self.zero > 0 or self.precision.mixed) and not self.local:
            for bucket in self.buckets:  # DDP / ZeRO-1: one buffer per bucket for the whole run
                bucket.buffer = new_buffer(bucket, self.shards, self.precision.reduce_dtype)

    # -- the engine contract --------------------------------------------------
    def groups(self) -> list[tuple[DataParallelEngine, bool]]:
        return [(self, False)]

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
        """DDP / ZeRO-1: backward passes inside accumulate in the buckets without communicating, and the next
        synced backward reduces all. ZeRO-2: the backward inside is reduced when the context exits."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True
            if self.per_backward and self._in_backward:
                self._end_round()

    # -- backward: buckets fill and launch -------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket, slot, index = self._where[param]
        if self.per_backward and slot.filled:
            self._end_round()  # a second gradient of one parameter: a new backward began
        if not self._accumulating:
            self._start_accumulation()
        if (self._sync or self.per_backward) and not self._in_backward:
            self._start_backward()
        if bucket.buffer is None:
            # ZeRO-2: the bucket's first gradient of this backward. A reduce-scatter still in flight (CUDA)
            # is not waited for here: waiting would hold up the backward that makes this bucket's gradients
            # until it completes. It lands when this bucket launches (`_launch`).
            bucket.buffer = new_buffer(bucket, self.shards, self.precision.reduce_dtype)
        grad, param.grad = param.grad, None  # the bucket holds it from now on: a gradient never exists twice
        task = backward_pass_id()
        if task != self._end_queued_for:
            at_backward_end(self._end_backward)
            self._end_queued_for = task
        self._pending.append((bucket, slot, grad, slot.filled))
        slot.filled = True
        self._pending_bytes += grad.nbytes
        if self._pending_bytes >= PENDING_BYTES:
            self._write_pending()
        self._used[index] = True
        if self._sync or self.per_backward:
            bucket.ready += 1
            if bucket.ready == len(bucket.slots):  # only a completed bucket can let buckets launch
                self._launch_ready_buckets(in_backward=True)

    def _start_accumulation(self) -> None:
        """The first gradient of a step: it and every later one of the step are counted in the used mask."""
        self._accumulating = True
        self._used = [False] * len(self.slots)

    def _start_backward(self) -> None:
        self._in_backward = True
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None

    def _end_backward(self) -> None:
        self._end_queued_for = None
        self._write_pending()

    def _write_pending(self) -> None:
        """The waiting gradients into their buckets, rank r's rows into chunk r: a first write copies, later ones
        add, each divided by the pre-division on the way (before the sum over ranks, so that a 16-bit
        reduction cannot overflow). A batch of several: one foreach copy (then one scale of what it wrote)
        and one foreach add. One alone (a large gradient) keeps the division in its copy: one kernel, one
        pass. Into another dtype the copy rounds first, then divides, in the bucket's dtype."""
        copy_srcs: list[torch.Tensor] = []
        copy_dsts: list[torch.Tensor] = []
        add_srcs: list[torch.Tensor] = []
        add_dsts: list[torch.Tensor] = []
        for bucket, slot, grad, filled in self._pending:
            if self.shards == 1:  # DDP: the parameter's span of the bucket, as one view
                if slot.span is None or self.per_backward:
                    slot.span = bucket.buffer[slot.offset:slot.offset + grad.numel()].view_as(grad)
                tiles = [(grad, slot.span)]
            else:
                tiles = chunk_tiles(as_rows(grad), slot.columns(bucket.buffer, self.shards))
            srcs, dsts = (add_srcs, add_dsts) if filled else (copy_srcs, copy_dsts)
            for src, dst in tiles:
                srcs.append(src)
                dsts.append(dst)
        self._pending.clear()
        self._pending_bytes = 0
        scale = 1.0 / self.pre_divide
        if len(copy_dsts) == 1 and scale != 1.0 and copy_srcs[0].dtype == copy_dsts[0].dtype:
            torch.mul(copy_srcs[0], scale, out=copy_dsts[0])
        elif copy_dsts:
            torch._foreach_copy_(copy_dsts, copy_srcs)
            if scale != 1.0:
                torch._foreach_mul_(copy_dsts, scale)
        if add_dsts:
            torch._foreach_add_(add_dsts, add_srcs, alpha=scale)

    def _launch_ready_buckets(self, in_backward: bool) -> None:
        """Launch complete buckets in bucket order (a later bucket waits for an earlier one)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if in_backward and bucket.ready < len(bucket.slots):
                return
            self._launch(bucket, in_backward)
            self._next_launch += 1

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        self._write_pending()
        if bucket.buffer is None:  # ZeRO-2: no gradient of this bucket in this backward here (maybe on other ranks)
            bucket.buffer = new_buffer(bucket, self.shards, self.precision.reduce_dtype)
        for slot in bucket.slots:
            if not slot.filled:  # a parameter this rank's backward did not reach contributes zeros
                for rows, part in chunk_tiles(as_rows(slot.param.detach()), slot.columns(bucket.buffer, self.shards)):
                    part.zero_()
            slot.filled = self.zero < 2 and slot.filled  # ZeRO-2: the next backward writes a fresh buffer
        bucket.launched_in_backward, bucket.launched_at = in_backward, time.perf_counter()
        if self.zero == 0:
            bucket.work = self.comm.all_reduce(bucket.buffer, self.data_axis, async_op=True)
            return
        # ZeRO: at most one reduce-scatter in flight (`Comm.reductions_in_flight`: none on the CPU), landed
        # as the next one launches, so it overlaps the backward that filled the next bucket. ZeRO-2 frees
        # each input when its collective completes; a backend may copy an input until then.
        while len(self._in_flight) >= max(1, self._in_flight_limit):
            self._land(self._in_flight.popleft())
        if self.zero == 1:  # in place: this rank's chunk of the persistent buffer
            chunk = bucket.buffer.view(self.shards, -1)[self.rank]
            work = self.comm.reduce_scatter(chunk, bucket.buffer, self.shard_axis, async_op=True)
            self._in_flight.append(InFlight(bucket, work, bucket.buffer, None))
        else:  # into a separate chunk, so that the full buffer goes when the collective completes
            out = torch.empty(bucket.chunk_numel, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
            work = self.comm.reduce_scatter(out, bucket.buffer, self.shard_axis, async_op=True)
            self._in_flight.append(InFlight(bucket, work, bucket.buffer, out))
            bucket.buffer = None
        while len(self._in_flight) > self._in_flight_limit:
            self._land(self._in_flight.popleft())

    def _land(self, flight: InFlight) -> None:
        """Wait for one reduce-scatter; ZeRO-2: add its rows into the bucket's shard (its full buffer goes).
        Under hybrid sharding the shard is first summed over the replicas (`ReplicaSum`: asynchronously,
        landed at the next reduction or when the round or step ends)."""
        self.comm.wait([flight.work], self.shard_axis)
        if self.replicas == 1:
            self._add_shard(flight)
        else:
            shard = flight.out if flight.out is not None else flight.buffer.view(self.shards, -1)[self.rank]
            flight.buffer = None  # ZeRO-2: the full bucket is not needed any more (ZeRO-1's stays the bucket's)
            self._replica_sum.push(shard, functools.partial(self._add_shard, flight))

    def _add_shard(self, flight: InFlight) -> None:
        if flight.out is None:  # ZeRO-1: reduced in place
            return
        bucket = flight.bucket
        if bucket.shard_grad is None:
            bucket.shard_grad = flight.out.to(self.precision.master_dtype)
        else:
            bucket.shard_grad.add_(flight.out)

    def _end_round(self) -> None:
        """ZeRO-2: the backward is over: launch the buckets it left (in order, every rank alike), land every
        reduce-scatter (so no full-size buffer outlives its backward into the next forward) and reset."""
        self._launch_ready_buckets(in_backward=False)
        while self._in_flight:
            self._land(self._in_flight.popleft())
        if self.replicas > 1:  # hybrid sharding: the last shard's sum over the replicas
            self._replica_sum.land()
        self._in_backward = False

    def finish_gradients(self) -> torch.Tensor:
        """Launch the buckets still waiting (parameters the backward did not reach, whose gradients came
        from earlier micro-batches or from none; all of them when every backward ran under no_sync),
        wait for every reduction, and point the master gradients at the reduced rows.

        Returns, per master, 1 if this rank's backward reached it this step, else 0 (the last step's
        flags when no gradient came since); the model sums them over the data ranks in its agreement.
        """
        device = self._used_mask.device
        if self.local:  # the gradients are where autograd left them; which exist is known on the host
            used = [s.master.grad is not None for s in self.slots]
            if any(used):
                self._used_mask = used_flags(used, device)
            if any(used) and self.pre_divide != 1:  # a mean over data ranks of which this group's axis has one
                torch._foreach_div_([s.master.grad for s in self.slots if s.master.grad is not None], self.pre_divide)
            return self._used_mask
        if not self._accumulating:
            return self._used_mask
        if not self._in_backward and not self.per_backward:
            self._start_backward()
        if self._in_backward:
            self._launch_ready_buckets(in_backward=False)
        self._used_mask = used_flags(self._used, device)
        while self._in_flight:
            self._land(self._in_flight.popleft())
        if self.replicas > 1:  # hybrid sharding: the last shard's sum over the replicas
            self._replica_sum.land()
        self.comm.wait([b.work for b in self.buckets if self.zero == 0], self.data_axis)
        self._assign_master_grads()
        self._in_backward = self._accumulating = False
        return self._used_mask

    def drop_gradients(self, indices: list[int]) -> None:
        for i in indices:
            self.slots[i].master.grad = None

    def _assign_master_grads(self) -> None:
        # The reduced rows of every bucket, when the masters' gradients are views of them: the norm is
        # then one kernel per bucket (padding is zero) instead of one per parameter. Only buffers that
        # live for the run (DDP, ZeRO-1): holding ZeRO-2's shards here would keep them past zero_grad().
        flats: list[torch.Tensor] | None = None if self.per_backward else []
        for bucket in self.buckets:
            if self.zero == 0:
                source = bucket.buffer
            elif self.zero == 1:
                source = bucket.buffer.view(self.shards, -1)[self.rank]
            else:
                source, bucket.shard_grad = bucket.shard_grad, None  # the masters' .grad hold it from now on
            if flats is not None and source.dtype == self.precision.master_dtype:
                flats.append(source)
            else:
                flats = None
            for slot in bucket.slots:
                slot.filled = False
                grad = slot.reduced
                if grad is None:
                    lo, hi = slot.rows
                    rows = source[slot.offset:slot.offset + (hi - lo) * as_rows(slot.param).shape[1]]
                    grad = rows.view(slot.master.shape)
                    if not self.per_backward:  # DDP / ZeRO-1: the same rows of the same buffer every step
                        slot.reduced = grad
                slot.master.grad = grad if grad.dtype == slot.master.dtype else grad.to(slot.master.dtype)
        self._reduced = (flats, [s.master.grad for s in self.slots]) if flats is not None else None

    # -- after the optimizer step ------------------------------------------------
    def keep_master_values(self, values: list[torch.Tensor]) -> None:
        """A placement's (`HostPlaced`): the masters' values are `values` (host copies, in `masters()` order) from now
        on, which the optimizer steps and `after_step` reads; a separate mixed-precision master keeps its gradient
        only (no storage)."""
        for slot, value in zip(self.slots, values):
            slot.value = value
            if self.precision.mixed:
                slot.master.data = torch.empty((), dtype=slot.master.dtype, device=slot.master.device).expand(
                    slot.master.shape)
        for bucket in self.buckets:
            bucket.gather = None  # made again, from the values

    def await_values(self, ready, defer: bool) -> None:
        """A placement's (`HostPlaced`): how the next `after_step` waits for the masters' values."""
        self._ready, self._defer = ready, defer

    def after_step(self) -> None:
        """Bring the model's parameters up to date with the masters. With a placement's `ready` (`await_values`: the
        values of the masters at given indices are stepped once it returns), DDP's were copied by
        `values_to_device` as each group was stepped; ZeRO-1/2 all-gathers a bucket once its masters are, and with
        `defer` only when the next forward first reads it (`bring`)."""
        ready = self._ready
        if self.precision.mixed:
            for slot in self.slots:
                slot.master.grad = None  # fp32 copies made for this step only
        if self.zero == 0:
            if ready is None and (self.precision.mixed or any(s.value is not None for s in self.slots)):
                self.values_to_device(range(len(self.slots)))
            return
        self._ungathered = list(self.buckets)
        if ready is None or not self._defer:
            self.bring(range(len(self.slots)))

    def bring(self, indices) -> None:
        """ZeRO-1/2: all-gather the updated rows of each bucket that holds a master at `indices` and is not gathered
        since the step (first waiting for its masters' values, `await_values`). Collective: every rank calls it
        in the same order (the forward's units, then the rest)."""
        wanted = set(indices)
        for bucket in [b for b in self._ungathered if any(self._where[s.param][2] in wanted for s in b.slots)]:
            self._ungathered.remove(bucket)
            if self._ready is not None:
                self._ready([self._where[s.param][2] for s in bucket.slots])
            all_gather_parameters(bucket, self.comm, self.shard_axis, self.shards, self.rank, self.precision.param_dtype,
                                  buffer_lives=not self.per_backward)

    @torch.no_grad()
    def values_to_device(self, indices) -> None:
        """DDP: the masters' values at `indices` (from their host copies) into the parameters the model computes
        with (ZeRO-1/2's all-gather reads them itself)."""
        slots = [self.slots[i] for i in indices] if self.zero == 0 else []
        if slots:
            torch._foreach_copy_([s.param.data for s in slots], [s.source().view_as(s.param) for s in slots],
                                 non_blocking=True)

    # -- accounting ----------------------------------------------------------------
    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's master gradients (its shard for ZeRO, everything for DDP)."""
        grads = [s.master.grad for s in self.slots]
        device = self.slots[0].param.device if self.slots else "cpu"
        if self._reduced is not None and all(a is b for a, b in zip(grads, self._reduced[1])):
            return sum_of_squares_flat(self._reduced[0], device)  # every gradient still the view it was assigned
        return sum_of_squares([g for g in grads if g is not None], device)

    @property
    def grads_sharded(self) -> bool:
        return self.zero > 0

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
        params = storage_bytes(s.param for s in self.slots)
        # A bucket holds the full gradients while they accumulate; ZeRO-2 frees it once reduced.
        grads = storage_bytes([b.buffer for b in self.buckets] + [b.shard_grad for b in self.buckets]
                               + [t for f in self._in_flight for t in (f.buffer, f.out)]
                               + [self._replica_sum.in_flight] + [grad for _, _, grad, _ in self._pending]
                               + [s.param.grad for s in self.slots] + [s.master.grad for s in self.slots])
        master = storage_bytes(s.master for s in self.slots) if self.precision.mixed else 0
        return {"params": params, "grads": grads, "master": master}
