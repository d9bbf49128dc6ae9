"""Muon in the planner: its state (one momentum buffer), its Newton–Schulz FLOPs and what its step sends.

`paratrain.parallel.muon` steps the 2-D weights of the blocks with Muon (each expert's matrix of an MoE
layer too) and the rest with AdamW. Per matrix element Muon keeps one fp32 momentum buffer (4 bytes, where
Adam keeps 8), and each matrix's Newton–Schulz iteration (5 steps of X Xᵀ, a Gram polynomial and its
product with X: 4m²n + 2m³ FLOPs per step for m ≤ n) runs once per step on one of the ranks sharing it, so
a rank's share is the stage's total over its data × tp ranks. The exchange that brings each matrix to its
owner and the result back sends bf16 pieces over the data axis (`muon_sent_bytes`).

Offloaded (`--offload`), the momentum lives on the host beside the masters with a bf16 staging buffer for the
update (`paratrain.plan.model_states.model_state_bytes`: 14 bytes per element there, AdamW's 16), the host steps
the momentum and applies the orthogonalized update (`MUON_HOST_BYTES`), the update crosses the host link out and
back in bf16, and the iteration stays on the device (`paratrain.plan.compute.offload_seconds`).
"""

from __future__ import annotations

from paratrain.models.configs import ModelConfig
from paratrain.plan import moe
from paratrain.plan.model_states import MUON_UPDATE_BYTES as UPDATE_BYTES, layers_on_stage
from paratrain.parallel.rules import MUON_NS_STEPS as NS_STEPS, newton_schulz_flops
# Host bytes per element of Muon's offloaded step, pass by pass (`paratrain.parallel.muon.Muon._muon_step`): the
# momentum's lerp (gradient and momentum read, momentum written: 12), the Nesterov lerp into a temporary (12), its
# rounding into the bf16 staging buffer (6), the weight decay (master read and written: 8) and the update's
# application (master and bf16 update read, master written: 10).
MUON_HOST_BYTES = 12 + 12 + 6 + 8 + 10


def check_optimizer(optimizer: str, model: ModelConfig | None) -> None:
    """--optimizer: adamw or muon; Muon needs the model's shape (which of its weights are matrices)."""
    from paratrain.plan.errors import PlanError

    if optimizer not in ("adamw", "muon"):
        raise PlanError(f"--optimizer must be adamw or muon, got {optimizer!r}")
    if optimizer == "muon" and model is None:
        raise PlanError("--optimizer muon needs the model's shape (which weights are matrices): give --model or "
                        "sizes, not --params")


def block_matrices(model: ModelConfig) -> list[tuple[int, int, int]]:
    """(rows, cols, count) of the 2-D weights Muon steps in one block of `model` (stacked experts one each)."""
    hd, d = model.head_dim, model.dim
    out = [(model.n_heads * hd, d, 2), (model.n_kv_heads * hd, d, 2)]  # wq and wo (transposed: same work), wk, wv
    if not model.is_moe:
        return out + [(model.ffn_dim, d, 3)]
    out.append((model.n_experts, d, 1))  # the router
    experts = model.n_experts + (1 if model.shared_expert else 0)
    return out + [(model.expert_hidden_dim, d, 3 * experts)]


def block_muon_params(model: ModelConfig) -> int:
    """Elements of one block that Muon steps."""
    return sum(r * c * n for r, c, n in block_matrices(model))


def block_ns_flops(model: ModelConfig, steps: int = NS_STEPS) -> int:
    """Newton–Schulz FLOPs of one block's matrices in one optimizer step (all of them, on whichever ranks)."""
    return sum(n * newton_schulz_flops((r, c), steps) for r, c, n in block_matrices(model))


def muon_sent_bytes(elements: float, ranks: int, zero: int) -> float:
    """Bytes one rank sends on average over the data axis in one Muon step for `elements` elements of matrices
    (this rank's tp slice of the stage's matrices, whole without ZeRO, else its 1/N rows of them), the owners spread
    evenly. Without ZeRO each rank owns 1/N of the matrices and sends each to the N − 1 others: 2·E·(N−1)/N bytes.
    Under ZeRO a rank sends its rows of the (N−1)/N matrices others own, E/N·(N−1)/N, and the owner of a matrix
    sends each of the N − 1 others its rows back, the same again: 2·2·(E/N)·(N−1)/N bytes."""
    if ranks == 1:
        return 0.0
    if zero >= 1:
        return 2 * UPDATE_BYTES * elements * (ranks - 1) / ranks ** 2
    return UPDATE_BYTES * elements * (ranks - 1) / ranks


def stage_muon_params(workload, layout, stage: int, experts: float) -> float:
    """Elements one rank of `stage` holds of the matrices Muon steps (its tp slices, and the `experts` routed
    elements it holds: every one a matrix's); 0 with AdamW."""
    if workload.optimizer != "muon":
        return 0.0
    model = workload.model
    layers = layers_on_stage(model.n_layers, layout.pp, stage)
    routed = moe.routed_params_per_layer(model) if model.is_moe else 0
    dense = -(-(block_muon_params(model) - routed) // layout.tp)
    return float(layers * dense + experts)
