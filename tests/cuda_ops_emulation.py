"""The CUDA attention ops the ring calls, emulated on the CPU with the memory layout their kernels use.

No CPU run executes a CUDA kernel, and the ops' meta functions check shapes, not the layouts a kernel
assumes. These emulations take the same arguments as `aten._scaled_dot_product_{efficient,flash}_attention`
and their backwards, check the contract the CUDA kernels rely on, and read their inputs the way those
kernels address memory:

- out is produced, and read back by the backward, at row stride H·E (a [B, S, H, E] buffer seen as
  [B, H, S, E]): the memory-efficient backward's `o_strideM()` is `head_dim_value * num_heads`, whatever
  strides the tensor it is handed has. Read through `as_strided`, a contiguous [B, H, S, E] out gives
  wrong values or, past the end of its storage, an error (on the GPU: an illegal memory access).
- the memory-efficient ops' lse is padded to a multiple of 32 rows, and its backward reads that layout;
  flash's is [B, H, Sq].
- dropout is 0, no bias, the forward asked for its lse.

The values come from the kernels' explicit math (`kernels.EXPLICIT`), so a ring run through the
emulations must equal whole causal attention exactly as with the CPU's own kernel.
"""

from __future__ import annotations

import torch

from paratrain.parallel.context import kernels

_ROWS = 32


def _forward_layout(out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _read_out(out: torch.Tensor) -> torch.Tensor:
    """out as the backward kernel reads it: batch and head strides from the tensor, row stride H·E."""
    b, h, s, e = out.shape
    assert out.stride(-1) == 1, "out's last dimension must be contiguous"
    return torch.as_strided(out, out.shape, (out.stride(0), out.stride(1), h * e, 1), out.storage_offset())


def efficient_forward(q, k, v, bias, compute_log_sumexp, dropout_p, is_causal, scale=None):
    assert bias is None and compute_log_sumexp and dropout_p == 0.0
    out, lse = kernels.EXPLICIT.forward(q, k, v, is_causal, scale)
    padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // _ROWS) * _ROWS), float("inf"), dtype=torch.float32)
    padded[..., : lse.shape[2]] = lse
    no_rng = torch.zeros((), dtype=torch.int64)
    return _forward_layout(out), padded, no_rng, no_rng


def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask, is_causal, scale=None):
    assert bias is None and dropout_p == 0.0 and list(grad_mask) == [True, True, True, False]
    b, h, sq, _ = q.shape
    assert lse.shape == (b, h, -(-sq // _ROWS) * _ROWS) and lse.is_contiguous(), "lse must be padded to 32 rows"
    assert seed.dtype == offset.dtype == torch.int64 and seed.dim() == offset.dim() == 0
    dq, dk, dv = kernels.EXPLICIT.backward(dout, q, k, v, _read_out(out), lse[..., :sq], is_causal, scale)
    return dq, dk, dv, None


def flash_forward(q, k, v, dropout_p, is_causal, return_debug_mask, scale=None):
    assert dropout_p == 0.0 and not return_debug_mask
    out, lse = kernels.EXPLICIT.forward(q, k, v, is_causal, scale)
    seed, offset = (torch.zeros(shape, dtype=dtype) for shape, dtype in kernels._flash_rng_layout())
    return _forward_layout(out), lse, None, None, q.shape[2], k.shape[2], seed, offset, torch.empty(0)


def flash_backward(dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, seed,
                   offset, scale=None):
    b, h, sq, _ = q.shape
    assert cum_seq_q is None and cum_seq_k is None and (max_q, max_k) == (sq, k.shape[2]) and dropout_p == 0.0
    assert lse.shape == (b, h, sq) and lse.is_contiguous()
    assert [(tuple(t.shape), t.dtype) for t in (seed, offset)] == list(kernels._flash_rng_layout())
    return kernels.EXPLICIT.backward(dout, q, k, v, _read_out(out), lse, is_causal, scale)


OPS = {"_scaled_dot_product_efficient_attention": efficient_forward,
       "_scaled_dot_product_efficient_attention_backward": efficient_backward,
       "_scaled_dot_product_flash_attention": flash_forward,
       "_scaled_dot_product_flash_attention_backward": flash_backward}


def install() -> None:
    """Route the kernels' CUDA op calls in this process to the emulations."""
    kernels._op = OPS.__getitem__
