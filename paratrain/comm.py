"""Every collective paratrain issues, counted per mesh axis and per kind.

Bytes are counted as a bandwidth-optimal ring algorithm sends them from one
rank: an all-reduce of S bytes over N ranks sends 2·S·(N−1)/N, an
all-gather or reduce-scatter of a full tensor of S bytes sends S·(N−1)/N, a
broadcast or point-to-point send S (a receive counts nothing: its bytes are its sender's). That makes communication volume a number
a test can compare with the theory (ZeRO, Megatron), whatever the backend
really does underneath. A group of one rank communicates nothing, and is not
called.

Time is counted too: the seconds this rank's host thread was blocked per axis,
in synchronous collectives and in `wait` on asynchronous ones; communication
that overlaps compute costs nothing there, so it is the exposed communication
(on the pp axis: the time a stage waited for its neighbour, the measured bubble).

The last calls are kept as a short fingerprint (kind, axis, shape, dtype), so
that ranks that disagree about the sequence of collectives can be told apart.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.mesh import WORLD, Mesh

SUM = dist.ReduceOp.SUM
# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class CallRecord:
    """One collective as this rank issued it."""

    seq: int
    kind: str
    axis: str
    shape: tuple[int, ...]
    dtype: str
    launched_at: float


class Comm:
    """Instrumented collectives over the axes of one mesh."""

    def __init__(self, mesh: Mesh, history: int = 64):
        self.mesh = mesh
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.recent: deque[CallRecord] = deque(maxlen=history)
        self.blocked_s: dict[str, float] = defaultdict(float)
        # Called with each CallRecord before its collective starts (the trainer mirrors the
        # fingerprint into a file that outlives a crash: paratrain.run.diagnose).
        self.listeners: list = []
        self._seq = 0

    # -- accounting -------------------------------------------------------
    def _count(self, kind: str, axis: str, tensor: torch.Tensor, sent: float) -> None:
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
    def _group(self, axis: str) -> tuple[dist.ProcessGroup | None, int]:
        return self.mesh.group(axis), self.mesh.size(axis)

    def all_reduce(self, tensor: torch.Tensor, axis: str, op=SUM, async_op: bool = False):
        """In-place all-reduce of `tensor` over `axis`."""
        group, n = self._group(axis)
        if n == 1:
            return None
        self._count("all_reduce", axis, tensor, 2 * _nbytes(tensor) * (n - 1) / n)
        return self._issue(axis, async_op, dist.all_reduce, tensor, op=op, group=group)

    def all_reduce_mesh(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over every rank of the mesh (one collective over the world); returns it."""
        self.all_reduce(tensor, WORLD)
        return tensor

    @torch.no_grad()
    def all_reduce_coalesced(self, tensors: list[torch.Tensor], axis: str) -> None:
        """Sum several tensors in place over `axis` with one flat all-reduce (one call instead of one each)."""
        tensors = [t for t in tensors if t.numel()]
        if not tensors or self.mesh.size(axis) == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat, axis)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: str, op=SUM,
                       async_op: bool = False):
        """Reduce `input` (N equal chunks along dim 0) over `axis`; chunk i lands in rank i's `output`."""
        group, n = self._group(axis)
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        self._count("reduce_scatter", axis, input, _nbytes(input) * (n - 1) / n)
        return self._issue(axis, async_op, _reduce_scatter, output, input, op=op, group=group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool = False):
        """Gather every rank's `input` over `axis` into `output` (N chunks along dim 0, in axis order)."""
        group, n = self._group(axis)
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        self._count("all_gather", axis, output, _nbytes(output) * (n - 1) / n)
        return self._issue(axis, async_op, _all_gather, output, input, group=group)

    def broadcast(self, tensor: torch.Tensor, axis: str, src: int = 0, async_op: bool = False):
        """Broadcast from the rank at index `src` of this rank's `axis` group."""
        group, n = self._group(axis)
        if n == 1:
            return None
        self._count("broadcast", axis, tensor, _nbytes(tensor))
        return self._issue(axis, async_op, dist.broadcast, tensor, src=self.mesh.ranks(axis)[src], group=group)

    def wait(self, works, axis: str) -> None:
        """Wait on work handles (None: a collective that needed no call); the time blocked counts for `axis`."""
        start = time.perf_counter()
        wait_all(works)
        self.blocked_s[axis] += time.perf_counter() - start

    def _issue(self, axis: str, async_op: bool, collective, *args, **kwargs):
        if async_op:
            return collective(*args, async_op=True, **kwargs)
        start = time.perf_counter()
        try:
            return collective(*args, **kwargs)
        finally:
            self.blocked_s[axis] += time.perf_counter() - start

    def send(self, tensor: torch.Tensor, axis: str, dst: int):
        """Non-blocking send of `tensor` to the rank at index `dst` of this rank's `axis` group.

        Returns the work handle: the caller keeps `tensor` alive and waits on it (gloo and
        NCCL both match point-to-point messages between two ranks in the order they are posted).
        """
        self._count("send", axis, tensor, _nbytes(tensor))
        return dist.isend(tensor, dst=self.mesh.ranks(axis)[dst], group=self.mesh.group(axis))

    def recv(self, tensor: torch.Tensor, axis: str, src: int):
        """Non-blocking receive into `tensor` from the rank at index `src` of `axis`; returns the work handle.

        Received bytes are not counted: every byte is counted once, by its sender.
        """
        return dist.irecv(tensor, src=self.mesh.ranks(axis)[src], group=self.mesh.group(axis))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def wait_all(works) -> None:
    """Wait on every work handle (None entries are collectives that needed no call)."""
    for work in works:
        if work is not None:
            work.wait()
