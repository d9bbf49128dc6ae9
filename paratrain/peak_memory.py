"""Peak memory as it really is: the process's peak, and the peak of live tensor bytes by category.

Two measures, for two questions:

- `ProcessPeak`: how much memory did this process need over a window (a training step)? On CUDA
  the caching allocator's peak of allocated bytes (`torch.cuda.max_memory_allocated`, reset at each
  window) with the reserved bytes beside it; on the CPU the peak resident set size (Linux: ``VmHWM``,
  reset by writing 5 to ``/proc/self/clear_refs``). glibc keeps freed memory in its heap by default,
  which hides transient tensors from RSS, so `return_freed_memory` asks it to serve every
  allocation of 128 KiB or more by its own mapping (``mallopt(M_MMAP_THRESHOLD)``, the same as the
  environment variable ``MALLOC_MMAP_THRESHOLD_=131072``): a freed tensor leaves RSS at once.

- `TensorMemory`: which tensors make up the peak? A dispatch mode that sees every operator
  (including every c10d collective) follows each tensor storage from the operator that created it
  until it is freed, keeps the running total of live bytes and its peak, and at the end of a window
  sorts the storages alive at the peak into categories: ``parameters`` (the model's and the
  optimizer's parameters: compute copies, shards, fp32 masters), ``gradients`` (their ``.grad``,
  and storages those are views of: DDP-style buckets), ``optimizer`` (optimizer state),
  ``communication`` (any other storage a collective read or wrote: buckets in flight, all-gather
  outputs, reduce-scatter inputs), ``activations`` (made outside backward and still alive when a
  backward began: what autograd saved), ``temporaries`` (everything else made during the window)
  and ``other`` (storages that existed before measuring and play none of these roles: a batch,
  caches). Nothing is asked of the code being measured: it works the same on paratrain and on
  PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2 (whose DTensor parameters it sees through to
  their local shards, and whose ``storage.resize_`` frees it follows).

    meter = TensorMemory()
    with meter:                               # every operator from here on is seen
        for step in range(steps):
            meter.begin(model, optimizer)     # the window starts: roles of what exists now
            ...forward, backward, optimizer step...
            window = meter.end(model, optimizer)
    window.peak_bytes, window.by_category

Compiled code (torch.compile) runs under the mode (an `ObservingMode`: the compiler's own tracing is
not seen, the compiled code's operators are): its fused kernels are no operators, but the
buffers they write are allocated by the compiled module's allocation functions, which the mode follows
while it is entered (`_follow_compiled_allocations`), so a compiled region's activations and
temporaries count as an eager one's do. (Modules compiled while the mode is entered are not followed:
compile before measuring, as a warm-up step does.)

What it cannot see: memory an operator uses inside itself and frees before returning (the
process peak catches that), and memory that is not a tensor (gloo's internal buffers, the
allocator's cache, code). The two measures together bound what a rank needs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import re
import resource
import sys
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from paratrain.compat import (ObservingMode, compiled_module_namespaces, in_backward, inner_tensors,
                              is_wrapper_subclass_type, tree_leaves)

CATEGORIES = ("parameters", "gradients", "optimizer", "communication", "activations", "temporaries", "other")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_MMAP_THRESHOLD = 128 << 10
_LARGEST = 12  # storages at the peak a window lists, largest first (to see what made the peak)


def return_freed_memory() -> bool:
    """Make glibc serve allocations of 128 KiB or more from their own mappings, so freeing returns them.

    Returns False where that is not possible (not glibc). Applies to allocations made from now on.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


# ---- the process's peak ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PeakReading:
    """The process's peak over a window: allocated (CUDA) or resident (CPU) bytes; reserved on CUDA."""

    peak_bytes: int
    reserved_bytes: int | None = None


class ProcessPeak:
    """The peak memory of this process over a window that `reset` starts and `read` ends."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.start_bytes = 0
        self.highest = 0  # the highest peak any `take` saw: with consecutive windows, the lifetime peak

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak_rss()
            self.start_bytes = proc_status_bytes("VmRSS") or 0

    def read(self) -> PeakReading:
        if self.device.type == "cuda":
            return PeakReading(torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
        peak = proc_status_bytes("VmHWM")
        if peak is None:  # no /proc: the lifetime peak (ru_maxrss: KiB on Linux, bytes on macOS)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return PeakReading(peak)

    def take(self) -> PeakReading:
        """The peak since the last reset, and a new window from now (consecutive windows cover all time)."""
        reading = self.read()
        self.highest = max(self.highest, reading.peak_bytes)
        self.reset()
        return reading


def reset_peak_rss() -> bool:
    """VmHWM back to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            return f.write("5") == 1
    except OSError:
        return False


