"""What applying a tensor-parallel plan did, and the whole-model operations that need it.

`TensorParallelInfo` records which parameters are split over tp and along which dim; the loss,
gradient norms, checkpoints and the data-parallel engines read it. The norm helpers count a
tp-sharded tensor's squares on every rank (summed over tp) and a replicated one once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import Axis
from paratrain.parallel.data.engine import sum_of_squares
from paratrain.parallel.tensor.layers import gather_full, vocab_parallel_cross_entropy
from paratrain.precision import cross_entropy


@dataclass
class TensorParallelInfo:
    """What `apply_tensor_parallel` did, for the loss, clipping, DP/ZeRO and checkpoints.

    Fields:
        comm, axis: the tp collectives.
        sequence_parallel: activations between tp regions are sequence-sharded.
        sharded: tp-sharded parameter name → the dim split over tp (0: colwise / vocab rows,
            1: rowwise); tied aliases included. Every other parameter is replicated over tp.
        sequence_partial: replicated parameters whose grads are partial sums over tp (under SP:
            norms, row-parallel biases; with or without SP: a LoRA linear's whole adapter,
            `paratrain.parallel.tensor.adapters`); all-reduced over tp by grad hooks unless disabled.
        vocab_sharded_logits: the model returns logits [.., V/t]; `loss_fn` handles it.
        tied: alias name → the name `named_parameters()` reports for the same tensor.
    """

    comm: Comm
    axis: Axis
    sequence_parallel: bool
    sharded: dict[str, int]
    sequence_partial: list[str]
    vocab_sharded_logits: bool
    tied: dict[str, str]
    handles: list = field(default_factory=list, repr=False)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                reduction: str = "sum") -> torch.Tensor:
        """Cross-entropy of the model's logits (at least fp32): vocab-parallel when they are vocab-sharded."""
        if self.vocab_sharded_logits:
            return vocab_parallel_cross_entropy(logits, targets, self.comm, self.axis, ignore_index, reduction)
        return cross_entropy(logits, targets, ignore_index, reduction)

    def global_shape(self, name: str, local_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global shape, offset of this rank's shard) of parameter `name`, for layout-free checkpoints."""
        shape, offset = list(local_shape), [0] * len(local_shape)
        if name in self.sharded:
            dim = self.sharded[name]
            offset[dim] = self.comm.mesh.coord(self.axis) * shape[dim]
            shape[dim] *= self.comm.mesh.size(self.axis)
        return tuple(shape), tuple(offset)

    def local_init(self, init, name: str, local_shape) -> torch.Tensor:
        """`init(name, global shape)` of a parameter held with `local_shape`: this tp rank's slice of it."""
        shape, offset = self.global_shape(name, local_shape)
        full = init(name, shape)
        return full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]

    def gather(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The full tensor of parameter `name` from this rank's `value` (collective over tp when sharded)."""
        return gather_full(value, self.sharded.get(name), self.comm, self.axis)

    @torch.no_grad()
    def all_reduce_sequence_partial_grads(self, model: nn.Module) -> None:
        """One flat tp all-reduce of the `sequence_partial` grads (for `sp_grad_hooks=False`), after backward."""
        grads = [model.get_parameter(n).grad for n in self.sequence_partial]
        self.comm.all_reduce_coalesced([g for g in grads if g is not None], self.axis)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


# -- whole-model norms and gathering ---------------------------------------------------------

def tp_norm_sq(named_tensors: Iterable[tuple[str, torch.Tensor]], info: TensorParallelInfo) -> torch.Tensor:
    """Σ‖t‖² over the tp group: tp-sharded tensors summed over ranks, replicated ones counted once.

    Takes (parameter name, tensor) pairs, e.g. grads or a ZeRO engine's local shards of them;
    the result is then complete over tp and still partial over any other axis the tensors are
    split on (a ZeRO engine all-reduces it over dp next: the sum is linear).
    """
    sharded, replicated = tp_norm_sq_parts(named_tensors, info)
    info.comm.all_reduce(sharded, info.axis)
    return sharded + replicated


def tp_norm_sq_parts(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     info: TensorParallelInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (Σ‖t‖² of its tp-sharded tensors, Σ‖t‖² of its replicated ones), no communication."""
    split: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # is sharded → tensors
    for name, tensor in named_tensors:
        split[name in info.sharded].append(tensor)
    device = next((t.device for t in split[True] + split[False]), info.comm.mesh.device)
    sharded, replicated = (sum_of_squares(split[s], device) for s in (True, False))
    return sharded, replicated


def tp_grad_norm_sq(model: nn.Module, info: TensorParallelInfo) -> torch.Tensor:
    """Squared norm of the whole model's gradient (every parameter once), the same on every tp rank."""
    return tp_norm_sq(((n, p.grad) for n, p in model.named_parameters() if p.grad is not None), info)


@torch.no_grad()
def clip_grad_norm_tp_(model: nn.Module, info: TensorParallelInfo, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` for a tensor-parallel model: the same total norm and scale on every tp rank."""
    total = tp_grad_norm_sq(model, info).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(scale.to(param.grad.device, param.grad.dtype))
    return total


def full_parameters(model: nn.Module, info: TensorParallelInfo) -> dict[str, torch.Tensor]:
    """Every parameter at its full shape (sharded ones all-gathered over tp), by name."""
    return {name: info.gather(name, param) for name, param in model.named_parameters()}
