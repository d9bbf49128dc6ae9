"""Attention of some queries over one K/V block for the ring: a fused kernel that returns the log-sum-exp.

The ring (`paratrain.parallel.context.ring`) merges per-block results with the log-sum-exp rule,
so a block's kernel must return (out, lse), and its backward must take the GLOBAL out and lse of
its queries (merged over every block): FlashAttention's backward recomputes the probabilities
from the lse it is given, so with the global one each block's (dq, dk, dv) are exact parts of
the whole gradient. Every kernel takes q [B, H, Sq, E] and k, v [B, H, Sk, E] with equal heads
(the ring expands GQA's kv heads first), contiguous, and `causal` (the top-left mask, used only
for the rank's own block, where Sq == Sk); it returns out in q's dtype and lse [B, H, Sq] in at
least fp32.

Which kernel runs is decided here once, by `attention_kernel(device type, dtype, head size)`:
- CPU, fp32/fp64/bf16/fp16: `aten._scaled_dot_product_flash_attention_for_cpu` and its backward.
- CUDA, fp32/bf16/fp16, head size a multiple of 8: `aten._scaled_dot_product_efficient_attention`
  (compute_log_sumexp) and its backward, as torch's own context parallel calls them. No GPU runs
  here: this path is checked only on meta tensors (the ops' shape functions).
- anything else: explicit math (scores, mask, logsumexp) in at least fp32.
These are private aten ops, each behind one small function (STYLE 12); the explicit
math is their reference in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

_LSE_ROWS = 32  # the efficient kernel's lse rows are padded to a multiple of this


@dataclass(frozen=True)
class BlockKernel:
    """A fused or explicit attention for one block: forward → (out, lse), backward from the global out and lse."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, k, v, causal, scale)
    backward: Callable[..., tuple[torch.Tensor, ...]]  # (dout, q, k, v, out, lse, causal, scale) → dq, dk, dv


def attention_kernel(device_type: str, dtype: torch.dtype, head_size: int) -> BlockKernel:
    """The one place the ring's block kernel is chosen (device, dtype, head size); explicit math where no fused op applies."""
    if device_type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return CPU_FLASH
    if device_type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16) and head_size % 8 == 0:
        return CUDA_EFFICIENT
    return EXPLICIT


def _cpu_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cuda_forward(q, k, v, causal, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                            scale=scale)
    return out, lse[..., : q.shape[2]]  # drop the padding rows: the ring merges [B, H, Sq]


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    padded = F.pad(lse, (0, -q.shape[2] % _LSE_ROWS)).contiguous()  # the layout the forward returned
    no_dropout = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed and offset, unread at p = 0
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, no_dropout, no_dropout, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, causal, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q.shape[2], device=q.device)
        scores = scores.masked_fill(rows[:, None] < rows[None, :], float("-inf"))
    return scores


def _explicit_forward(q, k, v, causal, scale):
    """Scores materialized in at least fp32 (every query sees a key in the ring's calls, so lse is finite)."""
    dtype = _compute_dtype(q.dtype)
    scores = _scores(q.to(dtype), k.to(dtype), causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.to(dtype)).to(q.dtype), lse


def _explicit_backward(dout, q, k, v, out, lse, causal, scale):
    """FlashAttention's backward: P recomputed from the given lse, delta = Σ dout·out of the given out."""
    dtype = _compute_dtype(q.dtype)
    q, k, v, dout, out = (t.to(dtype) for t in (q, k, v, dout, out))
    probs = torch.exp(_scores(q, k, causal, scale) - lse.to(dtype)[..., None])
    dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - (dout * out).sum(-1, keepdim=True))
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q) * scale
    return dq, dk, torch.matmul(probs.transpose(-1, -2), dout)


CPU_FLASH = BlockKernel("cpu flash", _cpu_forward, _cpu_backward)
CUDA_EFFICIENT = BlockKernel("cuda efficient", _cuda_forward, _cuda_backward)
EXPLICIT = BlockKernel("explicit", _explicit_forward, _explicit_backward)