def proc_status_bytes(field_name: str) -> int | None:
    """A figure of this process from /proc/self/status (VmRSS, VmHWM, ...) in bytes; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            found = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


# ---- live tensors ------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Storage:
    """What is known of one live storage."""

    nbytes: int
    born: str  # "before" (existed before it was first seen), "step", "backward", "optimizer"
    role: str | None = None  # parameters / gradients / optimizer, from the objects named at begin/end
    comm: bool = False  # a collective read or wrote it
    saved: bool = False  # alive when a backward began
    op: str = ""  # the operator that created it (or first touched it, for one that existed before)


@dataclass
class Window:
    """One measured window: the peak of live tensor bytes, what made it up, and the process's peak."""

    peak_bytes: int
    start_bytes: int
    by_category: dict[str, int]  # the storages alive at the peak (within `resolution`), by category
    process: PeakReading | None = None
    process_start_bytes: int = 0
    ops: int = 0
    largest: list[tuple[int, str, str, str]] = field(default_factory=list)  # (bytes, category, born, operator)

    @property
    def process_rise_bytes(self) -> int | None:
        """The process's peak above where it stood when the window began (RSS rise on the CPU)."""
        return None if self.process is None else self.process.peak_bytes - self.process_start_bytes


@dataclass
class _Peak:
    bytes: int = 0
    members: list[_Storage] = field(default_factory=list)
    members_bytes: int = 0


