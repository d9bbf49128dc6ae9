"""Expert parallelism: the experts of every MoE layer split over the ep ranks, tokens sent to them (all-to-all).

`apply_expert_parallel` gives each MoE layer (`paratrain.models.moe.MoE`) of a model this rank's
block of E/ep experts, under the same parameter names (w1 [E/ep, F, D]: the expert dimension is
the first, a shardable dimension like a tensor-parallel one), and replaces its dispatch step by
`ExpertDispatch` (`dispatch.py`). A model built on the meta device gets only its block: the
initializer it returns draws each expert tensor whole and keeps the block (as a tensor-parallel
slice is kept), so the values do not depend on the layout.

Gradients (`paratrain.parallel.data`): an expert's gradient on its rank already sums the
contributions of every token of the ep group routed to it (the all-to-all's backward brings them),
so expert tensors are reduced only over `ep_replicate`, the dp/ep data ranks that hold the same
block; every other parameter over the whole data axis. With the trainer's sum of the token
losses over the global token count both sums give one process's gradient; with a mean each
rank's loss is its own batch's mean and both are divided by dp (not by the ranks they are
reduced over: dp/ep ranks × ep groups of tokens = dp batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.parallel.expert.dispatch import ExpertDispatch

AXIS = "ep"
REPLICATE_AXIS = "ep_replicate"

__all__ = ["AXIS", "REPLICATE_AXIS", "ExpertDispatch", "ExpertInfo", "apply_expert_parallel", "moe_layers"]


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers of `model` (paratrain's `MoE`), in module order."""
    from paratrain.models.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


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
        for tensor in ("w1", "w2", "w3"):
            whole = getattr(moe.experts, tensor)
            block = torch.empty(local, *whole.shape[1:], device="meta") if whole.is_meta else \
                whole.detach()[first:first + local].clone()
            setattr(moe.experts, tensor, nn.Parameter(block, requires_grad=whole.requires_grad))
            info.names.add(f"{prefix[id(moe)]}.experts.{tensor}")
        moe.dispatch = ExpertDispatch(moe.experts, comm, AXIS, moe.num_experts)
    return info
