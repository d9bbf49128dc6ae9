"""Attention of some queries over one K/V block for the ring: a fused kernel that returns the log-sum-exp.

The ring (`paratrain.parallel.context.ring`) merges per-block results with the log-sum-exp rule,
so a block's kernel must return (out, lse), and its backward must take the GLOBAL out and lse of
its queries (merged over every block): FlashAttention's backward recomputes the probabilities
from the lse it is given, so with the global one each block's (dq, dk, dv) are exact parts of
the whole gradient. Every kernel takes q [B, H, Sq, E] and k, v [B, H, Sk, E] with equal heads
(the ring expands GQA's kv heads first), contiguous, and `causal` (the top-left mask, used only
for the rank's own block, where Sq == Sk) or, from the kernels that take one (`masks`), `mask`: a
boolean [B or 1, H or 1, Sq, Sk], True where a query sees a key (a document mask's block); it
returns out in q's dtype and lse [B, H, Sq] in at least fp32 (a row the mask hides wholly: what
the op gives, which the ring replaces).

Which kernel runs is decided here once, by `attention_kernel(device type, dtype, head size)`:
- CPU, fp32/fp64/bf16/fp16: `aten._scaled_dot_product_flash_attention_for_cpu` and its backward.
- CUDA, bf16/fp16, head size a multiple of 8 up to 256: `aten._scaled_dot_product_flash_attention` and its
  backward (FlashAttention 2: the faster kernel on H100/H200, and torch's own context parallel's default).
- CUDA, fp32 (and bf16/fp16 heads flash does not take), head size a multiple of 8:
  `aten._scaled_dot_product_efficient_attention` (compute_log_sumexp) and its backward.
- anything else: explicit math (scores, mask, logsumexp) in at least fp32.
These are private aten ops, each behind one small function (STYLE 12); the explicit
math is their reference in tests. With a mask (`attention_kernel(..., masked=True)`): CPU flash (the
mask as an additive bias in q's dtype), else explicit math: the CUDA ops here take no mask (flash
none, memory-efficient a bias this module does not pass), so a masked block on CUDA materializes its
scores in fp32, [B, H, Sq, Sk] at a time.

The CUDA ops' contract, which no CPU run executes (tests/parallel/context/test_context_kernels.py emulates it):
- Both return out as a [B, H, S, E] view of a [B, S, H, E] buffer, and the memory-efficient
  backward reads `out` at that layout whatever strides it is handed (its row stride is H·E, fixed
  in the kernel): a contiguous [B, H, S, E] out makes it read past the end (CUDA's "illegal memory
  access"). Every backward here hands out in the forward's layout (`_as_forward_out`).
- The memory-efficient ops pad lse to a multiple of 32 query rows; its backward reads that padded
  layout. Flash's lse is [B, H, Sq], unpadded.
- Dropout is 0, so the philox seed and offset the backward takes are never read (the ops only
  read them when dropout_p > 0); the ring's backward runs from the merged out and lse, not from
  one block's forward, so there is no block forward whose seed it could hand on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

_LSE_ROWS = 32  # the efficient kernel's lse rows are padded to a multiple of this


@dataclass(frozen=True)
class BlockKernel:
    """A fused or explicit attention for one block: forward → (out, lse), backward from the global out and lse."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, k, v, causal, scale, mask=None)
    backward: Callable[..., tuple[torch.Tensor, ...]]  # (dout, q, k, v, out, lse, causal, scale, mask=None) → dq, dk, dv
    masks: bool = False  # whether it takes `mask`


def attention_kernel(device_type: str, dtype: torch.dtype, head_size: int, masked: bool = False) -> BlockKernel:
    """The one place the ring's block kernel is chosen (device, dtype, head size, whether its blocks are masked);
    explicit math where no fused op applies."""
    if device_type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return CPU_FLASH
    if masked:
        return EXPLICIT
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_size % 8 == 0 and head_size <= 256:
        return CUDA_FLASH
    if device_type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16) and head_size % 8 == 0:
        return CUDA_EFFICIENT
    return EXPLICIT