class TensorMemory(ObservingMode):
    """Live tensor bytes of this process by category, and their peak over windows (see the module doc).

    `resolution`: the categories describe the set of storages alive when the live total last grew
    past the previous such set by this fraction: the breakdown is within it of the exact peak, which
    `Window.peak_bytes` is.
    """

    def __init__(self, device: torch.device | str = "cpu", resolution: float = 0.002):
        super().__init__()
        self.resolution = resolution
        self.process = ProcessPeak(torch.device(device))
        self._live: dict[int, tuple[weakref.ref, _Storage]] = {}  # id(storage object) -> (its weakref, record)
        self.total = 0
        self._peak = _Peak()
        self._start = 0
        self._in_optimizer = False
        self._in_backward = False
        self._ops = 0
        self._hooks: list = []
        self._original_resize = None
        self._compiled_allocations: list[tuple[dict, str, object]] = []  # (module globals, name, original)

    # -- the mode ---------------------------------------------------------------------------------
    def __enter__(self):
        self._hooks = [register_optimizer_step_pre_hook(self._optimizer_begins),
                       register_optimizer_step_post_hook(self._optimizer_ends)]
        self._follow_resize()
        self._follow_compiled_allocations()
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        torch.UntypedStorage.resize_ = self._original_resize
        for namespace, name, original in self._compiled_allocations:
            namespace[name] = original
        self._compiled_allocations = []
        return super().__exit__(*exc)

    def _optimizer_begins(self, optimizer, *_):
        self._assign_roles([optimizer])  # its gradients, which zero_grad may free before the window ends
        self._in_optimizer = True

    def _optimizer_ends(self, *_):
        self._in_optimizer = False

    def _follow_resize(self) -> None:
        """`UntypedStorage.resize_` is not an operator (FSDP2 frees and refills storages with it): follow it."""
        original = self._original_resize = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage, size):
            result = original(storage, size)
            entry = meter._live.get(id(storage))
            if entry is not None:
                meter._resize(entry[1], storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_

    def _follow_compiled_allocations(self) -> None:
        """Route the allocation functions of the compiled modules loaded now through `_allocated`."""
        for namespace in compiled_module_namespaces():
            for name, original in list(namespace.items()):
                if name.startswith("empty_strided") and callable(original):
                    namespace[name] = functools.partial(self._allocated, original)
                    self._compiled_allocations.append((namespace, name, original))

    def _allocated(self, allocate, *args, **kwargs) -> torch.Tensor:
        """A buffer a compiled kernel will write: born now, as an operator's output would be."""
        out = allocate(*args, **kwargs)
        self._see(out, self._phase(), op="compiled")
        self._note_peak()
        return out

    def _phase(self) -> str:
        backward = in_backward()
        if backward and not self._in_backward:  # a backward begins: what lives now is what it needs
            for _, record in self._live.values():
                record.saved = True
        self._in_backward = backward
        return "optimizer" if self._in_optimizer else "backward" if backward else "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor's own dispatch runs the local operators, which come back here
        out = func(*args, **(kwargs or {}))
        self._ops += 1
        phase = self._phase()
        comm = func.namespace == "c10d"
        for t in _tensors((args, kwargs)):
            self._see(t, "before", comm, op=func)
        for t in _tensors(out):
            self._see(t, phase, comm, op=func)
        self._note_peak()
        return out

    # -- bookkeeping ------------------------------------------------------------------------------
    def _see(self, t: torch.Tensor, born: str, comm: bool = False, role: str | None = None,
             op=None) -> _Storage | None:
        if t.device.type == "meta" or t.layout != torch.strided:
            return None
        storage = t.untyped_storage()
        if storage.device.type == "meta":  # a fake tensor (torch.compile keeps its tracing values): no memory
            return None
        entry = self._live.get(id(storage))
        if entry is None or entry[0]() is not storage:
            record = _Storage(storage.nbytes(), born, op=str(op or ""))
            key = id(storage)
            self._live[key] = (weakref.ref(storage, lambda _, key=key, record=record: self._freed(key, record)), record)
            self.total += record.nbytes
        else:
            record = entry[1]
            if record.nbytes != storage.nbytes():
                self._resize(record, storage.nbytes())
        record.comm |= comm
        if role is not None:
            record.role = role
        return record

    def _freed(self, key: int, record: _Storage) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[1] is record:
            del self._live[key]
        self.total -= record.nbytes

    def _resize(self, record: _Storage, nbytes: int) -> None:
        self.total += nbytes - record.nbytes
        record.nbytes = nbytes
        self._note_peak()

    def _note_peak(self) -> None:
        if self.total <= self._peak.bytes:
            return
        self._peak.bytes = self.total
        if self.total > self._peak.members_bytes * (1 + self.resolution):
            self._peak.members = [record for _, record in self._live.values()]
            self._peak.members_bytes = self.total

    # -- windows ----------------------------------------------------------------------------------
    def begin(self, *owners) -> None:
        """Start a window: find every tensor alive now (and the roles of `owners`' tensors)."""
        for obj in gc.get_objects():  # tensors that existed before any operator touched them
            if issubclass(type(obj), torch.Tensor):  # (not isinstance: it would touch deprecated module attributes)
                for t in _tensors(obj):
                    self._see(t, "before")
        self._assign_roles(owners)
        self._ops = 0
        self._start = self.total
        self._peak = _Peak(self.total, [record for _, record in self._live.values()], self.total)
        self.process.reset()

    def end(self, *owners) -> Window:
        """End the window: the peak and, by category, the storages alive at it.

        `owners`: modules and optimizers whose parameters, gradients and state name the roles.
        """
        process = self.process.read()
        self._assign_roles(owners)
        by_category = dict.fromkeys(CATEGORIES, 0)
        for record in self._peak.members:
            by_category[_category(record)] += record.nbytes
        largest = sorted(self._peak.members, key=lambda r: -r.nbytes)[:_LARGEST]
        return Window(self._peak.bytes, self._start, by_category, process, self.process.start_bytes, self._ops,
                      [(r.nbytes, _category(r), r.born, r.op) for r in largest])

    def _assign_roles(self, owners) -> None:
        for role, tensors in roles(*owners).items():
            for t in tensors:
                for inner in _tensors(t):
                    self._see(inner, "before", role=role)


def roles(*owners) -> dict[str, list[torch.Tensor]]:
    """The tensors of modules and optimizers by role: parameters, gradients, optimizer state.

    A ZeroRedundancyOptimizer keeps its shard's state in `.optim`; parameters and gradients come
    from the optimizer's parameter groups too (a separate fp32 master, a shard).
    """
    params: list[torch.Tensor] = []
    state: list[torch.Tensor] = []
    for owner in owners:
        if isinstance(owner, nn.Module):
            params += list(owner.parameters())
        elif isinstance(owner, torch.optim.Optimizer):
            local = getattr(owner, "optim", owner)
            params += [p for group in owner.param_groups for p in group["params"]]
            state += [v for s in local.state.values() for v in s.values() if torch.is_tensor(v)]
        elif owner is not None:
            raise TypeError(f"roles of {type(owner).__name__}: pass modules and optimizers")
    grads = [p.grad for p in params if p.grad is not None]
    # later roles win: a storage that is optimizer state is that, whatever else points at it
    return {"gradients": grads, "parameters": params, "optimizer": state}


def _category(record: _Storage) -> str:
    if record.role is not None:
        return record.role
    if record.comm:
        return "communication"
    if record.born == "before":
        return "other"
    if record.born == "step" and record.saved:
        return "activations"
    return "temporaries"


def _tensors(tree) -> Iterable[torch.Tensor]:
    """Every plain tensor in a pytree; wrapper subclasses (DTensor) by their inner tensors."""
    for leaf in tree_leaves(tree):
        if not isinstance(leaf, torch.Tensor):
            continue
        inner = inner_tensors(leaf)
        if inner is not None:
            yield from _tensors(inner)
        else:
            yield leaf


@contextlib.contextmanager
def measured(*owners, device: torch.device | str = "cpu"):
    """One window around a block: ``with measured(model, optimizer) as result: ...``, then ``result.window``."""
    meter = TensorMemory(device)
    holder = _Result()
    with meter:
        meter.begin(*owners)
        yield holder
        holder.window = meter.end(*owners)


def kept_by_forward(model: nn.Module, forward, repeats: int = 5) -> int:
    """Bytes of tensors `forward()` leaves alive (what backward reads, and the output), the median of `repeats`.

    Each forward runs with the garbage collector held off after one collection: what building the model
    or the forward before left in cycles is freed before the window, and nothing is freed inside it.
    The median (an observed value), because a collective's tensor is released by the process group's
    thread, not by this one: on a loaded machine a forward's last collective may still hold one when the
    window closes (one reading too high), or the previous forward's may let go inside the window (one
    too low). Most readings are neither, and the median is one of those.
    """
    kept = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            meter = TensorMemory()
            with meter:
                meter.begin(model)
                out = forward()
                kept.append(meter.total - meter.end(model).start_bytes)
        finally:
            gc.enable()
        del out
    return sorted(kept)[len(kept) // 2]


@dataclass
class _Result:
    window: Window | None = None
