"""Activation bytes of one transformer layer and of the logits, per micro-batch and rank: the formulas
(Korthikanti et al. 2022, paratrain's selective policy, flash kernels, context parallelism's ring) that
`paratrain.plan.memory` sums over a stage's layers and micro-batches in flight.
"""

from __future__ import annotations

from paratrain.parallel.rules import Recompute
from paratrain.plan.model_states import DTYPE_BYTES
from paratrain.plan.ring import ring_attention_saved_bytes

LOGIT_BYTES = 4  # logits are materialized in fp32 for the softmax cross-entropy


def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: Recompute = Recompute.NONE,
                           precision: str = "bf16", *, kv_heads: int | None = None,
                           ffn_dim: int | None = None, cp: int = 1, flash: bool = False,
                           compiled: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch, per tp rank.

    Korthikanti et al. 2022, with s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp,
    16-bit activations and 1-byte dropout masks:

    - no parallelism (§4.1, eq. 1):       s·b·h·(34 + 5·a·s/h)
    - tensor parallel (§4.2.1, eq. 2):    s·b·h·(10 + 24/t + 5·a·s/(h·t))
    - tensor + sequence parallel (eq. 3): s·b·h/t·(34 + 5·a·s/h)
    - full recompute (§5):                only the layer input, 2·s·b·h (÷t with SP)

    The constants are those of a GPT block (4h MLP, multi-head attention, dropout); they are
    used for Llama-style blocks too. fp32 activations double every term (an approximation:
    the 1-byte masks do not double).

    With `flash` False this is the paper's runtime (Table 2): the scores materialized, and selective
    recompute Megatron's policy, which recomputes only attention's core and keeps the rest of
    the block: sbh·(10 + 24/t), or 34·sbh/t with sequence parallelism.

    With `flash`, selective recompute is what paratrain's policy keeps (`paratrain.parallel.recompute`), counted
    per element of the Llama block (kv = h·kv_heads/a, f = ffn_dim; default a GPT block as the
    planner models one, `gpt_model`: kv_heads = a, f = 8h/3), in the activation dtype:
    the block input s·b·h (÷t with SP); q and the attention output 2·s·b·h/t; k and v 2·s·b·kv/t;
    the two gated-MLP projections 2·s·b·f/t; the outputs of wo and w2, 2·s·b·h, partial sums before
    their reduction and so whole on every tp rank, with SP or not; and the attention kernel's fp32
    log-sum-exp, 4·b·a·s/t bytes. Korthikanti's selective (§5, eq. 6: his 34·s·b·h less the
    scores) keeps more: its norms' outputs, activation function's input and dropout masks, which
    this policy recomputes.

    flash: the attention kernel keeps no s×s scores (FlashAttention, SDPA's flash and memory-efficient
    kernels on a GPU, its fused flash kernel on the CPU), and the block is counted as paratrain's Llama
    block runs, not as Korthikanti's GPT block: without recomputation `block_bytes_as_run` (eager, or
    `compiled`: what inductor's partitioner saves); with selective recomputation under `compiled` one
    s·b·h activation less than eager (the partitioner drops an output of the policy's that backward
    does not read). Without flash, the 5·a·s/h term stands for the scores, softmax output and dropout
    mask that a kernel materializing them keeps (`_scores_bytes`).

    Context parallelism (cp > 1, `ring_attention_saved_bytes`): each rank holds s/cp tokens, so
    every term above is taken at s/cp, except the attention scores: paratrain's ring keeps none
    (it saves its output and log-sum-exp and recomputes the probabilities block by block in
    backward), so the 5·a·s/h term is replaced by what the ring saves beyond the block's
    tensors counted already. Everything is ∝ 1/cp; the K/V blocks the ring has in flight are one
    layer's working set (`ring_in_flight_bytes`), counted once per stage.
    """
    if cp > 1:
        return _context_parallel_layer_bytes(seq_len // cp, micro_batch, hidden, heads, tp, sequence_parallel,
                                             recompute, precision, kv_heads, ffn_dim)
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = float(s * b * h)
    f = ffn_dim if ffn_dim is not None else round(8 * h / 3)
    if flash and recompute is Recompute.NONE:
        return block_bytes_as_run(s * b, h, a, f, t, sequence_parallel, precision, compiled)
    scores = 5 * a * s / h  # attention scores, softmax output and its dropout mask
    if recompute is Recompute.SELECTIVE and not flash:
        # Megatron's selective policy (Korthikanti §5, Table 2): only attention's core (scores, softmax, dropout,
        # its product with V) is recomputed, so the scores term goes and the rest of the block stays.
        scores = 0.0
    elif recompute is Recompute.SELECTIVE:
        kv = h * (kv_heads or a) / a
        sharded = 2 * h + 2 * kv + 2 * f
        elements = s * b * (h / (t if sequence_parallel else 1) + sharded / t + 2 * h - (flash and compiled) * h)
        return elements * DTYPE_BYTES[precision] + 4.0 * b * a * s / t
    if recompute is Recompute.FULL:
        per_layer = 2 * sbh / (t if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = sbh / t * (34 + scores)
    else:
        per_layer = sbh * (10 + 24 / t + scores / t)
    return per_layer * DTYPE_BYTES[precision] / 2


NORM_STATS_BYTES = 4  # an RMSNorm's fp32 reciprocal root-mean-square, per token


def block_bytes_as_run(tokens: int, hidden: int, heads: int, ffn_dim: int, tp: int = 1,
                       sequence_parallel: bool = False, precision: str = "bf16", compiled: bool = False) -> float:
    """Bytes one Llama block (RMSNorm, attention by a flash kernel, SwiGLU) keeps for backward, per tp rank, as
    its kernels run: eager, each operator saving its own inputs, or `compiled`, inductor's partitioner saving
    what is cheapest to keep and recomputing element-wise results. p is the activation dtype's size; every
    count is per token and was measured on paratrain's block (`tests/parallel/test_recompute.py`, exactly):

    - each of the two norms, eager: its input cast to fp32 (4·h), the normalized value and its scaled output
      (p·h each, the latter the next matmul's input); compiled: its input and output only (2·p·h). Under
      sequence parallelism these are 1/t of the sequence, and the matmul's input is the all-gathered whole
      (p·h), which the matmul saves; plus its fp32 statistics (4 bytes, ÷t with SP);
    - attention: q, k and v at every query head (grouped k/v heads are repeated for the kernel) and the
      kernel's output, 4·p·h/t, and its fp32 log-sum-exp, 4·a/t;
    - the gated MLP: the gate and up projections, the activation and their product, 4·p·f/t eager; compiled
      recomputes the activation, 3·p·f/t.

    The block's input and the residual stream are not kept: an addition's backward reads nothing.
    """
    h, f, t, p = hidden, ffn_dim, tp, DTYPE_BYTES[precision]
    attention = 4 * p * h / t + 4 * heads / t
    mlp = (3 if compiled else 4) * p * f / t
    return float(tokens) * (2 * _norm_bytes(h, t, sequence_parallel, p, compiled) + attention + mlp)


def _norm_bytes(hidden: int, tp: int, sequence_parallel: bool, p: int, compiled: bool) -> float:
    """Per token, one RMSNorm and its output as the next matmul's input (`block_bytes_as_run`)."""
    own = (p if compiled else NORM_STATS_BYTES + p) * hidden  # compiled keeps the input; eager its fp32 copy
    if sequence_parallel:
        return own / tp + p * hidden + NORM_STATS_BYTES / tp  # the whole gathered input of the matmul
    return own + p * hidden + NORM_STATS_BYTES


def head_bytes_as_run(tokens: int, hidden: int, vocab_size: int, tp: int = 1, sequence_parallel: bool = False,
                      precision: str = "bf16") -> float:
    """What the last stage keeps beyond its blocks, per micro-batch: the final norm (eager: it is not in a block)
    and the loss's fp32 log-probabilities (`logits_bytes`). The 16-bit logits themselves are not kept."""
    norm = float(tokens) * _norm_bytes(hidden, tp, sequence_parallel, DTYPE_BYTES[precision], compiled=False)
    return norm + logits_bytes(tokens, 1, vocab_size, tp)


FUSED_LOSS_TOKEN_BYTES = 14  # per token, kept by the fused loss: its fp32 log-sum-exp, int64 target, two flags


def fused_head_bytes(tokens: int, hidden: int, tp: int = 1, sequence_parallel: bool = False,
                     precision: str = "bf16", norm: bool = True) -> float:
    """`head_bytes_as_run` with the loss fused into the head (`paratrain.parallel.loss`): the final norm (with `norm`)
    and what the loss keeps per token (`FUSED_LOSS_TOKEN_BYTES`), no logits. The head's input is the norm's output,
    counted with the norm, which the unfused head's matmul saves alike."""
    kept = float(tokens) * FUSED_LOSS_TOKEN_BYTES
    if norm:
        kept += float(tokens) * _norm_bytes(hidden, tp, sequence_parallel, DTYPE_BYTES[precision], compiled=False)
    return kept


def fused_loss_working_bytes(tokens: int, vocab_size: int, tp: int, chunk: int, precision: str = "bf16") -> float:
    """One chunk's logits, the most the fused loss holds at once (in forward or in backward): min(chunk, tokens)
    tokens × V/t, in the compute dtype as the matmul writes them and in fp32 beside them (one fp32 copy under
    fp32, which the softmax then works on in place)."""
    p = DTYPE_BYTES[precision]
    return float(min(chunk, tokens)) * vocab_size / tp * (LOGIT_BYTES + (p if p != LOGIT_BYTES else 0))


def loss_stage_bytes(tokens: int, hidden: int, vocab_size: int, tp: int, sequence_parallel: bool, precision: str,
                     as_run: bool, loss_chunk: int) -> tuple[float, float]:
    """What the last stage adds for its head and loss: (bytes kept per micro-batch in flight, the loss's transient,
    once a step). `as_run`: counted as paratrain's model runs (a flash kernel, no cp): the final norm too, and the
    unfused loss's fp32 log-probabilities with its backward's two buffers (`head_bytes_as_run`,
    `loss_backward_bytes`); else the fp32 logits alone. `loss_chunk` > 0: the fused loss (`fused_head_bytes`,
    `fused_loss_working_bytes`)."""
    if loss_chunk:
        return (fused_head_bytes(tokens, hidden, tp, sequence_parallel, precision, norm=as_run),
                fused_loss_working_bytes(tokens, vocab_size, tp, loss_chunk, precision))
    if as_run:
        return (head_bytes_as_run(tokens, hidden, vocab_size, tp, sequence_parallel, precision),
                loss_backward_bytes(tokens, vocab_size, tp))
    return logits_bytes(tokens, 1, vocab_size, tp), 0.0


def loss_backward_bytes(tokens: int, vocab_size: int, tp: int = 1) -> float:
    """The loss's backward at its peak, once per step whatever the micro-batches in flight: the gradient of the
    log-probabilities and that of the logits, both fp32, beside the saved log-probabilities."""
    return 2 * logits_bytes(tokens, 1, vocab_size, tp)


def _context_parallel_layer_bytes(local_tokens: int, micro_batch: int, hidden: int, heads: int, tp: int,
                                  sequence_parallel: bool, recompute: Recompute, precision: str,
                                  kv_heads: int | None, ffn_dim: int | None) -> float:
    """`layer_activation_bytes` of one cp rank's s/cp tokens: the formulas without scores, plus the ring's own."""
    no_scores = layer_activation_bytes(local_tokens, micro_batch, hidden, heads, tp, sequence_parallel, recompute,
                                       precision, kv_heads=kv_heads, ffn_dim=ffn_dim)
    if recompute is Recompute.FULL:
        return no_scores  # only the layer input is kept
    if recompute is Recompute.NONE:
        no_scores -= _scores_bytes(local_tokens, micro_batch, hidden, heads, tp, precision)
        return no_scores + ring_attention_saved_bytes(local_tokens, micro_batch, hidden, heads, tp, precision)
    # selective counts the attention kernel's fp32 lse already; the ring's is the same tensor
    return no_scores + ring_attention_saved_bytes(local_tokens, micro_batch, hidden, heads, tp, precision,
                                                  lse=False)


def _scores_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int, precision: str) -> float:
    """Korthikanti's materialized-attention term, 5·a·s/h of s·b·h per tp rank (with SP or not): what a kernel
    that keeps the scores in memory stores, and a flash kernel or paratrain's ring does not."""
    return 5 * heads * seq_len / hidden * float(seq_len * micro_batch * hidden) / tp * DTYPE_BYTES[precision] / 2


def logits_bytes(seq_len: int, micro_batch: int, vocab_size: int, tp: int = 1) -> float:
    """fp32 logits of one micro-batch on the last stage: b·s·V·4, ÷t with a vocab-parallel head."""
    return float(micro_batch * seq_len * vocab_size * LOGIT_BYTES) / tp
