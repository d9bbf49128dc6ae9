"""Every collective paratrain issues, counted per mesh axis and per kind.

Bytes are counted as a bandwidth-optimal ring algorithm sends them from one
rank: an all-reduce of S bytes over N ranks sends 2·S·(N−1)/N, an
all-gather or reduce-scatter of a full tensor of S bytes sends S·(N−1)/N, a
broadcast or point-to-point send S (a receive counts nothing: its bytes are its sender's). That makes communication volume a number
a test can compare with the theory (ZeRO, Megatron), whatever the backend
really does underneath. A group of one rank communicates nothing, and is not
called.

Time is counted too: the seconds this rank was held up per axis, in
synchronous collectives and in `wait` on asynchronous ones; communication that
overlaps compute costs nothing there, so it is the exposed communication (on
the pp axis: the time a stage waited for its neighbour, the measured bubble).
On the CPU (gloo) that is the host's blocked time (`blocked_s`). On CUDA (NCCL)
`wait` does not block the host, it makes the compute stream wait: a pair of
CUDA events around each wait measures that on the stream, read one window
(step) late, once the GPU has passed them, so that reading them never makes
the host wait for the GPU (`exposed_s`).

The last calls are kept as a short fingerprint (kind, axis, shape, dtype), so
that ranks that disagree about the sequence of collectives can be told apart.

Point-to-point transfers travel in groups (`exchange`: one `batch_isend_irecv`,
a group call under NCCL). A send completes only once its receive is posted, on
NCCL and on gloo alike (measured: a gloo sender whose receiver posts 200 ms late
waits 200 ms, from 4 KB to 4 MB), so `exchange(defer_sends=True)` returns when
its receives have landed and leaves its sends to complete while the caller
computes; they are waited for at the next exchange on the axis (one group's
sends in flight, as torch.distributed.pipelining does) or by `settle_sends`.
The order of the transfers on the wire does not change, only when the host
waits. `rendezvous=True` is a test mode for an order NCCL could deadlock: every
received tensor is acknowledged and a group returns only when each of its sends
was received (deferring nothing), so such an order hangs here too (and ends in
the process group's timeout).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.compat import all_gather_single as _all_gather, reduce_scatter_single as _reduce_scatter
from paratrain.mesh import WORLD, Axis, AxisGroup, Mesh

SUM = dist.ReduceOp.SUM


@dataclass(frozen=True)
class CallRecord:
    """One collective as this rank issued it."""

    seq: int
    kind: str
    axis: Axis
    shape: tuple[int, ...]
    dtype: str
    launched_at: float


class Comm:
    """Instrumented collectives over the axes of one mesh."""

    def __init__(self, mesh: Mesh, history: int = 64, rendezvous: bool = False):
        self.mesh = mesh
        # This rank's group, size, coordinate and ranks on every axis, resolved once: a collective reads them
        # here (the mesh is fixed, and a `Comm` talks over one mesh).
        self.axes: dict[Axis, AxisGroup] = {axis: mesh.on(axis) for axis in Axis}
        self.rendezvous = rendezvous
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.recent: deque[CallRecord] = deque(maxlen=history)
        self.blocked_s: dict[str, float] = defaultdict(float)  # host seconds (the exposed time on the CPU)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: (axis, before, after)
        self._closed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # the same, of the last window
        # Called with each CallRecord before its collective starts (the trainer mirrors the
        # fingerprint into a file that outlives a crash: paratrain.run.diagnose).
        self.listeners: list = []
        self._seq = 0
        self._sending: dict[str, list] = defaultdict(list)  # axis -> works of sends left in flight (exchange)

    # -- accounting -------------------------------------------------------
    def _count(self, kind: str, axis: Axis, tensor: torch.Tensor, sent: float) -> None:
        self.calls[axis, kind] += 1
        self.bytes[axis, kind] += int(round(sent))
        self._seq += 1
        record = CallRecord(self._seq, kind, axis, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                            time.perf_counter())
        self.recent.append(record)
        for listener in self.listeners:
            listener(record)

    def reset(self) -> None:
        """Start a new measurement window (e.g. one optimizer step)."""
        self.calls.clear()
        self.bytes.clear()
        self.blocked_s.clear()
        self._closed, self._events = self._events, []

    def bytes_by_axis(self) -> dict[str, int]:
        """Bytes this rank sent in the current window, per axis."""
        totals: dict[str, int] = defaultdict(int)
        for (axis, _), sent in self.bytes.items():
            totals[axis] += sent
        return dict(totals)

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """{axis: {kind: {"calls": c, "bytes": b}}} for the current window (JSON-ready)."""
        out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
        for (axis, kind), calls in self.calls.items():
            out[axis][kind] = {"calls": calls, "bytes": self.bytes[axis, kind]}
        return dict(out)

    # -- collectives ------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, axis: Axis, op=SUM, async_op: bool = False):
        """In-place all-reduce of `tensor` over `axis`."""
        on = self.axes[axis]
        if on.size == 1:
            return None
        n = on.size
        self._count("all_reduce", axis, tensor, 2 * _nbytes(tensor) * (n - 1) / n)
        return self._issue(axis, async_op, dist.all_reduce, tensor, op=op, group=on.group)

    def all_reduce_mesh(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over every rank of the mesh (one collective over the world); returns it."""
        self.all_reduce(tensor, WORLD)
        return tensor

    @torch.no_grad()
    def all_reduce_coalesced(self, tensors: list[torch.Tensor], axis: Axis) -> None:
        """Sum several tensors in place over `axis` with one flat all-reduce (one call instead of one each)."""
        tensors = [t for t in tensors if t.numel()]
        if not tensors or self.axes[axis].size == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(self.mesh.device)  # (offloaded ones: from the host)
        self.all_reduce(flat, axis)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: Axis, op=SUM,
                       async_op: bool = False):
        """Reduce `input` (N equal chunks along dim 0) over `axis`; chunk i lands in rank i's `output`."""
        on = self.axes[axis]
        group, n = on.group, on.size
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        self._count("reduce_scatter", axis, input, _nbytes(input) * (n - 1) / n)
        if _is_own_chunk(output, input, on.coord) and dist.get_backend(group) == "gloo":
            # gloo's reduce-scatter sends what its all-reduce of the input sends (counted on the loopback
            # device: 2·S·(n−1) bytes in all, for both), then copies the rank's chunk out. In place, the
            # all-reduce alone leaves that chunk reduced, with no copy. NCCL reduce-scatters for real.
            return self._issue(axis, async_op, dist.all_reduce, input, op=op, group=group)
        return self._issue(axis, async_op, _reduce_scatter, output, input, op=op, group=group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: Axis, async_op: bool = False):
        """Gather every rank's `input` over `axis` into `output` (N chunks along dim 0, in axis order)."""
        on = self.axes[axis]
        group, n = on.group, on.size
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        self._count("all_gather", axis, output, _nbytes(output) * (n - 1) / n)
        if dist.get_backend(group) == "gloo" and output.is_contiguous():
            # gloo's all-gather takes 1.6-2.8x the time of one broadcast per chunk, which sends the same
            # bytes (counted on the loopback device: S·(n−1) in all, for both; 12 MB, 2 ranks: 5.8-10.3
            # ms against 3.7). Each rank's chunk is broadcast from it, into its place in `output`.
            chunks = output.view(n, -1)
            mine = chunks[on.coord]
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input.reshape(-1))
            return self._issue(axis, async_op, _broadcast_chunks, chunks, on.ranks, group=group)
        return self._issue(axis, async_op, _all_gather, output, input, group=group)

    def broadcast(self, tensor: torch.Tensor, axis: Axis, src: int = 0, async_op: bool = False):
        """Broadcast from the rank at index `src` of this rank's `axis` group."""
        on = self.axes[axis]
        if on.size == 1:
            return None
        self._count("broadcast", axis, tensor, _nbytes(tensor))
        return self._issue(axis, async_op, dist.broadcast, tensor, src=on.ranks[src], group=on.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], axis: Axis) -> None:
        """Rows input_splits[i] of `input` (dim 0, in order) to the i-th rank of `axis`; output_splits[i] rows from
        it into `output`. Counted: the rows sent to the other ranks (a rank's own rows stay in memory)."""
        on = self.axes[axis]
        if on.size == 1:
            output.copy_(input)
            return
        row_bytes = input[0:1].numel() * input.element_size() if input.dim() > 1 else input.element_size()
        sent = (sum(input_splits) - input_splits[on.coord]) * row_bytes
        self._count("all_to_all", axis, input, sent)
        self._issue(axis, False, dist.all_to_all_single, output, input, output_splits, input_splits, group=on.group)

    def overlaps_compute(self) -> bool:
        """Whether communication runs beside compute on the mesh's device: the one policy of what overlaps.

        On CUDA it does: NCCL's collectives run on their own stream, so ZeRO-3 gathers the next unit
        while the current one computes and a gradient reduce-scatter stays in flight while backward
        goes on (as FSDP2 does there). On the CPU it does not: gloo's thread shares the cores with
        compute and copies each input until the collective completes, so each unit is gathered when it
        is used and each reduction waited for at once, which frees that copy and the input (FSDP2 on
        the CPU overlaps nothing either).
        """
        return self.mesh.device.type == "cuda"

    def reductions_in_flight(self) -> int:
        """How many gradient reduce-scatters an engine leaves in flight while backward goes on: one where
        communication overlaps compute (`overlaps_compute`), else none."""
        return 1 if self.overlaps_compute() else 0

    def wait(self, works, axis: Axis) -> None:
        """Wait on work handles (None: a collective that needed no call); the time held up counts for `axis`."""
        with self._held(axis):
            wait_all(works)

    def _issue(self, axis: Axis, async_op: bool, collective, *args, **kwargs):
        if async_op:
            return collective(*args, async_op=True, **kwargs)
        with self._held(axis):
            return collective(*args, **kwargs)

    @contextlib.contextmanager
    def _held(self, axis: Axis):
        """Time what is inside as this rank held up on `axis`: host seconds, and on CUDA the stream's wait."""
        cuda = self.mesh.device.type == "cuda"
        if cuda:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s[axis] += time.perf_counter() - start
            if cuda:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self._events.append((axis, before, after))

    def exposed_s(self) -> dict[str, float]:
        """Seconds held up per axis: on the CPU the host's in the current window; on CUDA the stream's in
        the previous window (the one the last `reset` closed; none before it).

        On CUDA the current window's events are still ahead of the GPU while the host runs ahead:
        reading them would make the host wait for the step's last kernel every step. The previous
        window's have been passed by the time the current step made its own host read (the
        trainer's agreement), so reading them costs no wait.
        """
        if self.mesh.device.type != "cuda":
            return dict(self.blocked_s)
        exposed: dict[str, float] = defaultdict(float)
        if self._closed:
            self._closed[-1][2].synchronize()  # passed already (see above): returns at once
        for axis, before, after in self._closed:
            exposed[axis] += before.elapsed_time(after) / 1e3
        return dict(exposed)

    def exchange(self, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]],
                 axis: Axis, defer_sends: bool = False) -> None:
        """Send and receive a group of tensors over `axis` together, and wait for them.

        `sends` are (tensor, index of the peer in this rank's `axis` group), `receives`
        (buffer, index of the peer). Issued as one `batch_isend_irecv`, so under NCCL the group
        progresses as a whole and a send never waits behind a receive of the same group. The
        sends of the previous deferred group are waited for first. `defer_sends`: return once
        the receives have landed; the sends complete in the background (their tensors must not
        change until then). Sends are counted (their bytes), receives not (their bytes are the
        sender's); the time blocked counts for `axis`.
        """
        self.settle_sends(axis)
        if not sends and not receives:
            return
        ranks, group = self.axes[axis].ranks, self.axes[axis].group
        ops = [dist.P2POp(dist.isend, t, ranks[peer], group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, ranks[peer], group) for t, peer in receives]
        heard = [torch.zeros(1, device=self.mesh.device) for _ in sends] if self.rendezvous else []
        ops += [dist.P2POp(dist.irecv, h, ranks[peer], group, tag=_ACK_TAG) for h, (_, peer) in zip(heard, sends)]
        for t, _ in sends:
            self._count("send", axis, t, _nbytes(t))
        with self._held(axis):
            self._exchange(ops, sends, receives, ranks, group, axis if defer_sends else None)

    def start_exchange(self, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]],
                       axis: Axis) -> list:
        """`exchange`, returning as soon as the group is posted: the works to `wait(works, axis)` on later.

        For transfers that overlap the caller's compute (ring attention posts the next K/V block, then
        computes on the one it holds). Counted as `exchange` counts. Under `rendezvous` the group is
        completed here, acknowledgements and all (the trap checks the order of the transfers, which is
        the same), and nothing is left to wait on.
        """
        if self.rendezvous or (not sends and not receives):
            self.exchange(sends, receives, axis)
            return []
        self.settle_sends(axis)
        ranks, group = self.axes[axis].ranks, self.axes[axis].group
        ops = [dist.P2POp(dist.isend, t, ranks[peer], group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, ranks[peer], group) for t, peer in receives]
        for t, _ in sends:
            self._count("send", axis, t, _nbytes(t))
        return dist.batch_isend_irecv(ops)

    def settle_sends(self, axis: Axis) -> None:
        """Wait for the sends an `exchange(defer_sends=True)` left in flight on `axis`."""
        if self._sending[axis]:
            with self._held(axis):
                wait_all(self._sending.pop(axis))

    def _exchange(self, ops, sends, receives, ranks, group, defer_axis: Axis | None) -> None:
        works = dist.batch_isend_irecv(ops)
        # One work per op (gloo): wait for the receives only. A coalesced group (NCCL) has one work for
        # all, and waiting on it makes the stream wait, not the host: nothing to defer there.
        if defer_axis is not None and not self.rendezvous and len(works) == len(ops):
            wait_all(works[len(sends):])  # the receives; the sends (first in `ops`) complete meanwhile
            self._sending[defer_axis] = works[:len(sends)]
            return
        if self.rendezvous:
            # Each receive, once it has arrived, is acknowledged to its sender; the group is done when
            # every one of its sends was acknowledged too. The acknowledgements travel with their own
            # tag, so they never match a data transfer; their bytes are not counted (training never
            # sends them).
            arrived = works[len(sends):len(sends) + len(receives)]
            wait_all(arrived)  # (a gloo work must not be waited on twice: it would block)
            works = [w for w in works if not any(w is a for a in arrived)]
            acks = [torch.ones(1, device=self.mesh.device) for _ in receives]
            works += dist.batch_isend_irecv([dist.P2POp(dist.isend, a, ranks[peer], group, tag=_ACK_TAG)
                                             for a, (_, peer) in zip(acks, receives)]) if acks else []
        wait_all(works)


_ACK_TAG = 1  # rendezvous mode's acknowledgements; data transfers use tag 0


def _is_own_chunk(output: torch.Tensor, input: torch.Tensor, index: int) -> bool:
    """`output` is chunk `index` of the contiguous `input`, in place (a reduce-scatter into its own input)."""
    return (input.is_contiguous() and output.is_contiguous() and output.dtype == input.dtype
            and output.data_ptr() == input.data_ptr() + index * _nbytes(output))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _broadcast_chunks(chunks: torch.Tensor, ranks: list[int], group, async_op: bool = False):
    """Chunk i broadcast from ranks[i], every broadcast in flight at once; as one work when `async_op`."""
    works = _Works([dist.broadcast(chunk, ranks[i], group=group, async_op=True) for i, chunk in enumerate(chunks)])
    if async_op:
        return works
    works.wait()
    return None


class _Works:
    """Several works waited as one (a collective issued as several)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        wait_all(self.works)


def wait_all(works) -> None:
    """Wait on every work handle (None entries are collectives that needed no call)."""
    for work in works:
        if work is not None:
            work.wait()
