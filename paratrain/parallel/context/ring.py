"""Ring attention: causal attention of this rank's queries over K/V blocks passed around the cp group.

Each of the cp ranks holds 2·c tokens of every sequence (`split`: chunks i and 2·cp−1−i) and
their queries, keys and values. Attention needs every key before each query, so the K/V blocks
travel around the ring: at step j rank i holds the block of rank (i − j) mod cp, computes its
queries against it (the causal mask read from the two blocks' positions in the whole sequence),
and merges the result into its running output with the log-sum-exp rule

    lse = log(e^lse₁ + e^lse₂),   out = out₁·e^(lse₁ − lse) + out₂·e^(lse₂ − lse),

which is exact: softmax over the union of two key sets from the softmaxes over each. The first
block is the rank's own, where every query sees at least itself, so the running lse is finite.

Communication (per attention call, B batch, Hk kv heads, E head size, 2·c local tokens, s bytes
per element of K/V, counted on the cp axis as sends):
- forward: cp − 1 sends of one K/V block, 2·B·Hk·2c·E·s bytes each; the next block's send and
  receive are posted before the current block is computed on, and waited for after it.
- backward: the K/V blocks travel the ring again (cp − 1 sends), and with each block the fp32
  sum of its dK/dV so far, which goes on to the next rank after this rank adds its part; after
  cp sends it is back with the block's owner, complete (cp sends of 2·B·Hk·2c·E·4 bytes).

GQA: query head h reads kv head h // (H / Hk) (Hugging Face's grouping and SDPA's enable_gqa), so
K/V travel with Hk heads, never repeated. The block math is explicit (scores, mask, logsumexp)
in at least fp32: correctness first; a fused kernel that returns the lse can replace
`_block_forward` without changing the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.comm import Comm
from paratrain.parallel.context.split import positions


@dataclass(frozen=True)
class Ring:
    """The cp group one attention call runs over: this rank's place in it and the whole sequence's length."""

    comm: Comm
    seq_len: int  # tokens of the whole sequence (2·cp chunks)
    axis: str = "cp"

    @property
    def size(self) -> int:
        return self.comm.mesh.size(self.axis)

    @property
    def rank(self) -> int:
        return self.comm.mesh.coord(self.axis)

    def positions(self, rank: int, device) -> torch.Tensor:
        """Positions in the whole sequence of the tokens that `rank` holds."""
        return positions(self.seq_len, self.size, rank, device)

    def pass_on(self, tensor: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Post the send of `tensor` to the next rank and the receive of the previous rank's: (works, buffer)."""
        incoming = torch.empty_like(tensor)
        works = self.comm.start_exchange([(tensor, (self.rank + 1) % self.size)],
                                         [(incoming, (self.rank - 1) % self.size)], self.axis)
        return works, incoming

    def wait(self, works: list) -> None:
        self.comm.wait(works, self.axis)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, 2c, E] over the whole sequence's K/V, of which k, v [B, Hk, 2c, E] are
    this rank's (H a multiple of Hk); the output is this rank's [B, H, 2c, E], as SDPA's would be."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, scale)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, E] → [B, Hk, H/Hk, S, E]: the query heads of each kv head side by side."""
    b, h, s, e = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, s, e)


def _scores(q5, k5, q_pos, k_pos, scale):
    scores = torch.matmul(q5, k5.transpose(-1, -2)) * scale  # [B, Hk, G, Sq, Sk]
    return scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))


def _block_forward(q5, kv, q_pos, k_pos, scale):
    """(out, lse) of the queries over one K/V block; lse is −inf (and out 0) where a query sees no key."""
    k5, v5 = (t.unsqueeze(2).to(q5.dtype) for t in kv)
    scores = _scores(q5, k5, q_pos, k_pos, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.matmul(probs, v5), lse


def _merge(out, lse, block_out, block_lse):
    """The log-sum-exp rule: the output over both key sets from each one's (`lse` finite)."""
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new


def _block_backward(q5, kv, q_pos, k_pos, scale, lse, dout5, delta):
    """(dQ, dK, dV) of one block from the final lse (FlashAttention's backward: P recomputed, not stored)."""
    k5, v5 = (t.unsqueeze(2).to(q5.dtype) for t in kv)
    probs = torch.exp(_scores(q5, k5, q_pos, k_pos, scale) - lse[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), dout5).sum(2)
    dscores = probs * (torch.matmul(dout5, v5.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(dscores, k5) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q5).sum(2) * scale
    return dq, torch.stack([dk, dv])


class _RingAttention(torch.autograd.Function):
    """Forward: K/V around the ring, outputs merged by lse. Backward: K/V around again, dK/dV behind them."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float):
        kv = torch.stack([k, v]).contiguous()  # one message per step
        q5 = _grouped(q, k.shape[1]).to(_compute_dtype(q.dtype))
        q_pos = ring.positions(ring.rank, q.device)
        out = lse = None
        for step in range(ring.size):
            works, incoming = ring.pass_on(kv) if step < ring.size - 1 else ([], None)
            source = (ring.rank - step) % ring.size
            block = _block_forward(q5, kv, q_pos, ring.positions(source, q.device), scale)
            out, lse = block if out is None else _merge(out, lse, *block)
            ring.wait(works)
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        q5 = _grouped(q, k.shape[1]).to(out.dtype)
        dout5 = _grouped(dout, k.shape[1]).to(out.dtype)
        delta = (dout5 * out).sum(-1)  # Σ_k P·dP per query: the softmax's backward term
        q_pos = ring.positions(ring.rank, q.device)
        dq = torch.zeros_like(q5)
        kv = torch.stack([k, v]).contiguous()
        dkv_works, dkv_in = [], None
        for step in range(ring.size):
            kv_works, kv_next = ring.pass_on(kv) if step < ring.size - 1 else ([], None)
            source = (ring.rank - step) % ring.size
            dq_block, dkv = _block_backward(q5, kv, q_pos, ring.positions(source, q.device), scale, lse, dout5, delta)
            dq += dq_block
            ring.wait(dkv_works)  # the previous holder's sum for this block
            dkv = dkv if dkv_in is None else dkv + dkv_in
            dkv_works, dkv_in = ring.pass_on(dkv.contiguous())  # on to the next holder; the last step: its owner
            ring.wait(kv_works)
            kv = kv_next
        ring.wait(dkv_works)
        return dq.reshape(q.shape).to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None
