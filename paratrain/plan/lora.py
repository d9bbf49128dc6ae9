"""LoRA and QLoRA in the planner (`plan --lora RANK [--base-dtype bf16|nf4]`): what trains, what the frozen base
costs, and what its matmuls skip.

The run it models is `paratrain.parallel.lora`'s with its default targets: adapters A [r, in] and B [out, r] beside
every linear of every block (attention's q, k, v, o and the MLP's three; in a mixture of experts the router and the
shared expert's three, the routed experts being grouped tensors, not linears: frozen, in the compute dtype, never
targets), the rest of the model frozen.

- Model states. The adapters (r · (in + out) per linear) train as any parameters do (`model_state_bytes`: their
  masters, gradients and optimizer state, sharded by the ZeRO stage). The frozen base has no gradient, no master and
  no optimizer state: its target weights cost their stored bytes (the compute dtype's, bf16's 2, or NF4's
  `paratrain.parallel.rules.nf4_bytes_per_parameter`: about 0.52), the rest (embeddings, norms, head) the compute dtype's;
  ZeRO-3 shards all of it over its shard group, the other stages hold it whole. Tensor parallelism splits each
  target weight over tp and one adapter with it (B of a column-parallel linear, A of a row-parallel one: o and
  down), the other adapter whole on every tp rank (`paratrain.parallel.tensor.adapters`).
- Communication buffers under ZeRO-3: the gathered units at those stored bytes (an NF4 block gathers its 4-bit
  rows), the gradients in flight the adapters' alone.
- Activations: each adapted linear also keeps A's output (b · s · r) for B's backward; a frozen matmul keeps no
  input for a weight gradient, but A keeps that same input; a frozen norm's weight takes no gradient, so the
  normalized value it scales (p · h a token, `paratrain.plan.activations.block_bytes_as_run`) is not kept, in each
  block's two norms and the final one. An NF4 matmul decodes its weight for itself, forward and backward: one
  weight in the compute dtype and its int32 code indices (2 bytes a parameter) live meanwhile.
- Time: a frozen weight's backward computes the input gradient only (no weight gradient), the adapters' six small
  matmuls are added, and an NF4 weight is decoded twice a micro-batch (memory-bound).
"""

from __future__ import annotations

from paratrain.models.configs import ModelConfig
from paratrain.parallel.rules import (LORA_BASE_DTYPES, Recompute, lora_refusal, nf4_bytes_per_parameter,
                                      unsupported_with_lora)
from paratrain.plan import moe
from paratrain.plan.errors import PlanError
from paratrain.plan.model_states import (DTYPE_BYTES, ModelStates, block_param_count, layers_on_stage,
                                         model_state_bytes, stage_param_count)


def check_lora(rank: int | None, base_dtype: str | None, model: ModelConfig | None) -> None:
    """PlanError (one line) for LoRA options the planner cannot model."""
    if rank is None:
        if base_dtype is not None:
            raise PlanError(f"--base-dtype {base_dtype} without --lora RANK: the base is frozen only under LoRA; pass "
                            f"--lora RANK or drop --base-dtype")
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise PlanError(f"--lora must be a positive integer, got {rank!r}")
    if base_dtype not in (None, *LORA_BASE_DTYPES):
        raise PlanError(f"--base-dtype {base_dtype!r} is not one of: {', '.join(LORA_BASE_DTYPES)}")
    if model is None:
        raise PlanError("--lora needs the model's shape (--model or --n-layers/--dim/--n-heads), not --params")


def run_options(model: ModelConfig, rank: int | None, base_dtype: str | None, targets: str | None) -> dict:
    """A run's LoRA options (`--lora`, `--base-dtype`, `--lora-targets`) as `Workload` fields: the planner models
    every block linear adapted, so a run naming its targets is planned with that many adapters and its base in
    the compute dtype (no fewer bytes than the run holds)."""
    if not rank:
        return {}
    return {"lora": rank, "base_dtype": None if targets else (base_dtype or None)}


