"""The offloaded optimizer step, overlapped: the host steps the masters group by group in a worker thread while
the device runs on, and the next forward waits for each group only where it first reads it.

Groups are the model's units (`paratrain.parallel.blocks.unit_modules`: each block, each module outside the
blocks that holds parameters of its own, and the root's own parameters first), in the order the forward reads
them. One step, after the agreement (skip, global norm, clipping: decided from the device's gradients before
any host update, so they are exactly the device step's):

1. `HostStep.launch` (the optimizer's pre-step hook, main thread): each group's gradients leave the device on
   a copy stream, in forward order, with an event after each group; the optimizer's per-parameter lists
   (masters, gradients, moments, step counts: torch's own lazy state initialization, `Adam._init_group`) and
   its hyperparameters are taken now, so a learning-rate scheduler stepped after `optimizer.step()` returns
   acts on the next step, as without offload. The host masters keep no `.grad`: the optimizer's own `step()`
   body, which runs next, finds nothing to step, and a `zero_grad()` of the caller's touches nothing the
   worker reads.
2. the worker, per group: waits for the group's gradients (its event), steps its masters with torch's Adam /
   AdamW kernel on the host (fused where the optimizer asks for it) with the node's share of the cores, copies
   the group's values back to the device on the copy stream (`engine.values_to_device`), records an event
   and marks the group ready.
3. the next forward: a pre-hook on each unit waits for its groups (the worker's mark, then the device's stream
   on the copy's event) before the unit computes; ZeRO-3 waits for a unit's groups before it gathers the unit
   (a prefetch included). What reads the masters otherwise (a checkpoint, an export, the optimizer's state
   dict, the next backward) first waits for the whole step (`settle`).

So between `optimizer.step()` and the next forward a parameter read directly (`model.module.weight`) may still
be the last step's: `ParallelModel.masters()`, `full_parameters()` and the optimizer's state dict wait for the
step; `model.offload.settle()` does so by itself.

The gradients leave the device after the agreement, not while backward runs: the host step of a group takes
longer than its copy (28 bytes per parameter through host memory against 4 over the host link: about 3x at
100 GB/s of host AdamW traffic and 50 GB/s of PCIe), so each group's copy already hides behind the step of the
group before it, and copying during backward could hide the first group's copy only (an embedding: ~10 ms for a
7B model) while copying again every gradient that changes after its reduction (fp16 unscaling, the sum of
sequence-parallel gradients over tp, ZeRO-2's accumulation over micro-batches).

Only torch's own Adam and AdamW are stepped this way (their per-parameter kernels step any subset of the
parameters alike); any other optimizer steps all host masters in the caller's thread (`HostMasters.launch`).
On a CPU-only machine the same threads and waits run, with synchronous copies: tested here, saving nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch import nn
from torch.optim.adam import adam

from paratrain import compat
from paratrain.parallel.blocks import unit_modules

_HYPER = ("amsgrad", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable", "differentiable", "fused",
          "decoupled_weight_decay")


def overlappable(optimizer) -> bool:
    """Whether `optimizer` is torch's Adam or AdamW with the functional kernel `HostStep` calls (AdamW as Adam with
    decoupled weight decay)."""
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and compat.has_init_group(optimizer)
            and all("decoupled_weight_decay" in group for group in optimizer.param_groups))


def step_groups(module: nn.Module, names: list[str]) -> tuple[list[list[int]], list[tuple[nn.Module, list[int]]]]:
    """(master indices per group in forward order, (unit module, its masters' indices) per unit) for masters named
    `names` (parameter names of `module`). A master no unit holds goes with the root's, stepped first."""
    index = {name: i for i, name in enumerate(names)}
    units = [(m, [index[f"{prefix}.{n}"] for n, _ in m.named_parameters() if f"{prefix}.{n}" in index])
             for prefix, m in unit_modules(module, None)]
    units = [(m, held) for m, held in units if held]
    inside = {i for _, held in units for i in held}
    root = [i for i in range(len(names)) if i not in inside]
    groups = ([root] if root else []) + [held for _, held in units]
    if root:
        units.insert(0, (module, root))
    return groups, units


class HostStep:
    """The worker thread's steps of one `HostMasters` and the waits for them (`launch`, `wait`, `settle`)."""

    def __init__(self, engine, values: list[torch.Tensor], groups: list[list[int]], device: torch.device,
                 threads: int | None):
        self.engine, self.values, self.groups, self.device = engine, values, groups, device
        self.threads = threads  # (None: as they are)
        self._group_of = {i: g for g, held in enumerate(groups) for i in held}
        self._ready = [threading.Event() for _ in groups]
        self._copied: list[torch.cuda.Event | None] = [None] * len(groups)  # a group's values on the device
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copies = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _stream(self):
        return torch.cuda.stream(self._copies) if self._copies is not None else contextlib.nullcontext()

    @torch.no_grad()
    def launch(self, optimizer, grads: list[torch.Tensor | None], buffers: list[torch.Tensor] | None, pinned: bool):
        """Each group's gradients (`grads`, per master; None: not stepped) to their host `buffers` (None: they are
        on the host), the optimizer's lists taken, and the worker started on them."""
        self.settle()
        if self._copies is not None:  # the copies read what the device wrote before now
            self._copies.wait_stream(torch.cuda.current_stream(self.device))
        arrived: list[torch.cuda.Event | None] = []
        for held in self.groups:
            with self._stream():
                for i in held:
                    if grads[i] is not None and buffers is not None:
                        buffers[i].copy_(grads[i].view(buffers[i].shape), non_blocking=pinned)
                        if self._copies is not None:  # the device's allocator keeps it until the copy is done
                            grads[i].record_stream(self._copies)
                arrived.append(self._copies.record_event() if self._copies is not None else None)
        for i, value in enumerate(self.values):
            value.grad = grads[i] if buffers is None or grads[i] is None else buffers[i]
        work = [[] for _ in self.groups]  # per group: (hyperparameters, the kernel's lists) per optimizer group
        position = {id(v): i for i, v in enumerate(self.values)}
        for group in optimizer.param_groups:
            lists = ([], [], [], [], [], [])
            has_complex = compat.init_group(optimizer, group, *lists)
            hyper = {k: group[k].clone() if torch.is_tensor(group[k]) else group[k] for k in _HYPER}
            hyper.update(beta1=group["betas"][0], beta2=group["betas"][1], has_complex=has_complex)
            by_group = [([], [], [], [], [], []) for _ in self.groups]
            amsgrad = group["amsgrad"]
            for k, param in enumerate(lists[0]):
                row = by_group[self._group_of[position[id(param)]]]
                for j in (0, 1, 2, 3, 5):
                    row[j].append(lists[j][k])
                if amsgrad:
                    row[4].append(lists[4][k])
            for g, row in enumerate(by_group):
                if row[0]:
                    work[g].append((hyper, row))
        for value in self.values:
            value.grad = None  # the optimizer's own step body steps nothing; the worker holds the lists
        for event in self._ready:
            event.clear()
        self._thread = threading.Thread(target=self._run, args=(work, arrived, getattr(optimizer, "grad_scale", None)),
                                        name="paratrain-host-step")  # (not a daemon: an exit waits for it)
        self._thread.start()

    def _run(self, work, arrived, grad_scale) -> None:
        before = torch.get_num_threads()
        try:
            if self._copies is not None:  # (the current device is a thread's own)
                torch.cuda.set_device(self.device)
            if self.threads is not None and self.threads != before:
                torch.set_num_threads(self.threads)
            with torch.no_grad():
                for g, held in enumerate(self.groups):
                    if arrived[g] is not None:
                        arrived[g].synchronize()
                    for hyper, lists in work[g]:
                        adam(*lists, grad_scale=grad_scale, found_inf=None, **hyper)
                    with self._stream():
                        if work[g]:  # (a group with nothing stepped, e.g. a skipped step, is on the device as is)
                            self.engine.values_to_device(held)
                        self._copied[g] = self._copies.record_event() if self._copies is not None else None
                    self._ready[g].set()
        except BaseException as e:  # raised again where the main thread waits
            self._error = e
        finally:
            if self.threads is not None and torch.get_num_threads() != before:
                torch.set_num_threads(before)
            for event in self._ready:
                event.set()

    def wait(self, indices) -> None:
        """Block until the groups holding the masters at `indices` are stepped; the device's stream then waits for
        their copies. Returns at once when no step is under way."""
        if self._thread is None:
            return
        for g in sorted({self._group_of[i] for i in indices}):
            self._ready[g].wait()
            self._raise()
            if self._copied[g] is not None:
                torch.cuda.current_stream(self.device).wait_event(self._copied[g])

    def settle(self) -> None:
        """Wait for the whole step under way, if any."""
        if self._thread is None:
            return
        self._thread.join()
        self._raise()
        self.wait(range(len(self.values)))
        self._thread = None

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error, self._thread = self._error, None, None
            raise RuntimeError(f"offload: the host step failed: {error}") from error

    def hook_units(self, units: list[tuple[nn.Module, list[int]]]) -> None:
        """A forward pre-hook on each unit: wait for its groups before it computes (first among its pre-hooks)."""
        for module, held in units:
            module.register_forward_pre_hook(functools.partial(_wait_for, self, held), prepend=True)


def _wait_for(step: HostStep, held: list[int], module, args) -> None:
    step.wait(held)
    step.engine.bring(held)  # (ZeRO-1/2: the all-gather of the unit's buckets, in the forward's order on every rank)
