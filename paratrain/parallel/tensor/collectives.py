"""Tensor-parallel collectives along any tensor dim, each one flat collective through `Comm`, and the error of a size
they cannot split.

The building blocks of both forms of the primitives: `primitives` (eager autograd functions) and `traced` (custom
operators, while torch.compile traces a block).
"""

from __future__ import annotations

import torch

from paratrain.comm import Comm
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis


class TensorParallelError(ParatrainError, ValueError):
    """A size or plan that tensor parallelism cannot split; the message names it and the rule."""


def check_divisible(where: str, what: str, size: int, tp: int) -> None:
    """Raise TensorParallelError unless `size` splits evenly over `tp` ranks."""
    if size % tp:
        raise TensorParallelError(f"{where}: {what}={size} is not divisible by tp={tp}; "
                                  f"choose tp dividing {size}")


# -- tensor helpers (flat dim-0 collectives along any dim) -----------------------------------

def _split(x: torch.Tensor, dim: int, comm: Comm, axis: Axis) -> torch.Tensor:
    n, r = comm.mesh.size(axis), comm.mesh.coord(axis)
    check_divisible("split", f"size of dim {dim}", x.shape[dim], n)
    return x.chunk(n, dim)[r].contiguous()


def _all_gather(x: torch.Tensor, dim: int, comm: Comm, axis: Axis) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`. Gathered as they are, stacked on a new leading dim (rank r's
    block is its `x`, in place), then that dim moved beside `dim`: one copy, none when `dim` is 0."""
    n, dim = comm.mesh.size(axis), dim % x.dim()
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n, *x.shape))
    comm.all_gather(out.flatten(0, 1), x, axis)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Comm, axis: Axis) -> torch.Tensor:
    """Sum over the ranks of `x`, this rank's 1/n of it along `dim`. `dim` split in n blocks moved to the
    front (one copy, none when `dim` is 0), so each rank's block is a chunk of dim 0; its block arrives in the
    layout of `x`, so nothing is copied after."""
    n, dim = comm.mesh.size(axis), dim % x.dim()
    if n == 1:
        return x
    check_divisible("reduce-scatter", f"size of dim {dim} (sequence length)", x.shape[dim], n)
    front = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = front.new_empty(front.shape[1:])
    comm.reduce_scatter(out, front.flatten(0, 1), axis)
    return out


def _all_reduce(x: torch.Tensor, comm: Comm, axis: Axis) -> torch.Tensor:
    # A fresh contiguous buffer: autograd may hold `x`, and a gradient can be a stride-0 expand.
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, axis)
    return out
