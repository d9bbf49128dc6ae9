"""Tensor-parallel communication inside compiled blocks: the collectives as custom operators.

A compiled block (`paratrain.parallel.compile`) must not break its graph at a tensor-parallel layer's
collective. `Comm` cannot be traced (it counts, times and issues torch.distributed calls from Python),
so while torch.compile traces, each primitive of `primitives` is an autograd function built from
custom operators (`paratrain::all_reduce`, `all_gather`, `reduce_scatter`): opaque to the compiler,
placed in the graph as a matmul would be, and run at step time by the same `Comm` method as in eager,
so each is counted the same. An operator names its `Comm` by an integer handle (a graph holds numbers
and strings, not objects), from `register` when parallelize() compiles; `_COMMS` maps the handles back
for as long as their Comm lives. The operators are functional (each returns a new tensor), so the
compiler may keep or drop their inputs; the eager primitives' in-place sums are their eager
counterparts.

Per pass each function issues what its eager twin does: `copy_to_tp` nothing forward, an all-reduce
backward; `reduce_from_tp` the reverse; `gather_sequence` an all-gather forward, a reduce-scatter
backward; `reduce_scatter_sequence` the reverse; `gather_from_tp` an all-gather forward (a split
backward); `scatter_to_tp` a split forward (an all-gather backward).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from paratrain.comm import Comm
from paratrain.parallel.tensor import collectives

_COMMS: weakref.WeakValueDictionary[int, Comm] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()
_HANDLE = "_paratrain_trace_handle"


def register(comm: Comm) -> int:
    """The handle under which compiled graphs find `comm` (assigned once per Comm)."""
    handle = getattr(comm, _HANDLE, None)
    if handle is None:
        handle = next(_HANDLES)
        _COMMS[handle] = comm
        setattr(comm, _HANDLE, handle)
    return handle


def _comm(handle: int) -> Comm:
    return _COMMS[handle]


def _distinct(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A custom operator may not return its input (one rank on the axis: the collective is the identity).
    return out.clone() if out is x else out


@torch.library.custom_op("paratrain::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, handle: int, axis: str) -> torch.Tensor:
    """Sum of `x` over `axis`, in a new contiguous tensor."""
    out = x.clone(memory_format=torch.contiguous_format)
    _comm(handle).all_reduce(out, axis)
    return out


@all_reduce.register_fake
def _(x, handle, axis):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("paratrain::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, world: int, handle: int, axis: str) -> torch.Tensor:
    """The `world` ranks' `x` concatenated along `dim`, contiguous."""
    return _distinct(collectives._all_gather(x, dim, _comm(handle), axis).contiguous(), x)


@all_gather.register_fake
def _(x, dim, world, handle, axis):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


@torch.library.custom_op("paratrain::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, world: int, handle: int, axis: str) -> torch.Tensor:
    """This rank's 1/world along `dim` of the sum of `x` over `axis`, contiguous."""
    return _distinct(collectives._reduce_scatter(x, dim, _comm(handle), axis).contiguous(), x)


@reduce_scatter.register_fake
def _(x, dim, world, handle, axis):
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


def _apply(kind: str, x: torch.Tensor, dim: int, world: int, rank: int, handle: int, axis: str) -> torch.Tensor:
    if kind == "identity":
        return x
    if kind == "all_reduce":
        return all_reduce(x, handle, axis)
    if kind == "all_gather":
        return all_gather(x, dim, world, handle, axis)
    if kind == "reduce_scatter":
        return reduce_scatter(x, dim, world, handle, axis)
    assert kind == "split", kind
    return x.chunk(world, dim)[rank].contiguous()


class _TracedPair(torch.autograd.Function):
    """`forward_kind` applied to the input, `backward_kind` to its gradient (`_apply`'s kinds)."""

    @staticmethod
    def forward(ctx, x, forward_kind, backward_kind, dim, world, rank, handle, axis):
        ctx.backward_args = (backward_kind, dim, world, rank, handle, axis)
        out = _apply(forward_kind, x, dim, world, rank, handle, axis)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        kind, dim, world, rank, handle, axis = ctx.backward_args
        return (_apply(kind, grad, dim, world, rank, handle, axis),) + (None,) * 7


def pair(x: torch.Tensor, forward_kind: str, backward_kind: str, comm: Comm, axis: str, dim: int = 0) -> torch.Tensor:
    """One primitive of `primitives` as the compiler traces it (called there when compiling)."""
    handle = getattr(comm, _HANDLE, None)
    if handle is None:
        raise collectives.TensorParallelError("a tensor-parallel model compiles through parallelize(..., compile=True)")
    # The operators' schemas take the axis as a plain string: the graph holds its name, not a `mesh.Axis`.
    return _TracedPair.apply(x, forward_kind, backward_kind, dim % x.dim(), comm.mesh.size(axis),
                             comm.mesh.coord(axis), handle, str(axis))
