"""The contract between a parallel model and its data-parallel engine: DDP and ZeRO-1/2 (`ddp.py`), ZeRO-3 (`zero3.py`).

An engine owns the master weights (the tensors the optimizer steps: fp32, and under ZeRO this
rank's shard) and the gradient communication over the data-parallel axis. One optimizer step,
as `paratrain.parallel.model.ParallelModel` drives it:

1. forward and backward of each micro-batch; every backward but the last inside `no_sync()`
   (engines that can defer communication accumulate locally). The engine's gradient hooks
   collect gradients and launch their reductions while backward runs (overlap).
2. `finish_gradients()`: wait for every reduction. Every master that some micro-batch reached
   on this rank has its final gradient (summed, or averaged, over the data ranks); the return
   value flags, per master, whether this rank's backward reached it (1) or not (0): a device
   tensor, summed over the data ranks and read by the step's one mesh-wide agreement, not here
   (no collective of its own, no host sync inside the engine).
3. `drop_gradients(indices)`: the masters no data rank reached lose their gradient (None), so
   the optimizer leaves them alone exactly as one process would (AdamW would otherwise decay
   them).
4. the optimizer steps the masters (this the engine does not see).
5. `after_step()`: bring the parameters the model computes with up to date (ZeRO-1/2: all-gather
   the updated rows; mixed-precision DDP: cast the masters into the compute copies).

Where the optimizer steps is a placement's matter, not the engine's contract: a placement that steps
the masters elsewhere (in host memory) owns the small interface it needs of an engine (`HostPlaced`,
in the placement's module), which the engines implement besides this one.

Nothing in an engine runs at the end of backward by itself: the model calls 2, 3 and 5 in that
order, and so each engine's state is only what the steps above say.

Besides the contract, what every engine shares: its per-master flags (`used_flags`), hooks that hold it weakly
(`weak_hook`), the fp32 accumulation of mixed precision (`add_to_master`) and the squared norm of the gradients
it holds (`sum_of_squares`, `sum_of_squares_flat`).
"""

from __future__ import annotations

import weakref
from enum import Enum
from typing import Callable, ContextManager, Iterable, Iterator, Protocol, runtime_checkable

import torch


class GradReduction(str, Enum):
    """How gradients combine over the data ranks."""

    MEAN = "mean"  # averaged (the DDP convention: each rank's loss is a mean over its own batch)
    SUM = "sum"  # summed (the loss is already normalized over the global batch, as paratrain's trainer does)


@runtime_checkable
class Engine(Protocol):
    """What every data-parallel engine provides; `tests/parallel/data/test_engine_contract.py` checks each one."""

    grads_sharded: bool
    """Each data rank holds 1/N of every gradient (ZeRO-1/2/3): a global norm sums over dp."""

    params_sharded: bool
    """Parameters at rest are this rank's 1/N rows (ZeRO-3): they are not replicas of each other."""

    def groups(self) -> list[tuple["Engine", bool]]:
        """(engine, whether its copies live on an axis of their own rather than the data axis) per group of
        parameters reduced alike: this engine alone, or one per group (`paratrain.parallel.data.groups`); who owns
        a copy depends on the group."""

    def masters(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates (fp32), in a fixed order."""

    def master_names(self) -> list[str]:
        """The parameter name of each master, in `masters()` order."""

    def master_rows(self) -> list[tuple[str, tuple[int, int], torch.Size]]:
        """Per master: parameter name, the rows [lo, hi) of the parameter it holds, the parameter's shape."""

    def no_sync(self) -> ContextManager:
        """Backward passes inside accumulate locally; the next backward outside communicates all."""

    def finish_gradients(self) -> torch.Tensor:
        """Wait for the gradient reductions; set master gradients; return per master 1 if this rank's backward
        reached it this step, else 0 (the last step's flags when no gradient came since)."""

    def drop_gradients(self, indices: list[int]) -> None:
        """Remove the gradients of the masters at `indices` (no data rank reached them, or the step is skipped)."""

    def after_step(self) -> None:
        """Make the model's parameters equal to the (updated) masters."""

    def zero_grad(self) -> None:
        """Drop every gradient: masters' and parameters'."""

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Σ grad² over the gradients this rank holds (its shard under ZeRO), as a 0-d tensor on the device."""

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter that trains whole, one at a time, by name (collective under ZeRO-3: every rank iterates)."""

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and separate masters that exist on this rank now (by storage)."""


def used_flags(flags: list[bool], device) -> torch.Tensor:
    """Per-master flags kept on the host while backward runs (no kernel per gradient), as one host-to-device
    copy at the end (never a read back: no sync)."""
    return torch.tensor(flags, dtype=torch.float32, device="cpu").to(device, non_blocking=True)


def weak_hook(method: Callable) -> Callable:
    """`method` (an engine's bound method) as a hook that holds its engine weakly: for hooks torch keeps in C++.

    A hook on a tensor (`register_post_accumulate_grad_hook`, `register_hook`) is held by the tensor's
    C++ side, which Python's garbage collector does not traverse: a bound method there would make
    parameter → hook → engine → parameter a cycle the collector never sees, and every model built
    would outlive its last reference (its parameters, fp32 masters and buckets with it). Through a
    weak reference the engine goes with the model; a hook left on a parameter the caller still holds
    then does nothing.
    """
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook


@torch.no_grad()
def add_to_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """One data rank in mixed precision: the 16-bit gradient autograd just left is added into its fp32 master's
    (micro-batches accumulate in fp32) and dropped (a gradient exists once)."""
    grad, param.grad = param.grad, None
    grad = grad.to(master.dtype).view_as(master)
    master.grad = grad if master.grad is None else master.grad.add_(grad)


# -- Σ‖g‖² of the gradients an engine holds (`Engine.local_grad_sq_sum`; tensor parallelism's split of it by
# sharding, `paratrain.parallel.tensor.info`), without a Python loop of small kernels per tensor --------------------

def sum_of_squares(tensors: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Σ‖t‖² over `tensors` as a 0-d fp64 tensor on `device` (zero when there is none).

    One `_foreach_norm` per dtype, each tensor's norm taken in at least fp32 (a bf16 gradient's
    squares would lose their low bits), the per-tensor norms squared and summed in fp64, so the
    total does not depend on how many tensors there are. It stays on the device: no host sync.
    """
    tensors = list(tensors)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for dtype in dict.fromkeys(t.dtype for t in tensors):  # in order of appearance: the same sum every run
            group = [t for t in tensors if t.dtype == dtype]
            norms = torch._foreach_norm(group, 2, dtype=torch.promote_types(dtype, torch.float32))
            total += torch.stack(norms).double().pow(2).sum()
    return total


_ROW = 2048


def sum_of_squares_flat(flats: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Σ‖t‖² over long flat (1-d) buffers, as `sum_of_squares`, in rows of 2048 values.

    One fp32 norm over a whole buffer drifts: the CPU's accumulates in fp32 (3.1M values: off by
    1e-4), and an fp64 norm costs 20× (9 ms against 0.4 ms, one thread). Each row's norm in fp32,
    their squares summed in fp64: 4e-9 at the cost of the fp32 pass, one kernel per buffer.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for flat in flats:
            whole = flat.numel() // _ROW * _ROW
            dtype = torch.promote_types(flat.dtype, torch.float32)
            for part in (flat[:whole].view(-1, _ROW), flat[whole:].view(1, -1)):
                if part.numel():
                    total += torch.linalg.vector_norm(part, dim=1, dtype=dtype).double().pow(2).sum()
    return total
