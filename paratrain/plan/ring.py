"""What paratrain's ring attention adds to a rank's memory and sends under context parallelism.

The ring is `paratrain.parallel.context.ring`: each of the cp ranks holds s/cp tokens of every
sequence; K/V blocks travel around the cp group, and in backward the fp32 dK/dV sums follow
them. Arithmetic on the model's shape and one rank's s/cp tokens ("local tokens"), per tp rank;
`paratrain.plan.memory` and `paratrain.plan.collectives` count the rest of a layout.
"""

from __future__ import annotations

from paratrain.models.configs import ModelConfig
from paratrain.plan.model_states import DTYPE_BYTES

RING_SCORE_BLOCKS = 3  # fp32 score-sized tensors alive at once in the explicit fallback's backward: P, dP, dS


def ring_attention_saved_bytes(local_tokens: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               precision: str = "bf16", lse: bool = True) -> float:
    """What paratrain's ring attention saves for backward beyond q, k, v and the attention output.

    It computes in at least fp32 (`paratrain.parallel.context.ring`) and saves its output in that dtype:
    under 16-bit precision a fp32 copy of the attention output, 4·b·(s/cp)·h/t bytes (in fp32 it is
    the output itself, counted already); and the fp32 log-sum-exp, 4·b·a·(s/cp)/t bytes.
    """
    out = 4.0 * micro_batch * local_tokens * hidden / tp if DTYPE_BYTES[precision] < 4 else 0.0
    return out + (4.0 * micro_batch * heads * local_tokens / tp if lse else 0.0)


def ring_kv_block_bytes(model: ModelConfig, micro_batch: int, local_tokens: int, tp: int, itemsize: int) -> float:
    """One K/V block of the ring, 2·b·Hk·(s/cp)·E·bytes per tp rank (the kv heads split over tp): what each
    step sends (`paratrain.parallel.context.ring`: 2·B·Hk·2c·E·s, with 2c = s/cp)."""
    return 2.0 * micro_batch * local_tokens * model.n_kv_heads * model.head_dim / tp * itemsize


def ring_in_flight_bytes(model: ModelConfig, micro_batch: int, local_tokens: int, tp: int, itemsize: int,
                         flash: bool = True) -> float:
    """The ring's working set during one layer's attention, transient (one layer at a time).

    Two K/V blocks (the one computed on and the one arriving) and, in backward, two fp32 dK/dV
    sums (the one leaving and the one arriving); and what the block's kernel call needs beyond
    them (`paratrain.parallel.context.kernels`). A fused kernel (flash: the GPU's flash or memory-efficient
    kernel, the CPU's flash kernel) keeps no scores; under GQA the block it computes on is
    expanded to the a query heads for the call and its dK/dV come back so before they are summed
    per kv head: 2 such blocks, 2·b·(a/t)·(s/cp)·E·bytes each. The explicit fallback (flash False)
    materializes `RING_SCORE_BLOCKS` tensors of b·(a/t)·(s/cp)² fp32 scores at once instead.
    """
    kv = ring_kv_block_bytes(model, micro_batch, local_tokens, tp, itemsize)
    dkv = ring_kv_block_bytes(model, micro_batch, local_tokens, tp, 4)
    if flash:
        expanded = 0.0 if model.n_heads == model.n_kv_heads else kv * model.n_heads / model.n_kv_heads
        return 2 * kv + 2 * dkv + 2 * expanded
    scores = RING_SCORE_BLOCKS * 4.0 * micro_batch * model.n_heads / tp * local_tokens * local_tokens
    return 2 * kv + 2 * dkv + scores