def lora_violation(workload, layout) -> str | None:
    """Why a layout cannot run `workload`'s LoRA (`paratrain.parallel.rules.unsupported_with_lora`), or None."""
    if not workload.lora:
        return None
    unsupported = unsupported_with_lora(ep=layout.ep, fp8=workload.fp8)
    return lora_refusal(unsupported) if unsupported else None


def target_shapes(model: ModelConfig) -> list[tuple[int, int, bool]]:
    """(in, out, row-parallel) of each linear of one block, the adapted ones: q, k, v, o, and the MLP's gate, up,
    down, or a mixture's router and shared expert's three; row-parallel: o and down split their input over tp."""
    h, q, kv = model.dim, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    attention = [(h, q, False), (h, kv, False), (h, kv, False), (q, h, True)]
    if not model.is_moe:
        f = model.ffn_dim
        return attention + [(h, f, False), (h, f, False), (f, h, True)]
    f = model.expert_hidden_dim
    return attention + [(h, model.n_experts, False)] + ([(h, f, False), (h, f, False), (f, h, True)]
                                                         if model.shared_expert else [])


def adapter_params(model: ModelConfig, rank: int, tp: int = 1) -> int:
    """Adapter parameters of one block on one tp rank: r · (in + out) per linear, tp splitting B's out of a
    column-parallel linear and A's in of a row-parallel one."""
    return rank * sum(i // tp + o if row else i + o // tp for i, o, row in target_shapes(model))


def target_params(model: ModelConfig, tp: int = 1) -> int:
    """Frozen base parameters of one block's adapted linears, on one tp rank."""
    return -(-sum(i * o for i, o, _ in target_shapes(model)) // tp)


def block_params(model: ModelConfig, tp: int = 1) -> int:
    """Parameters of one block on one tp rank, as `stage_param_count` splits them, the routed experts whole on
    every rank (LoRA runs without expert parallelism)."""
    norms, routed = 2 * model.dim, moe.routed_params_per_layer(model)
    return -(-(block_param_count(model) - norms) // tp) - -(-routed // tp) + routed + norms


def base_bytes(workload) -> float:
    """Bytes per parameter of an adapted linear's frozen weight as stored."""
    compute = DTYPE_BYTES[workload.precision]
    # fp8: one byte each, and one scale per output row (a few thousandths of a byte per element: not counted)
    return {None: compute, "bf16": 2, "nf4": nf4_bytes_per_parameter(compute), "fp8": 1}[workload.base_dtype]


def stage_states(workload, layout, stage: int) -> ModelStates:
    """Model states of one rank of `stage` under LoRA: the adapters', and the frozen base at its stored bytes."""
    model, lay = workload.model, layout
    layers = layers_on_stage(model.n_layers, lay.pp, stage)
    trained = model_state_bytes(layers * adapter_params(model, workload.lora, lay.tp), lay.shard_ranks, lay.zero,
                                workload.precision, workload.reduce_dtype, lay.offload)
    targets = layers * target_params(model, lay.tp)
    rest = _tables(model, lay.tp, lay.pp, stage) + layers * block_params(model, lay.tp) - targets
    frozen = (targets * base_bytes(workload) + rest * DTYPE_BYTES[workload.precision]) / \
        (lay.shard_ranks if lay.zero == 3 else 1)
    on_host = lay.offload == "params"  # ZeRO-3's shards kept on the host, the frozen ones with the rest
    return trained + ModelStates(0.0 if on_host else frozen, 0.0, 0.0, 0.0, host=frozen if on_host else 0.0)


def stage_adapters(workload, layout, stage: int) -> float:
    """Adapter parameters one rank of `stage` holds before ZeRO sharding: the ones that train."""
    return float(layers_on_stage(workload.model.n_layers, layout.pp, stage) * adapter_params(workload.model,
                                                                                               workload.lora, layout.tp))


def zero3_gathered_bytes(workload, layout, stage: int) -> float:
    """Bytes one rank of `stage` all-gathers per micro-batch under ZeRO-3: each block twice (forward, and again
    for its backward) at its stored bytes, the embedding and the head once (frozen, whole in the compute dtype:
    neither unit's backward gathers)."""
    model, compute, tp = workload.model, DTYPE_BYTES[workload.precision], layout.tp
    layers = layers_on_stage(model.n_layers, layout.pp, stage)
    block = target_params(model, tp) * base_bytes(workload) + (
        block_params(model, tp) - target_params(model, tp) + adapter_params(model, workload.lora, tp)) * compute
    return 2 * layers * block + _tables(model, tp, layout.pp, stage) * compute


def _tables(model: ModelConfig, tp: int, pp: int, stage: int) -> int:
    """Parameters of one tp rank of `stage` outside its blocks: the embedding, the final norm, the head."""
    return stage_param_count(model, tp, pp, stage) - layers_on_stage(model.n_layers, pp, stage) * (
        -(-(block_param_count(model) - 2 * model.dim) // tp) + 2 * model.dim)


def zero3_units(workload, tp: int = 1) -> tuple[float, float]:
    """(bytes of the largest unit gathered, bytes of one block unit's gradients) on one tp rank under ZeRO-3: a
    block holds its frozen targets, norms and adapters (in the compute dtype); the root unit the frozen rest."""
    model, compute = workload.model, DTYPE_BYTES[workload.precision]
    adapters = adapter_params(model, workload.lora, tp)
    block = target_params(model, tp) * base_bytes(workload) + (block_params(model, tp) - target_params(model, tp)
                                                                + adapters) * compute
    root = (model.num_params() - model.n_layers * block_param_count(model)) / tp * compute
    return max(block, root), adapters * DTYPE_BYTES[workload.reduce_dtype or workload.precision]


def activation_bytes_per_layer(workload, tokens: float, recompute: Recompute, compiled: bool,
                               sequence_split: int = 1) -> float:
    """What LoRA changes in one layer's activations as `recompute` keeps them: A's output of each adapted linear,
    kept for B's backward (a matmul's output: selective recomputation keeps it too; full keeps the layer's input
    alone; under tensor parallelism every rank's is [tokens, r], of the whole sequence), less, where an eager block
    keeps its norms' normalized values (no recomputation), those of the two frozen norms (no weight gradient reads
    them; 1/`sequence_split` of the tokens each under sequence parallelism)."""
    if recompute is Recompute.FULL:
        return 0.0
    p = DTYPE_BYTES[workload.precision]
    norms = 2 * workload.model.dim / sequence_split if recompute is Recompute.NONE and not compiled else 0
    return tokens * p * (len(target_shapes(workload.model)) * workload.lora - norms)


def final_norm_bytes(workload, tokens: float, sequence_split: int = 1) -> float:
    """What LoRA changes in the last stage's own activations: the frozen final norm's normalized value, not kept."""
    return -tokens * DTYPE_BYTES[workload.precision] * workload.model.dim / sequence_split


def decode_bytes(workload, tp: int = 1) -> float:
    """The transient of an adapted matmul whose weight is stored narrower than it computes: the largest weight
    (its tp rank's slice) decoded (NF4: with its int32 code indices) or cast to the compute dtype; 0 where it
    computes as stored."""
    compute = DTYPE_BYTES[workload.precision]
    largest = max(i * o for i, o, _ in target_shapes(workload.model)) / tp
    if workload.base_dtype == "nf4":
        return largest * (compute + 2)
    return largest * compute if base_bytes(workload) < compute else 0.0


def frozen_matmul_params(model: ModelConfig) -> int:
    """Parameters of the frozen matmuls a token passes whose weight gradient a LoRA step skips: every block linear,
    the routed experts it is sent to (top_k of them) and the head."""
    routed = model.top_k * moe.one_expert_params(model) if model.is_moe else 0
    return model.n_layers * (target_params(model) + routed) + model.vocab_size * model.dim


def flops_per_token(workload) -> float:
    """Training FLOPs per token under LoRA: the model's, less the frozen weights' gradients (2 per parameter), plus
    the adapters' forward and backward (6 per parameter)."""
    model = workload.model
    return (model.flops_per_token(workload.seq_len) - 2 * frozen_matmul_params(model)
            + 6 * model.n_layers * adapter_params(model, workload.lora))
