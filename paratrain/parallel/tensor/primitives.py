"""Tensor-parallel communication: autograd functions named by both passes, over the flat collectives of `collectives`.

`copy_to_tp` is the identity forward and an all-reduce of the gradient backward; `reduce_from_tp`
the reverse; `gather_sequence` / `reduce_scatter_sequence` are sequence parallelism's pair. Each
runs on an explicit `(comm, axis)`, so the collectives are counted per mesh axis; the layers of
`paratrain.parallel.tensor.layers` are built from them. While torch.compile traces a block, each
primitive is its twin of `traced` instead (the same collectives as custom operators, so that the block
compiles into one graph).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from paratrain.comm import Comm
from paratrain.compat import held_alone, storage_alone
from paratrain.mesh import Axis
from paratrain.parallel.tensor import traced
from paratrain.parallel.tensor.collectives import _all_gather, _all_reduce, _reduce_scatter, _split


# init(name, full_shape) -> the full fp32 initial value of parameter `name`.
InitFn = Callable[[str, tuple[int, ...]], torch.Tensor]


def _all_reduce_grad(grad: torch.Tensor, comm: Comm, axis: Axis) -> torch.Tensor:
    """A gradient summed over `axis`: in place when this backward holds it alone, else in a copy.

    Autograd can hand one gradient tensor to several branches (an add passes its gradient to both
    of its inputs as it is); summing it in place would change it for the others too. Alone means
    what autograd checks before accumulating into a gradient in place: nothing else references
    the tensor and no other tensor shares its storage (not a view or an expand, not saved for
    another backward). What enters a region is most often its layers' matmuls' fresh output: no copy.
    """
    if grad.is_contiguous() and held_alone(grad):
        comm.all_reduce(grad, axis)
        return grad
    return _all_reduce(grad, comm, axis)


# -- differentiable primitives, named by both passes --------------------------------------------

class _TwoPasses(torch.autograd.Function):
    """Apply `forward` to the input and `backward` to its gradient: every primitive below is one pair."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn = backward
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad), None, None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.detach()  # same storage; not a view, so the output does not keep the input alive


def copy_to_tp(x: torch.Tensor, comm: Comm, axis: Axis) -> torch.Tensor:
    """Forward identity, backward all-reduce over `axis`: a replicated input enters a tp region."""
    if torch.compiler.is_compiling():
        return traced.pair(x, "identity", "all_reduce", comm, axis)
    return _TwoPasses.apply(x, _identity, partial(_all_reduce_grad, comm=comm, axis=axis))


class _ReduceInPlace(torch.autograd.Function):
    """Forward all-reduce of a partial output where it lies, backward identity."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        # No place to sum in: a copy. Selective recomputation keeps an alias of a matmul's output (the
        # partial sum) to return it again in the recompute, where it is summed again: it must stay partial.
        if not x.is_contiguous() or (x.is_leaf and x.requires_grad) or not storage_alone(x):
            return _all_reduce(x, comm, axis)
        ctx.mark_dirty(x)
        comm.all_reduce(x, axis)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def reduce_from_tp(x: torch.Tensor, comm: Comm, axis: Axis) -> torch.Tensor:
    """Forward all-reduce over `axis`, backward identity: partial outputs leave a tp region summed.

    `x` is summed in place (no copy): it must be a partial output made for this sum, as a parallel
    layer's matmul or embedding output is, that nothing else reads. (A gradient entering a region
    is summed in place only when nothing else holds it: `_all_reduce_grad`.)
    """
    if torch.compiler.is_compiling():
        return traced.pair(x, "all_reduce", "identity", comm, axis)
    return _ReduceInPlace.apply(x, comm, axis)


def gather_from_tp(x: torch.Tensor, comm: Comm, axis: Axis, dim: int = -1) -> torch.Tensor:
    """Forward all-gather along `dim`, backward split (keep this rank's chunk): assemble a sharded output."""
    dim %= x.dim()
    if torch.compiler.is_compiling():
        return traced.pair(x, "all_gather", "split", comm, axis, dim)
    return _TwoPasses.apply(x, partial(_all_gather, dim=dim, comm=comm, axis=axis),
                            partial(_split, dim=dim, comm=comm, axis=axis))


def scatter_to_tp(x: torch.Tensor, comm: Comm, axis: Axis, dim: int = -1) -> torch.Tensor:
    """Forward split along `dim` (keep this rank's chunk), backward all-gather."""
    dim %= x.dim()
    if torch.compiler.is_compiling():
        return traced.pair(x, "split", "all_gather", comm, axis, dim)
    return _TwoPasses.apply(x, partial(_split, dim=dim, comm=comm, axis=axis),
                            partial(_all_gather, dim=dim, comm=comm, axis=axis))


def gather_sequence(x: torch.Tensor, comm: Comm, axis: Axis, dim: int = 1) -> torch.Tensor:
    """Forward all-gather of sequence shards, backward reduce-scatter (each rank's grad is partial)."""
    dim %= x.dim()
    if torch.compiler.is_compiling():
        return traced.pair(x, "all_gather", "reduce_scatter", comm, axis, dim)
    return _TwoPasses.apply(x, partial(_all_gather, dim=dim, comm=comm, axis=axis),
                            partial(_reduce_scatter, dim=dim, comm=comm, axis=axis))


def reduce_scatter_sequence(x: torch.Tensor, comm: Comm, axis: Axis, dim: int = 1) -> torch.Tensor:
    """Forward reduce-scatter of partial outputs along the sequence, backward all-gather of the grad."""
    dim %= x.dim()
    if torch.compiler.is_compiling():
        return traced.pair(x, "reduce_scatter", "all_gather", comm, axis, dim)
    return _TwoPasses.apply(x, partial(_reduce_scatter, dim=dim, comm=comm, axis=axis),
                            partial(_all_gather, dim=dim, comm=comm, axis=axis))


def enter_tp_region(x: torch.Tensor, comm: Comm, axis: Axis, sequence_parallel: bool) -> torch.Tensor:
    """Bring an activation into a tp region: `copy_to_tp`, or under SP `gather_sequence` (dim 1)."""
    if sequence_parallel:
        return gather_sequence(x, comm, axis, dim=1)
    return copy_to_tp(x, comm, axis)
