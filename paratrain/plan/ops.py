"""The work of one micro-batch on one rank, operation by operation, and its time on a `Hardware`.

A transformer block (Llama-style: RMSNorm, rotary q/k, grouped-query attention, SwiGLU) on one
tensor-parallel rank, for b sequences of s tokens (T = b·s), with t = tp:

    matmuls (forward)      wq (T, H·E/t, h)   wk, wv (T, K·E/t, h)   wo (T, h, H·E/t)
                           w1, w3 (T, f/t, h)  w2 (T, h, f/t)        (m, n, k): [m, k] @ [k, n]
    attention core         per sequence and local head: QKᵀ (s, s, E) and PV (s, E, s)
    memory-bound           norms, rotary, residual adds, SiLU·gate, softmax (when not fused
                           into a flash kernel), the embedding, the cross-entropy

Backward runs two matmuls for each forward one (the input gradient (m, k, n) and the weight
gradient (k, n, m)), the attention core's backward four matmuls of the forward's shapes (five
for a flash kernel, which recomputes the scores), and the element-wise backward moves about
twice the forward's bytes. A flash kernel also reads and writes its operands once per pass
(forward: q, k, v in, the output out; backward: those and the output's gradient in, three
gradients out) and pays `Hardware.attention_overhead_s` per pass. Full recomputation runs the
forward again; selective recomputation, with a flash kernel, paratrain's policy (the element-wise
parts; matmul and attention outputs are kept), with materialized scores Megatron's (the attention
core and its softmax). A causal flash
kernel skips the masked half of the scores; a kernel that materializes them (Megatron's fused
softmax) computes all of them.

The element-wise parts depend on the software stack (`KernelStack`, the run's `Layout.compile`).
Per token, with h_r the residual width a rank holds (h, or h/t under sequence parallelism),
q = H·E/t, kv = K·E/t, f = ffn/t and S = (H/t)·s attention scores:

    FUSED  memory accesses (elements read or written): norms 2·2h_r, dropout + residual adds
           2·3h_r, rotary 2(q + kv), SwiGLU 3f, softmax + dropout 4.5·S (materialized scores
           only: a flash kernel keeps them on chip); backward twice the forward.
    EAGER  paratrain's reference model in eager PyTorch (`paratrain.models.llama`), one kernel
           per operator, counted by kind (`Elementwise`) from its code: RMSNorm (square, mean,
           two products), rotary (negate, concatenate, two products, a sum), the grouped-query
           expansion of k and v, the attention output's re-layout, SiLU and the gate, residual
           adds; backward the autograd of each (see `_EAGER_FORWARD`, `_EAGER_BACKWARD`). A
           calibrated profile measures each kind's throughput; each operator also pays the
           dispatch cost `Hardware.op_overhead_s`.

Element sizes follow the compute dtype (mixed-precision casts of the norms are left out).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models.configs import ModelConfig
from paratrain.plan.hardware import Elementwise, Hardware, KernelStack
from paratrain.plan import moe
from paratrain.parallel.rules import Recompute
from paratrain.plan.model_states import DTYPE_BYTES

BACKWARD_MEMORY_FACTOR = 2.0  # element-wise backward reads the saved input and the gradient, writes one
# Rowwise FP8 matmuls' rate relative to tensorwise: 1,350-1,376 against 1,438-1,501 TFLOP/s on an H200 at
# llama2-7b's shapes (benchmarks/results/H200-2026-11-27.md §4).
ROWWISE_FP8_RATE = 0.93
FLASH_BACKWARD_MATMULS = 5  # dQ, dK, dV, dP and the recomputed scores (Dao 2023, FlashAttention-2 §3.1.2)
DENSE_BACKWARD_MATMULS = 4  # dQ, dK, dV, dP
# A flash kernel's operands per token, in units of (q + kv) widths: forward reads q, k, v and writes
# the output; backward reads those and the output's gradient and writes dq, dk, dv.
FLASH_ACCESSES = (2, 4)
_RING_ACCESSES = 0.75  # a ring call past the own block touches (q + kv + out) of 2c and c rows: 3/4 of the own call's
SOFTMAX_ACCESSES = 4.5  # scale + mask + softmax (read, write) and dropout (read, write, 1-byte mask)
# FUSED: accesses per token of the block's forward: (h_r, q + kv, f).
_FUSED_ACCESSES = (4 + 6, 2, 3)
# FUSED cross-entropy: softmax + loss in one read and write of the logits, its gradient in another.
_FUSED_CE_ACCESSES = 2.0

# EAGER: elements per token by kind, as (kind, {width: count}); widths h_r ("residual"), h
# ("hidden": a linear's input), q, kv, f. Counted from paratrain.models.llama's forward and the
# autograd of each operator.
_EAGER_FORWARD = (
    # norm products 2×2 and residual adds 2; rotary: 2 products and a sum; the gate
    (Elementwise.BINARY, {"residual": 6, "q": 3, "kv": 3, "f": 1}),
    # squares; rotary negate (half) + concatenate; k and v expanded to q heads; the output re-layout
    (Elementwise.UNARY, {"residual": 2, "q": 1.5 + 2 + 1, "kv": 1.5}),
    (Elementwise.REDUCE, {"residual": 2}),  # the norms' means
    (Elementwise.SILU, {"f": 1}),
)
_EAGER_BACKWARD = (
    # norms 2×8, residual gradients 2, linear input gradients summed, rotary, the gate's two
    (Elementwise.BINARY, {"residual": 18, "hidden": 3, "q": 3, "kv": 3, "f": 2}),
    # negate, concatenate, re-layout, the attention gradients' layouts
    (Elementwise.UNARY, {"q": 0.5 + 1 + 1 + 1, "kv": 0.5 + 1 + 2}),
    (Elementwise.REDUCE, {"residual": 4, "q": 2}),  # broadcast products' sums; the kv expansion summed back
    (Elementwise.SILU_BACKWARD, {"f": 1}),
)
EAGER_OPS_PER_BLOCK = (30, 50)  # operators in forward, autograd nodes in backward (views not counted)
EAGER_HEAD_OPS = (12, 12)  # final norm, head, cross-entropy (vocab-parallel: max, shift, exp, sum, divide)


@dataclass(frozen=True)
class Gemm:
    """`count` matmuls [m, k] @ [k, n]."""

    m: float
    n: float
    k: float
    count: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class Shape:
    """What one rank computes for one micro-batch: tokens, local widths, dtype, options."""

    tokens: float  # T = b·s
    seq_len: int
    batch: int
    hidden: int
    q_width: float  # H·E/t
    kv_width: float  # K·E/t
    ffn: float  # f/t
    local_heads: float  # H/t
    head_dim: int
    vocab: float  # V/t
    residual: float  # h_r
    dtype: str
    flash: bool
    kernels: KernelStack = KernelStack.EAGER
    # A MoE block (`paratrain.plan.moe`); zeros for a dense one, whose MLP is `ffn`.
    router: int = 0  # E: the router's outputs
    experts: float = 0.0  # E/ep: the experts on this rank
    expert_ffn: int = 0  # f of one expert
    routed: float = 0.0  # k·c·T: (token, expert) copies this rank's experts process (c: the assumed imbalance)
    shared_ffn: int = 0  # f of the shared expert, 0 without one
    ring_steps: int = 1  # cp: the attention core runs as this many kernel calls (paratrain's ring)
    fp8: str | None = None  # the FP8 recipe of the block's linears (`paratrain.parallel.fp8`), None: the dtype's
    fp8_min_features: int = 0  # linears with fewer whole-layer in or out features stay in the dtype (`fp8_gemms`)
    tp: int = 1  # the tensor-parallel degree the widths above are divided by
    lora: int = 0  # the rank of adapters on every block linear, whose frozen weight takes no gradient (0: none)
    nf4: bool = False  # under LoRA, the frozen weights stored in NF4: each decoded for its matmul, forward and backward

    @classmethod
    def of(cls, model: ModelConfig, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
           precision: str, flash: bool, kernels: KernelStack = KernelStack.EAGER, cp: int = 1, ep: int = 1,
           imbalance: float = moe.DEFAULT_IMBALANCE, fp8: str | None = None, fp8_min_features: int = 0) -> Shape:
        """Under context parallelism (cp > 1) the rank holds s/cp tokens of each sequence and its queries
        meet all s keys, block by block in paratrain's ring (`paratrain.parallel.context.ring`): one fused
        kernel call per block on its unmasked part, so a flash kernel's causal half, in cp calls.
        A mixture of experts (`paratrain.plan.moe`) adds its router and its routed copies' expert widths."""
        e, tokens = model.head_dim, float(micro_batch * (seq_len // cp))
        routing = {}
        if moe.is_moe(model):
            fe = model.expert_hidden_dim
            routed = moe.routed_tokens(tokens, model, imbalance)
            shared = fe if model.shared_expert else 0
            # the element-wise SwiGLU runs on every routed copy and on the shared expert: its width per token
            routing = dict(router=model.n_experts, experts=model.n_experts / ep, expert_ffn=fe, routed=routed,
                           shared_ffn=shared, ffn=routed / tokens * fe + shared)
        return cls(**{**dict(tokens=tokens, seq_len=seq_len, batch=micro_batch, hidden=model.dim,
                             q_width=model.n_heads * e / tp, kv_width=model.n_kv_heads * e / tp, ffn=model.ffn_dim / tp,
                             local_heads=model.n_heads / tp, head_dim=e, vocab=model.vocab_size / tp,
                             residual=model.dim / tp if sequence_parallel else float(model.dim), dtype=precision,
                             flash=flash, kernels=KernelStack(kernels), ring_steps=cp, fp8=fp8,
                             fp8_min_features=fp8_min_features, tp=tp), **routing})

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]


def block_gemms(x: Shape) -> list[Gemm]:
    """The forward matmuls of one block on one rank (shapes in the module docstring).

    A MoE block's MLP is the router (T, E, h), each of the rank's E/ep experts on its share of the
    k·c·T routed copies (grouped: w1 and w3 (k·c·T·ep/E, f, h), w2 (k·c·T·ep/E, h, f)), and the
    shared expert on all T tokens.
    """
    t, h = x.tokens, x.hidden
    attention = [Gemm(t, x.q_width, h), Gemm(t, x.kv_width, h, 2), Gemm(t, h, x.q_width)]
    if not x.experts:
        return attention + [Gemm(t, x.ffn, h, 2), Gemm(t, h, x.ffn)]
    rows = x.routed / x.experts
    mlp = [Gemm(t, x.router, h), Gemm(rows, x.expert_ffn, h, 2 * x.experts), Gemm(rows, h, x.expert_ffn, x.experts)]
    if x.shared_ffn:
        mlp += [Gemm(t, x.shared_ffn, h, 2), Gemm(t, h, x.shared_ffn)]
    return attention + mlp


def dispatch_elementwise_times(hw: Hardware, x: Shape) -> PassTimes:
    """A MoE block's token permutation: gathering the k·c·T routed copies (h each) and scattering them back
    (an index-add), forward; their two transposes and the weights' gradient backward."""
    if not x.experts:
        return PassTimes(0.0, 0.0)
    one = hw.elementwise_seconds(Elementwise.UNARY, x.routed * x.hidden, x.itemsize)
    return PassTimes(2 * one, BACKWARD_MEMORY_FACTOR * 2 * one)


def attention_gemms(x: Shape) -> list[Gemm]:
    """The attention core's forward matmuls: QKᵀ and PV for each sequence and local head (the rank's
    queries, all s of them or s/cp under context parallelism, against the whole sequence's keys)."""
    count, queries = x.batch * x.local_heads, x.tokens / x.batch
    return [Gemm(queries, x.seq_len, x.head_dim, count), Gemm(queries, x.head_dim, x.seq_len, count)]


def backward_gemms(gemm: Gemm, frozen: bool = False) -> list[Gemm]:
    """Input gradient [m, n] @ [n, k] and weight gradient [k, m] @ [m, n] of one forward matmul (a `frozen` weight:
    the input gradient alone)."""
    return [Gemm(gemm.m, gemm.k, gemm.n, gemm.count)] + ([] if frozen else [Gemm(gemm.k, gemm.n, gemm.m, gemm.count)])


def lora_gemms(x: Shape, gemms: list[Gemm]) -> list[Gemm]:
    """The adapters' forward matmuls beside each of a block's linears (`Shape.lora`): x · Aᵀ (T, r, in), then
    · Bᵀ (T, out, r)."""
    return [g for gemm in gemms for g in (Gemm(gemm.m, x.lora, gemm.k, gemm.count),
                                          Gemm(gemm.m, gemm.n, x.lora, gemm.count))]


def nf4_decode_seconds(hw: Hardware, x: Shape) -> float:
    """One decode of the block's NF4 weights (memory-bound): per parameter its half byte of codes read, an int32
    index written and read, the weight written, and scaled in place (read and written)."""
    weights = sum(g.k * g.n * g.count for g in block_gemms(x))
    return hw.memory_seconds(weights * (0.5 + 8 + 3 * x.itemsize))


def _widths(x: Shape) -> dict[str, float]:
    return {"residual": x.residual, "hidden": float(x.hidden), "q": x.q_width, "kv": x.kv_width, "f": x.ffn}


def _eager_seconds(hw: Hardware, x: Shape, inventory, ops: float) -> float:
    """Time of an EAGER inventory: each (kind, width) pass over T tokens, plus `ops` dispatches."""
    widths, total = _widths(x), ops * hw.op_overhead_s
    for kind, counts in inventory:
        for width, count in counts.items():
            elements = x.tokens * widths[width]
            total += count * hw.elementwise_seconds(kind, elements, x.itemsize)
    return total


def _fused_seconds(hw: Hardware, x: Shape, accesses_per_token: float) -> float:
    kernel_bytes = 3 * x.tokens * x.residual * x.itemsize  # one binary kernel on the residual stream
    return hw.memory_seconds(accesses_per_token * x.tokens * x.itemsize, kernel_bytes)


def _scores_seconds(hw: Hardware, x: Shape) -> float:
    """The materialized attention scores' softmax and dropout (nothing for a flash kernel)."""
    if x.flash:
        return 0.0
    return hw.memory_seconds(SOFTMAX_ACCESSES * x.local_heads * x.seq_len * x.tokens * x.itemsize)


def block_elementwise_times(hw: Hardware, x: Shape) -> PassTimes:
    """Forward and backward of one block's element-wise parts (module docstring)."""
    if x.kernels is KernelStack.FUSED:
        residual, qkv, ffn = _FUSED_ACCESSES
        forward = _fused_seconds(hw, x, residual * x.residual + qkv * (x.q_width + x.kv_width) + ffn * x.ffn)
        backward = BACKWARD_MEMORY_FACTOR * forward
    else:
        forward = _eager_seconds(hw, x, _EAGER_FORWARD, EAGER_OPS_PER_BLOCK[0])
        backward = _eager_seconds(hw, x, _EAGER_BACKWARD, EAGER_OPS_PER_BLOCK[1])
    scores = _scores_seconds(hw, x)
    return PassTimes(forward + scores, backward + BACKWARD_MEMORY_FACTOR * scores) + dispatch_elementwise_times(hw, x)


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one micro-batch on one rank: forward, backward (incl. recomputation)."""

    forward: float
    backward: float

    def __add__(self, other: PassTimes) -> PassTimes:
        return PassTimes(self.forward + other.forward, self.backward + other.backward)

    def scaled(self, factor: float) -> PassTimes:
        return PassTimes(self.forward * factor, self.backward * factor)


def _gemm_seconds(hw: Hardware, gemms: list[Gemm], dtype: str) -> float:
    return sum(hw.gemm_seconds(g.m, g.n, g.k, dtype, g.count) for g in gemms)


def attention_seconds(hw: Hardware, x: Shape, matmuls: float, backward: bool = False) -> float:
    """One pass of the attention core: `matmuls` matmuls of the forward's shapes (2 = the forward).

    A flash kernel adds its operands' bytes (`FLASH_ACCESSES`) and `Hardware.attention_overhead_s`.
    In paratrain's ring (`ring_steps` = cp > 1) the rank's s/cp queries meet the s keys in cp calls:
    the own block causal, (s/cp)²/2, and cp − 1 halves of a block, (s/cp)²/2 each, so s²/(2·cp) in
    all, the causal half of `attention_gemms` as in one kernel. Each call pays the overhead; the
    halved calls touch 3/4 of the own call's operands (q or the block halved, `_RING_ACCESSES`), and
    the forward merges each into the running fp32 output (`_ring_merge_seconds`).
    """
    causal = 0.5 if x.flash else 1.0  # a flash kernel skips the masked half; materialized scores do not
    per_matmul = _gemm_seconds(hw, attention_gemms(x), x.dtype) / 2
    seconds = causal * matmuls * per_matmul / hw.attention_efficiency
    if not x.flash:
        return seconds
    calls = 1 + _RING_ACCESSES * (x.ring_steps - 1)
    accesses = FLASH_ACCESSES[backward] * x.tokens * (x.q_width + x.kv_width) * calls
    return (seconds + hw.memory_seconds(accesses * x.itemsize) + x.ring_steps * hw.attention_overhead_s
            + _ring_merge_seconds(hw, x, backward))


def _ring_merge_seconds(hw: Hardware, x: Shape, backward: bool) -> float:
    """The ring's fp32 accumulation between calls: forward, the lse rule on out (read the running
    output and the block's, write the merged: 3 accesses of q width per merged query row); backward,
    dQ's sum (3 accesses). Halved calls merge on average 3/4 of the rows (all or half)."""
    if x.ring_steps == 1:
        return 0.0
    rows = _RING_ACCESSES * (x.ring_steps - 1) * x.tokens
    return hw.memory_seconds(3 * rows * x.q_width * 4)


def fp8_gemms(x: Shape) -> list[Gemm]:
    """The block's matmuls that run in FP8 under `x.fp8`: the attention projections and the dense (or shared
    expert's) MLP, the linears `paratrain.parallel.fp8` converts; a MoE's router and grouped experts stay, and so
    does a linear whose whole layer has fewer than `x.fp8_min_features` in or out features (the runtime's size
    filter, `paratrain.parallel.fp8.convertible`: on CUDA 1,024 by default)."""
    if not x.fp8:
        return []
    gemms = block_gemms(x)
    linears = gemms if not x.experts else gemms[:3] + gemms[6:]  # without the router and the two expert matmuls
    return [g for g in linears if _whole_features(x, g) >= x.fp8_min_features]


def _whole_features(x: Shape, gemm: Gemm) -> float:
    """The smaller of a block linear's whole in and out features: one of its matmul's n and k is the hidden width,
    never split; the other is the rank's 1/tp of the layer's (column- or row-parallel)."""
    other = gemm.k if gemm.n == x.hidden else gemm.n
    return min(x.hidden, other * x.tp)


def fp8_weight_params(x: Shape) -> float:
    """Parameters of one block on one rank held by its FP8 linears (the weights of `fp8_gemms`)."""
    return sum(g.n * g.k * g.count for g in fp8_gemms(x))


def fp8_times(hw: Hardware, x: Shape, gemms: list[Gemm]) -> tuple[PassTimes, PassTimes]:
    """(the FP8 linears' matmuls at the FP8 rate, their casts): each cast reads its 16-bit operand twice (amax,
    then the cast) and writes 1 byte per element. Forward casts x and W; backward the output gradient (rowwise:
    along both of its axes, and x and W again along the other axis)."""
    rate = 1.0 if x.fp8 == "tensorwise" else ROWWISE_FP8_RATE
    per_element = 2 * x.itemsize + 1
    forward_casts = sum(g.count * (g.m * g.k + g.n * g.k) for g in gemms)
    grads = sum(g.count * g.m * g.n for g in gemms)
    backward_casts = grads if x.fp8 == "tensorwise" else 2 * grads + forward_casts
    return (PassTimes(_gemm_seconds(hw, gemms, "fp8") / rate,
                      _gemm_seconds(hw, [b for g in gemms for b in backward_gemms(g)], "fp8") / rate),
            PassTimes(hw.memory_seconds(forward_casts * per_element), hw.memory_seconds(backward_casts * per_element)))


def block_times(hw: Hardware, x: Shape, recompute: Recompute) -> PassTimes:
    """One block's forward and backward (with recomputation) on one rank; under FP8 its linears at the FP8 rate."""
    low = fp8_gemms(x)
    gemms = [g for g in block_gemms(x) if g not in low]
    fp8_matmuls, casts = fp8_times(hw, x, low)
    # the casts are element-wise work: selective recomputation runs them again, as it runs the rest of it
    elementwise = block_elementwise_times(hw, x) + casts
    adapters = lora_gemms(x, gemms) if x.lora else []
    decode = nf4_decode_seconds(hw, x) if x.nf4 else 0.0
    forward = (_gemm_seconds(hw, gemms + adapters, x.dtype) + fp8_matmuls.forward + attention_seconds(hw, x, 2)
               + elementwise.forward + decode)
    backward = (_gemm_seconds(hw, [b for g in gemms for b in backward_gemms(g, frozen=bool(x.lora))]
                              + [b for g in adapters for b in backward_gemms(g)], x.dtype) + decode
                + fp8_matmuls.backward
                + attention_seconds(hw, x, FLASH_BACKWARD_MATMULS if x.flash else DENSE_BACKWARD_MATMULS, backward=True)
                + elementwise.backward)
    if recompute is Recompute.FULL:
        # paratrain's recompute is torch's non-reentrant checkpoint (eager) or the compiler's min-cut (compiled):
        # both stop once the backward's saved tensors are back, so the block's last linear (the MLP's w2, whose
        # input is what its backward keeps) and the residual add after it are not run again. Megatron's
        # reentrant recompute (the paper's runtime: materialized attention) runs the whole forward again.
        backward += forward - (_last_linear_seconds(hw, x, low) if x.flash and not x.experts else 0.0)
    elif recompute is Recompute.SELECTIVE and x.flash:
        # paratrain's policy (`paratrain.parallel.recompute`): matmul and attention outputs kept, the
        # element-wise rest (norms, rotary, activations, adds) run again; in eager that is most of a step's
        # extra time (H200, 1B: +0.033 s of 0.125), compiled it fuses into the backward's kernels
        backward += elementwise.forward
    elif recompute is Recompute.SELECTIVE:  # Megatron's, with materialized scores: the attention core again
        backward += attention_seconds(hw, x, 2) + _scores_seconds(hw, x)
    return PassTimes(forward, backward)


def _last_linear_seconds(hw: Hardware, x: Shape, fp8: list[Gemm]) -> float:
    """Forward seconds of a dense block's last matmul (`block_gemms`' last: the MLP's down projection), which a
    recompute that stops early skips: torch's matmul saves its inputs before it computes, and the recompute stops
    at the last save. An FP8 linear (an autograd function) saves after its matmul: nothing skipped there."""
    last = block_gemms(x)[-1]
    return 0.0 if last in fp8 else _gemm_seconds(hw, [last], x.dtype)


def _cross_entropy_seconds(hw: Hardware, x: Shape, vocab_parallel: bool) -> PassTimes:
    """The loss on T·V/t fp32 logits: FUSED one pass each way; EAGER by kind (module docstring)."""
    logits = x.tokens * x.vocab
    if x.kernels is KernelStack.FUSED:
        one = hw.memory_seconds(_FUSED_CE_ACCESSES * logits * 4, 3 * logits * 4)
        return PassTimes(one, one)
    # vocab-parallel: max and sum, shift and divide, exp; else one log-softmax
    passes = (((Elementwise.REDUCE, 2), (Elementwise.BINARY, 2), (Elementwise.SILU, 1)) if vocab_parallel
              else ((Elementwise.SOFTMAX, 1),))
    forward = sum(count * hw.elementwise_seconds(kind, logits, 4) for kind, count in passes)
    second = Elementwise.BINARY if vocab_parallel else Elementwise.SOFTMAX
    backward = hw.elementwise_seconds(Elementwise.BINARY, logits, 4) + hw.elementwise_seconds(second, logits, 4)
    return PassTimes(forward + EAGER_HEAD_OPS[0] * hw.op_overhead_s, backward + EAGER_HEAD_OPS[1] * hw.op_overhead_s)


def head_times(hw: Hardware, x: Shape, vocab_parallel: bool = False, fused: bool = False) -> PassTimes:
    """Final norm, output projection (T, V/t, h) and cross-entropy on the last stage; `fused` (the loss in chunks,
    `paratrain.parallel.loss`): the projection's forward once more in backward, which recomputes the logits."""
    head = Gemm(x.tokens, x.vocab, x.hidden)
    norm = (hw.memory_seconds(4 * x.tokens * x.residual * x.itemsize) if x.kernels is KernelStack.FUSED else
            _eager_seconds(hw, x, ((Elementwise.BINARY, {"residual": 2}), (Elementwise.UNARY, {"residual": 1}),
                                   (Elementwise.REDUCE, {"residual": 1})), 0))
    loss = _cross_entropy_seconds(hw, x, vocab_parallel)
    forward = hw.gemm_seconds(head.m, head.n, head.k, x.dtype) + norm + loss.forward
    backward = _gemm_seconds(hw, backward_gemms(head) + ([head] if fused else []), x.dtype) + 4 * norm + loss.backward
    return PassTimes(forward, backward)


def embedding_times(hw: Hardware, x: Shape) -> PassTimes:
    """The embedding lookup (a gather of T rows) and its backward (a scatter-add) on the first stage."""
    rows = x.tokens * x.hidden
    gather = hw.elementwise_seconds(Elementwise.UNARY, rows, x.itemsize)
    return PassTimes(gather, gather + hw.elementwise_seconds(Elementwise.BINARY, rows, x.itemsize))
