"""ZeRO-Offload: the optimizer's fp32 masters and its state in host memory, stepped there.

    parallelize(model, mesh, optimizer=..., data=DataParallel(zero=2, offload="optimizer"))

With Ψ parameters on N data ranks, AdamW's state is 12Ψ/N bytes per rank (fp32 master,
two moments) against the 2Ψ of bf16 weights: most of what a rank holds. Offloading
moves it to the host: the caller's optimizer is built over host copies of this rank's
masters (its ZeRO shard), so its state is allocated there too, and steps them with
torch's CPU kernel (fused AdamW where the factory asks for it). What stays on the
device is what the engine computes with: the parameters in the compute dtype and the
gradients (a mixed-precision engine's separate fp32 masters keep their gradients only,
no storage: `HostPlaced.keep_master_values`).

One optimizer step, in `paratrain.parallel.model.ParallelModel`'s order:

1. forward, backward and the gradients' reduction on the device, as without offload;
2. the agreement (skip, stop, the global norm) from the device gradients: clipping and
   the fp16 skip decision are exactly the device step's, taken before any host update;
3. with torch's Adam or AdamW (the trainer's), `HostStep` (`host_step.py`) takes over: each
   group of masters (a unit of the model: a block, an embedding, a head) has its gradients
   copied to the host on a copy stream and is stepped in a worker thread, in the order the
   next forward reads the groups, and its values go back to the device as soon as it is
   stepped; `optimizer.step()` returns at once, and the next forward waits for each unit's
   group where the unit begins (ZeRO-1/2 over several ranks: for the groups of the buckets
   it reads, then their all-gather, `HostPlaced.bring`). The host step uses `threads` intra-op threads (a launcher sets
   one per process; the host step is a pass over 28 bytes per parameter and wants the node's
   cores, shared by its ranks; on a CPU run the host is the device, and its threads stay as they are);
4. any other optimizer: `gradients_to_host` (each master's gradient into its host buffer,
   asynchronously into pinned memory, waited for once), the optimizer steps every host master
   in the caller's thread (Muon: its Newton–Schulz iteration on the device, `paratrain.parallel.muon`),
   and the engine's post-step path reads the values from the host
   copies (`keep_master_values`): DDP copies them into the parameters, ZeRO-1/2 into its
   all-gather, ZeRO-3 into its shards.

`offload="params"` (ZeRO-3) keeps the parameter shards themselves in host memory as the masters
(`HostMasters(copies=False)`): each gather copies them to the device, and their gradients come
to the host at the end of backward (`zero3.py`).

Checkpoints see the host masters and the host optimizer state (`ParallelModel.masters()`), so
they save and load them layout-free as without offload.

Host memory is allocated in chunks of at most `CHUNK_BYTES` (1 GiB, a power of two) rather than
one buffer per master: torch's pinned allocator rounds each request up to a power of two, so a
buffer per master would waste up to half of it, and one buffer for all may not be granted.
Where pinning fails
(`ulimit -l`, no CUDA), pageable memory is used, with one warning. On a CPU-only machine the
same mechanism runs (separate host buffers, the copies, the host step) and saves nothing.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from paratrain.errors import ParatrainError
from paratrain.parallel.data.host_step import HostStep, overlappable, step_groups

OFFLOADS = ("optimizer", "params")
# One host allocation holds at most this much of the masters (one master larger than it: its own). A power of two:
# torch's pinned allocator rounds each request up to one, so a chunk wastes at most the room the next tensor did not
# fit in.
CHUNK_BYTES = 2**30


@runtime_checkable
class HostPlaced(Protocol):
    """What the host placement needs of a data-parallel engine besides its `Engine` contract (which knows nothing
    of where the optimizer steps); DDP / ZeRO-1/2 (`ddp.py`), ZeRO-3 (`zero3.py`) and `groups.GroupedEngine`
    implement it."""

    def keep_master_values(self, values: list[torch.Tensor]) -> None:
        """The masters' values live in `values` (host copies, in `masters()` order) from now on; `after_step` reads
        them there, and the masters keep their gradients (a separate master: nothing else)."""

    def values_to_device(self, indices) -> None:
        """The host values of the masters at `indices` into what the engine computes or gathers from, with no
        collective (called by the host step's thread, on its copy stream)."""

    def await_values(self, ready: Callable | None, defer: bool) -> None:
        """How the next `after_step` waits: `ready(indices)` (the overlapped host step) returns once the host values
        of the masters at `indices` are stepped, and what the engine does with them waits for it first (the
        model's forward waits for each unit's own: `host_step.py`); `defer`: what needs a collective waits for
        `bring`. None: the values are stepped already."""

    def bring(self, indices) -> None:
        """After a deferred `after_step`: the parameters of the masters at `indices` up to date (collective where
        the engine gathers: every rank calls it at the same point of its forward)."""


class HostShards:
    """Where ZeRO-3 keeps its parameter shards under offload="params": host memory (pinned where it can be), the
    device's gradients brought there at the end of backward."""

    def __init__(self, device: torch.device):
        self.pinned = can_pin(device)

    def tensors(self, shapes: list[torch.Size], dtype: torch.dtype) -> list[torch.Tensor]:
        """The shards' storage, one tensor per shape."""
        return host_tensors(shapes, dtype, self.pinned)

    def gradients(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device gradients as tensors where the shards live."""
        return to_host(grads, self.pinned)


class OffloadError(ParatrainError, ValueError):
    """Offload asked for where it cannot run; the message names the fix."""


def check_offload(offload: str | None) -> None:
    """OffloadError (one line) for a value that is not an offload mode (which ZeRO stage a mode needs is a layout
    rule: `paratrain.parallel.rules.offload_violations`)."""
    if offload is not None and offload not in OFFLOADS:
        raise OffloadError(f"offload={offload!r} is not a mode; use one of {', '.join(OFFLOADS)}")


def host_state_bytes(masters: int) -> int:
    """Host bytes of `masters` offloaded fp32 elements: the masters, AdamW's two moments and the gradient buffers."""
    return 16 * masters


def host_threads() -> int:
    """Intra-op threads of a rank's host step: the cores this process may use, shared by the node's ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(1, ranks))


def host_tensors(shapes: list[torch.Size], dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    """Host tensors of `shapes`, in order, views of flat chunks that each hold at most `CHUNK_BYTES` (a tensor
    larger than that: a chunk of its own), pinned if `pin`."""
    out, group, size = [], [], 0
    limit = max(1, CHUNK_BYTES // dtype.itemsize)
    for shape in shapes:
        n = math.prod(shape)
        if group and size + n > limit:  # it would not fit: the chunk so far is full
            out += _chunk(group, size, dtype, pin)
            group, size = [], 0
        group.append(shape)
        size += n
    if group:
        out += _chunk(group, size, dtype, pin)
    return out


def _chunk(shapes: list[torch.Size], size: int, dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    flat = torch.empty(size, dtype=dtype, device="cpu", pin_memory=pin)
    views, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    return views


def can_pin(device: torch.device) -> bool:
    """Whether host memory can be pinned for `device`'s copies (one warning when it cannot)."""
    if device.type != "cuda":
        return False
    try:
        torch.empty(1, device="cpu", pin_memory=True)
        return True
    except RuntimeError as e:  # e.g. the locked-memory limit (ulimit -l)
        warnings.warn(f"offload: pinned host memory refused ({str(e).splitlines()[0]}); using pageable memory "
                      f"(slower copies): raise the locked-memory limit (ulimit -l) to pin it", stacklevel=3)
        return False


@torch.no_grad()
def to_host(tensors: list[torch.Tensor], pinned: bool) -> list[torch.Tensor]:
    """Host copies of device `tensors` (pinned: asynchronous copies into pinned memory, one wait for all of them)."""
    out = []
    for t in tensors:
        if t.device.type == "cpu":
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        out.append(host)
    for device in {t.device for t in tensors if t.device.type == "cuda"} if pinned else ():
        torch.cuda.current_stream(device).synchronize()  # the copies are done before the host reads them
    return out


class HostMasters:
    """This rank's masters and their gradients in host memory, for an optimizer built over `values`.

    `copies`: the masters are the device's, copied here (offload="optimizer"); False: the engine's masters live
    on the host already and their gradients come there by themselves (ZeRO-3's offload="params")."""

    def __init__(self, engine, device: torch.device, threads: int | None = None, copies: bool = True,
                 module: nn.Module | None = None):
        masters = engine.masters()
        self.engine, self.device = engine, device
        if copies:
            self.pinned = can_pin(device)
            shapes = [m.shape for m in masters]
            dtype = masters[0].dtype if masters else torch.float32  # the precision's master dtype (fp32, or fp64)
            self.values = host_tensors(shapes, dtype, self.pinned)
            self._grads: list[torch.Tensor] | None = host_tensors(shapes, dtype, self.pinned)
            with torch.no_grad():
                for value, master in zip(self.values, masters):
                    value.copy_(master)
            engine.keep_master_values(self.values)
        else:
            self.values, self._grads = masters, None
            self.pinned = bool(masters) and masters[0].is_pinned()
        # The host step's intra-op threads; on a CPU run the host is the device, whose threads stay as they are.
        self.threads = (threads or host_threads()) if device.type == "cuda" else None
        self._threads_before: int | None = None
        # The overlapped step (`host_step.py`): groups of masters by the units of `module` (None: one group).
        groups, units = step_groups(module, engine.master_names()) if module is not None else \
            ([list(range(len(masters)))], [])
        self.step = HostStep(engine, self.values, groups, device, self.threads)
        self.step.hook_units(units)
        self.overlapped = False

    def before_parameters(self, ready, defer: bool) -> None:
        """Before the engine's post-step path: how it waits for the host step (`ready`, from `finish`; None: done)
        and whether its collectives wait for the forward (`defer`)."""
        self.engine.await_values(ready, defer)

    def launch(self, optimizer) -> None:
        """The step's start (the optimizer's pre-step hook, after the agreement): torch's Adam / AdamW step each
        group of masters in the worker thread (`HostStep`), which the optimizer's own step body then leaves
        alone; any other optimizer steps the host masters in this thread, all at once."""
        self.overlapped = overlappable(optimizer)
        if self.overlapped:
            self.step.launch(optimizer, [m.grad for m in self.engine.masters()], self._grads, self.pinned)
        else:
            self.gradients_to_host()
            self.begin_step()

    def finish(self):
        """The step's end (the optimizer's post-step hook): the device's gradients go; returns what the engine's
        post-step path waits on per group of masters (`HostStep.wait`), or None when the step is done already."""
        self.end_step()
        return self.step.wait if self.overlapped else None

    def settle(self, bring: bool = False) -> None:
        """The step under way, if any, done: before anything reads the host masters or the optimizer's state;
        `bring` (collective: at the same point on every rank): the parameters too (`HostPlaced.bring`)."""
        self.step.settle()
        if bring:
            self.engine.bring(range(len(self.values)))

    @torch.no_grad()
    def gradients_to_host(self) -> None:
        """Each device master's gradient (final, clipped, unscaled) into its host buffer, as its host copy's `.grad`
        (None where the master has none: the optimizer leaves it alone, as it would on the device). On CUDA the
        copies into pinned memory are queued behind the device's last write to the gradients, and waited for
        once, before the host step reads them."""
        if self._grads is None:  # they are there already
            return
        for master, value, buffer in zip(self.engine.masters(), self.values, self._grads):
            if master.grad is None:
                value.grad = None
                continue
            buffer.copy_(master.grad.view(buffer.shape), non_blocking=self.pinned)
            value.grad = buffer
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()

    def begin_step(self) -> None:
        """The host step's threads on (restored by `end_step`)."""
        self._threads_before = torch.get_num_threads()
        if self.threads is not None and self.threads != self._threads_before:
            torch.set_num_threads(self.threads)

    def end_step(self) -> None:
        if self._threads_before is not None and self._threads_before != torch.get_num_threads():
            torch.set_num_threads(self._threads_before)
        self._threads_before = None
        for value in self.values:
            value.grad = None  # the buffers stay, for the next step
        self.engine.zero_grad()  # the device's gradients, which the optimizer (and its zero_grad) does not see

    def host_bytes(self) -> int:
        """Bytes of host memory the masters and gradient buffers hold (the optimizer's state comes on top)."""
        return sum(t.numel() * t.element_size() for t in self.values + (self._grads or []))

