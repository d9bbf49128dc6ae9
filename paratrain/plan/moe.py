"""What a mixture of experts changes in the planner's arithmetic: parameters, expert state per rank, all-to-all.

A MoE block (`ModelConfig.n_experts` = E > 0) replaces the dense SwiGLU MLP with a router (h·E
parameters), E routed SwiGLU experts of 3·h·f parameters each (f = `expert_ffn_dim`, else
`ffn_dim`), of which each token uses k = `top_k`, and optionally one always-on shared expert
(3·h·f). With L layers:

    total parameters    N   = the model's `num_params()`  (every expert counted)
    active parameters   N_a = N − L·(E − k)·3·h·f         (what one token's arithmetic touches)

Model FLOPs use N_a (6·N_a·T + attention: `ModelConfig.flops_per_token`, `num_active_params`);
memory uses N.

Expert parallelism (`Layout.ep`, ep groups of neighbouring data ranks) puts E/ep experts on each
rank of an ep group. An expert's parameters are replicated over the dp/ep data ranks that hold
the same expert shard (its replica group), and ZeRO shards its parameters, gradients and optimizer
state within that group (`expert_shard_ranks`); the dense parameters (attention, norms, router,
embeddings, the shared expert) stay under the whole data axis. Experts are whole on every
tensor-parallel rank (tp splits attention, not the experts).

Routing is assumed uniform up to a load imbalance c (`Workload.moe_imbalance`, default
`DEFAULT_IMBALANCE`): the busiest expert rank receives c times the mean, k·c·T of a micro-batch's
T tokens. Each MoE layer of a micro-batch then runs four all-to-alls on each rank over ep
(dispatch and combine forward, their conjugates backward; two more forward with full
recomputation), each sending

    T·k·h·bytes·(ep − 1)/ep · c

(a rank's k·T routed copies of h activations, of which the 1/ep staying on the rank is not sent).
"""

from __future__ import annotations

from paratrain.models.configs import ModelConfig

# max / mean tokens per expert rank the planner assumes: measured routers (Switch, Mixtral with
# its load-balancing loss) stay within ~1.1-1.5 after the first steps; 1.25 is between them.
DEFAULT_IMBALANCE = 1.25
ALL_TO_ALLS_PER_LAYER = 4  # dispatch + combine forward; the same two, transposed, in backward
# The axis the experts' gradients are reduced over: the dp/ep data ranks holding the same experts.
EXPERT_DATA_AXIS = "ep_replicate"


def is_moe(model: ModelConfig | None) -> bool:
    """Whether `model` has MoE blocks (a dense model, or only a parameter count, has none)."""
    return model is not None and model.is_moe


def one_expert_params(model: ModelConfig) -> int:
    """3·h·f: w1 and w3 (f × h) and w2 (h × f) of one SwiGLU expert."""
    return 3 * model.dim * model.expert_hidden_dim


def routed_params_per_layer(model: ModelConfig) -> int:
    """E·3·h·f: the routed experts of one layer (what ep splits); 0 for a dense model."""
    return model.n_experts * one_expert_params(model) if is_moe(model) else 0


def inactive_params(model: ModelConfig) -> int:
    """L·(E − k)·3·h·f: the expert parameters one token does not touch (N − N_a, `ModelConfig.num_active_params`)."""
    return model.num_params() - model.num_active_params()


def expert_shard_ranks(shard_ranks: int, ep: int) -> int:
    """Ranks ZeRO shards one expert's state over: its replica group, the shard group's ranks / ep (at least 1)."""
    return max(1, shard_ranks // ep)


def routed_tokens(tokens: float, model: ModelConfig, imbalance: float) -> float:
    """(token, expert) copies the busiest rank's experts process for `tokens` tokens: k·c·T."""
    return tokens * model.top_k * imbalance


def all_to_all_bytes(tokens: float, model: ModelConfig, ep: int, itemsize: int, imbalance: float) -> float:
    """Bytes one rank sends in one all-to-all of a MoE layer: T·k·h·bytes·(ep − 1)/ep · c (0 without ep)."""
    if ep == 1 or not is_moe(model):
        return 0.0
    return routed_tokens(tokens, model, imbalance) * model.dim * itemsize * (ep - 1) / ep


def _mlp_elements(model: ModelConfig, tp: int, selective: bool, imbalance: float) -> tuple[float, float]:
    """(dense SwiGLU, MoE) elements one token keeps for backward in one layer's MLP, on a rank of tp.

    Without recomputation, a SwiGLU keeps its input h, w1's and w3's outputs and their gated
    product 3f, and its output h; selective recomputation keeps the matmul outputs, 2f + h. The MoE
    keeps that for each of its k·c routed copies (with the expert width, whole on every tp rank),
    for the shared expert once, and the router's logits and fp32 probabilities (2·E·4 bytes, E
    under selective recomputation, which recomputes the softmax).
    """
    f, fe, h, k = model.ffn_dim / tp, model.expert_hidden_dim, model.dim, model.top_k * imbalance
    if selective:
        dense, routed, shared, router = h + 2 * f, h + 2 * fe, h + 2 * fe, model.n_experts
    else:
        dense, routed, shared, router = 2 * h + 3 * f, 2 * h + 3 * fe, 3 * fe, 2 * model.n_experts * 2
    return dense, k * routed + (shared if model.shared_expert else 0) + router


def layer_activation_delta_bytes(model: ModelConfig, tokens: float, tp: int, selective: bool, full: bool,
                                 itemsize: int, imbalance: float) -> float:
    """Bytes a MoE layer keeps for backward beyond the dense SwiGLU that the dense formulas count, for `tokens`.

    (MoE elements − dense elements) per token (`_mlp_elements`) × T × bytes; 0 with full
    recomputation (only the layer's input is kept) and for a dense model. The router's fp32
    elements are counted as two of `itemsize` each (exact for 16-bit activations).
    """
    if not is_moe(model) or full:
        return 0.0
    dense, routed = _mlp_elements(model, tp, selective, imbalance)
    return (routed - dense) * tokens * itemsize
