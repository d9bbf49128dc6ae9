"""transformers' fused experts routed as a mixture paratrain's expert parallelism splits (`--ep`).

transformers 5 holds a mixture's experts fused: one module `experts` with `gate_up_proj` [E, 2F, D] and
`down_proj` [E, D, F], called by its layer (Qwen3-MoE's `…SparseMoeBlock`) with each token's top-k experts
and weights from the layer's router `gate`. `route_experts` makes each such layer a
`paratrain.parallel.expert.MixtureOfExperts` in place, its modules and parameter names untouched:

- the layer's forward routes as transformers' does (the router's top-k experts and weights), sorts the
  (token, expert) assignments by expert, hands them to `dispatch(rows, counts_E)` and sums each token's
  weighted outputs, adding them in expert order as transformers' loop does;
- the experts' forward computes rows sorted by expert, contiguous per expert ([gate | up] = x Wᵀ, act(gate) ·
  up, then the down projection, as transformers computes each expert);
- `dispatch` runs every expert here; expert parallelism replaces it with the all-to-all to the rank holding
  each expert's block (`paratrain.parallel.expert.dispatch`), and keeps only that block of `expert_tensors`.

A layer of another form (no router `gate`, experts not fused in those two tensors) is none of these: the
trainer refuses --ep for a model with none in one line.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def fused_moe_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture layers of `model` whose experts are fused as `EXPERT_TENSORS` (3-D, experts first) beside a
    router `gate`, in module order."""
    out = []
    for module in model.modules():
        experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
        if isinstance(experts, nn.Module) and isinstance(gate, nn.Module) and all(
                isinstance(getattr(experts, t, None), nn.Parameter) and getattr(experts, t).dim() == 3
                for t in EXPERT_TENSORS) and isinstance(getattr(experts, "num_experts", None), int):
            out.append(module)
    return out


def route_experts(model: nn.Module) -> int:
    """Each fused mixture layer of `model` made a `MixtureOfExperts` in place (see the module); how many."""
    layers = fused_moe_layers(model)
    for layer in layers:
        layer.num_experts = layer.experts.num_experts
        layer.expert_tensors = EXPERT_TENSORS
        layer.aux_rows = None  # transformers' auxiliary loss is not trained (the logits alone)
        layer.reset_step_load = _nothing
        layer.dispatch = functools.partial(_every_expert_here, layer)  # (a function: no second name of the module)
        layer.forward = functools.partial(_routed, layer)
        layer.experts.forward = functools.partial(_grouped, layer.experts)
    return len(layers)


def _nothing() -> None:
    return None


def _every_expert_here(layer: nn.Module, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return layer.experts(x_AD, counts_E)


def _routed(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The mixture layer's forward: the router's top-k, the assignments sorted by expert through `dispatch`, each
    token's outputs weighted and summed."""
    shape = hidden.shape
    x_TD = hidden.reshape(-1, shape[-1])
    _, weights_TK, experts_TK = layer.gate(x_TD)
    flat = experts_TK.flatten()
    order = torch.argsort(flat, stable=True)  # expert-major, tokens in order within an expert
    token_A = order // experts_TK.shape[1]
    counts_E = torch.bincount(flat, minlength=layer.num_experts)
    y_AD = layer.dispatch(x_TD[token_A], counts_E)
    weighted = y_AD * weights_TK.flatten()[order, None]
    return torch.zeros_like(x_TD).index_add_(0, token_A, weighted.to(x_TD.dtype)).reshape(shape)


def _grouped(experts: nn.Module, x_AD: torch.Tensor, counts_E: torch.Tensor,
             counts: list[int] | None = None) -> torch.Tensor:
    """Rows sorted by expert, `counts_E` for each expert this module holds, through their experts."""
    counts = counts if counts is not None else counts_E.tolist()
    out = []
    for e, x in enumerate(x_AD.split(counts)):
        gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        out.append(F.linear(experts.act_fn(gate) * up, experts.down_proj[e]))
    return torch.cat(out) if out else x_AD[:0]
