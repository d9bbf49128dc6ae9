"""Each rank's block of experts: every MoE layer keeps E/ep of its experts, under the same parameter names.

What `apply_expert_parallel` did is an `ExpertInfo`: which parameters are blocks of experts, the whole
shape and this rank's offset of each, the initializer of a block, and the gather of a whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import Axis
from paratrain.parallel.expert.dispatch import ExpertDispatch

AXIS = Axis.EP  # the ranks that split each layer's experts and send each other their tokens
REPLICATE_AXIS = Axis.EP_REPLICATE  # the ranks holding the same block: its gradients are reduced over them


@runtime_checkable
class MixtureOfExperts(Protocol):
    """A mixture-of-experts layer as expert parallelism reads it (the reference model's `MoE` is one).

    `experts` holds the E experts stacked in tensors `w1`, `w2`, `w3` (or those the layer names in
    `expert_tensors`: transformers' fused `gate_up_proj`, `down_proj`), the expert dimension first;
    `dispatch(x_AD, counts_E)` is the step from the assignments sorted by expert to the experts'
    outputs (`experts(rows, counts_E, counts)` computes them), which this strategy replaces; `aux_rows` and `reset_step_load` let a step average the
    auxiliary loss over its batch and count its load from nothing (`ParallelModel.train_step`).
    """

    num_experts: int
    experts: nn.Module
    aux_rows: int | None

    def dispatch(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor: ...

    def reset_step_load(self) -> None: ...


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers of `model` (`MixtureOfExperts`), in module order."""
    return [m for m in model.modules() if isinstance(m, MixtureOfExperts)]


@dataclass
class ExpertInfo:
    """What expert parallelism did to a model: which parameters are blocks of experts, and where each block sits."""

    comm: Comm
    ranks: int  # ep
    rank: int  # this rank's ep coordinate
    names: set[str] = field(default_factory=set)  # the expert tensors, [E/ep, ...] here

    def global_shape(self, name: str, local_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(whole shape, this rank's offset) of parameter `name` held with `local_shape`."""
        local_shape = tuple(local_shape)
        if name not in self.names:
            return local_shape, (0,) * len(local_shape)
        return (local_shape[0] * self.ranks, *local_shape[1:]), (local_shape[0] * self.rank,) + (0,) * (len(local_shape) - 1)

    def gather(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The whole tensor of `name` from this rank's block (collective over ep for an expert tensor)."""
        if name not in self.names:
            return value
        whole = value.new_empty(value.shape[0] * self.ranks, *value.shape[1:])
        self.comm.all_gather(whole, value.contiguous(), AXIS)
        return whole

    def local_init(self, init, name: str, shape) -> torch.Tensor:
        """`init(name, whole shape)` of a parameter held with `shape`: this rank's block of an expert tensor."""
        if name not in self.names:
            return init(name, shape)
        whole_shape, offset = self.global_shape(name, shape)
        return init(name, whole_shape)[offset[0]:offset[0] + shape[0]]


def apply_expert_parallel(model: nn.Module, comm: Comm) -> ExpertInfo:
    """Keep this rank's block of experts in every MoE layer of `model` and dispatch their tokens by all-to-all."""
    mesh = comm.mesh
    info = ExpertInfo(comm, mesh.size(AXIS), mesh.coord(AXIS))
    prefix = {id(m): name for name, m in model.named_modules()}
    for moe in moe_layers(model):
        local = moe.num_experts // info.ranks
        first = info.rank * local
        for tensor in getattr(moe, "expert_tensors", ("w1", "w2", "w3")):
            whole = getattr(moe.experts, tensor)
            block = torch.empty(local, *whole.shape[1:], dtype=whole.dtype, device="meta") if whole.is_meta else \
                whole.detach()[first:first + local].clone()
            setattr(moe.experts, tensor, nn.Parameter(block, requires_grad=whole.requires_grad))
            info.names.add(f"{prefix[id(moe)]}.experts.{tensor}")
        moe.dispatch = ExpertDispatch(moe.experts, comm, AXIS, moe.num_experts)
    return info


def whole_expert(info, whole_tp, name: str, value: torch.Tensor) -> torch.Tensor:
    """An expert tensor gathered over ep, any other as tensor parallelism makes it whole."""
    return info.gather(name, value) if name in info.names else whole_tp(name, value)