def _op(name: str):
    """The aten op `name` (one lookup, so a test can run the CUDA calls through emulations of the ops)."""
    return getattr(torch.ops.aten, name)


def _as_forward_out(out: torch.Tensor) -> torch.Tensor:
    """out [B, H, S, E] as the CUDA forwards return it, a view of a [B, S, H, E] buffer (copied only if not)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive bias the CPU op takes (0 where seen, -inf where hidden), in q's dtype."""
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf"))


def _cpu_forward(q, k, v, causal, scale, mask=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                      attn_mask=_bias(mask, q.dtype), scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale)


def _unread_philox(device) -> torch.Tensor:
    """The philox seed or offset the backwards take: unread at dropout 0 (see the module's docstring)."""
    return torch.zeros((), dtype=torch.int64, device=device)


def _efficient_forward(q, k, v, causal, scale):
    out, lse, _, _ = _op("_scaled_dot_product_efficient_attention")(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]  # drop the padding rows: the ring merges [B, H, Sq]


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    padded = F.pad(lse, (0, -q.shape[2] % _LSE_ROWS)).contiguous()  # the layout the forward returned
    dq, dk, dv, _ = _op("_scaled_dot_product_efficient_attention_backward")(
        dout, q, k, v, None, _as_forward_out(out), padded, _unread_philox(q.device), _unread_philox(q.device), 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _flash_forward(q, k, v, causal, scale):
    out, lse, *_ = _op("_scaled_dot_product_flash_attention")(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


@functools.cache
def _flash_rng_layout() -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """(shape, dtype) of the rng tensors the flash forward returns on this torch (an int64 seed and offset in
    some versions, a uint64 state in others), read once from the op's meta function."""
    q = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bfloat16)
    rng = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, False)[6:8]
    return tuple((tuple(t.shape), t.dtype) for t in rng)


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    seed, offset = (torch.zeros(shape, dtype=dtype, device=q.device) for shape, dtype in _flash_rng_layout())
    # Dense batches: no cumulative sequence lengths; the longest sequences are the blocks' own lengths.
    dq, dk, dv = _op("_scaled_dot_product_flash_attention_backward")(
        dout, q, k, v, _as_forward_out(out), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        seed, offset, scale=scale)
    return dq, dk, dv


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, causal, scale, mask=None):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q.shape[2], device=q.device)
        scores = scores.masked_fill(rows[:, None] < rows[None, :], float("-inf"))
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _explicit_forward(q, k, v, causal, scale, mask=None):
    """Scores materialized in at least fp32 (without a mask every query sees a key in the ring's calls, so lse is
    finite; a row a mask hides wholly has lse -inf and an undefined out, which the ring replaces)."""
    dtype = _compute_dtype(q.dtype)
    scores = _scores(q.to(dtype), k.to(dtype), causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.to(dtype)).to(q.dtype), lse


def _explicit_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    """FlashAttention's backward: P recomputed from the given lse, delta = Σ dout·out of the given out."""
    dtype = _compute_dtype(q.dtype)
    q, k, v, dout, out = (t.to(dtype) for t in (q, k, v, dout, out))
    probs = torch.exp(_scores(q, k, causal, scale, mask) - lse.to(dtype)[..., None])
    dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - (dout * out).sum(-1, keepdim=True))
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q) * scale
    return dq, dk, torch.matmul(probs.transpose(-1, -2), dout)


CPU_FLASH = BlockKernel("cpu flash", _cpu_forward, _cpu_backward, masks=True)
CUDA_EFFICIENT = BlockKernel("cuda efficient", _efficient_forward, _efficient_backward)
CUDA_FLASH = BlockKernel("cuda flash", _flash_forward, _flash_backward)
EXPLICIT = BlockKernel("explicit", _explicit_forward, _explicit_backward, masks=True)

