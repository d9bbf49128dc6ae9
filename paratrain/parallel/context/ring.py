"""Ring attention: causal attention of this rank's queries over K/V blocks passed around the cp group.

Each of the cp ranks holds 2·c tokens of every sequence (`split`: chunks i and 2·cp−1−i) and
their queries, keys and values. Attention needs every key before each query, so the K/V blocks
travel around the ring: at step j rank i holds the block of rank (i − j) mod cp and computes its
queries against the part of it they see (`Part`), and merges the result into its running output
with the log-sum-exp rule

    lse = log(e^lse₁ + e^lse₂),   out = out₁·e^(lse₁ − lse) + out₂·e^(lse₂ − lse),

which is exact: softmax over the union of two key sets from the softmaxes over each. In the
load-balanced layout half of every other rank's block is fully masked, so each step is one
kernel call on the unmasked half: the own block (step 0) one causal call over the 2c local
tokens; an earlier rank's block (j < i) all 2c queries against its first chunk's c keys, without
a mask; a later rank's (j > i) only the second local chunk's c queries against all 2c keys. The
own block comes first and every query sees itself there, so the running lse is finite.

Kernels (`kernels.attention_kernel`, chosen once by device, dtype and head size): fused
attention that returns the lse (CPU flash; CUDA flash in bf16/fp16, memory-efficient in fp32), explicit math elsewhere.
Merges accumulate out and lse in at least fp32; each block's backward is given the global out
and lse of its queries (FlashAttention's backward recomputes P from them), so the per-block
gradients add up to the exact ones.

Communication (per attention call, B batch, Hk kv heads, E head size, 2·c local tokens, s bytes
per element of K/V, counted on the cp axis as sends):
- forward: cp − 1 sends of one K/V block, 2·B·Hk·2c·E·s bytes each; the next block's send and
  receive are posted before the current block is computed on, and waited for after it.
- backward: the K/V blocks travel the ring again (cp − 1 sends), and with each block the sum of
  its dK/dV so far in at least fp32, which goes on to the next rank after this rank adds its part;
  after cp sends it is back with the block's owner, complete (cp sends of 2·B·Hk·2c·E·4 bytes).

A mask (a document mask: `paratrain.models.llama.document_layout`) comes over the whole sequence's
keys: [B or 1, 1, 2c, S], True where this rank's query sees a key, which must lie within the causal
mask (`RingSDPA` checks it). Each step's call reads its block of it (the rows it computes, the
columns of the travelling block's positions), so the parts skipped above stay skipped; a row the
block's mask hides wholly adds nothing (its lse -inf, its out 0), and the own block still shows
every query itself (a document holds its own tokens).

GQA: query head h reads kv head h // (H / Hk) (Hugging Face's grouping and SDPA's enable_gqa), so
K/V travel with Hk heads, never repeated. The fused ops want equal heads, so the block being
computed on is expanded to H heads for its call only (a transient H/Hk times the block), and its
dK/dV summed back over each group before they travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from paratrain.comm import Comm
from paratrain.mesh import Axis
from paratrain.parallel.context.kernels import BlockKernel, attention_kernel
from paratrain.parallel.context.split import positions


@dataclass(frozen=True)
class Ring:
    """The cp group one attention call runs over: this rank's place in it and the whole sequence's length."""

    comm: Comm
    seq_len: int  # tokens of the whole sequence (2·cp chunks)
    axis: Axis = Axis.CP

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
                   scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, 2c, E] over the whole sequence's K/V, of which k, v [B, Hk, 2c, E] are
    this rank's (H a multiple of Hk); the output is this rank's [B, H, 2c, E], as SDPA's would be. `mask`
    [B or 1, 1, 2c, S] (boolean, within the causal mask): which of the whole sequence's keys each query sees."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, scale, mask)


class Part(Enum):
    """Which part of a K/V block this rank's queries see (rank i holds chunks i and 2·cp−1−i, the block
    of rank j chunks j and 2·cp−1−j): the rest of the block is fully masked and never computed."""

    OWN = "own"        # j == i: causal attention over the local 2c tokens (local order is position order)
    EARLIER = "earlier"  # j < i: every local query sees chunk j wholly, chunk 2·cp−1−j not at all
    LATER = "later"    # j > i: only chunk 2·cp−1−i's queries see anything, and they see the whole block

    @staticmethod
    def of(rank: int, source: int) -> "Part":
        return Part.OWN if source == rank else Part.EARLIER if source < rank else Part.LATER

    def queries(self, c: int) -> slice:
        """The local query rows this block's call computes."""
        return slice(c, None) if self is Part.LATER else slice(None)

    def keys(self, c: int) -> slice:
        """The block's key rows that call reads."""
        return slice(None, c) if self is Part.EARLIER else slice(None)


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    return x if rows == slice(None) else x[:, :, rows].contiguous()


def _block_mask(mask: torch.Tensor | None, ring: Ring, source: int, rows: slice, keys: slice) -> torch.Tensor | None:
    """The part of `mask` (over the whole sequence's keys) that one call reads: its query `rows`, and the columns of
    the `keys` of the block `source` holds."""
    if mask is None:
        return None
    return mask[:, :, rows][..., ring.positions(source, mask.device)[keys]]


def _hidden_rows(block_out, block_lse, block_mask):
    """A block's (out, lse) with the rows its mask hides wholly set to what adds nothing: out 0, lse -inf."""
    if block_mask is None:
        return block_out, block_lse
    hidden = ~block_mask.any(-1)
    return block_out.masked_fill(hidden[..., None], 0), block_lse.masked_fill(hidden, float("-inf"))


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hk, S, E] → [B, H, S, E], kv head h // groups for query head h (the fused ops want equal heads)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_expand` for gradients: [B, H, S, E] summed over each kv head's group → [B, Hk, S, E]."""
    b, h, s, e = grad.shape
    return grad if groups == 1 else grad.view(b, h // groups, groups, s, e).sum(2)


def _merge(out, lse, block_out, block_lse):
    """The log-sum-exp rule in out's dtype (at least fp32): the output over both key sets from each one's."""
    block_out, block_lse = block_out.to(out.dtype), block_lse.to(lse.dtype)
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _RingAttention(torch.autograd.Function):
    """Forward: K/V around the ring, outputs merged by lse. Backward: K/V around again, dK/dV behind them."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, mask: torch.Tensor | None):
        kernel = attention_kernel(q.device.type, q.dtype, q.shape[-1], masked=mask is not None)
        kv = torch.stack([k, v]).contiguous()  # one message per step
        c, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        q = q.contiguous()
        out = lse = None
        for step in range(ring.size):
            works, incoming = ring.pass_on(kv) if step < ring.size - 1 else ([], None)
            source = (ring.rank - step) % ring.size
            part = Part.of(ring.rank, source)
            rows, keys = part.queries(c), part.keys(c)
            block_mask = _block_mask(mask, ring, source, rows, keys)  # within the causal mask: it alone
            block = kernel.forward(_rows(q, rows), *(_expand(_rows(t, keys), groups) for t in kv),
                                   part is Part.OWN and mask is None, scale, **_masked(block_mask))
            block = _hidden_rows(*block, block_mask)
            if out is None:  # step 0: the own block, where every query sees itself, so lse is finite
                # Copies, never the kernel's own outputs: the merges below write into them, and under selective
                # recomputation torch keeps the kernel's outputs to replay them (a mutated one is refused).
                out, lse = (t.to(_accumulator(q.dtype), copy=True) for t in block)
            else:
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], *block)
            ring.wait(works)
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.ring, ctx.scale, ctx.kernel = ring, scale, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        ring, scale, kernel = ctx.ring, ctx.scale, ctx.kernel
        c, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        dout, out_q = dout.contiguous().to(q.dtype), out.to(q.dtype)  # the kernels read them in q's dtype
        dq = torch.zeros_like(out)
        kv = torch.stack([k, v]).contiguous()
        dkv_works, dkv_in = [], None
        for step in range(ring.size):
            kv_works, kv_next = ring.pass_on(kv) if step < ring.size - 1 else ([], None)
            source = (ring.rank - step) % ring.size
            part = Part.of(ring.rank, source)
            rows, keys = part.queries(c), part.keys(c)
            block_mask = _block_mask(mask, ring, source, rows, keys)
            dq_block, dk, dv = kernel.backward(
                _rows(dout, rows), _rows(q, rows), *(_expand(_rows(t, keys), groups) for t in kv),
                _rows(out_q, rows), _rows(lse, rows), part is Part.OWN and mask is None, scale,
                **_masked(block_mask))
            dq[:, :, rows] += dq_block
            dkv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)
            dkv[0][:, :, keys], dkv[1][:, :, keys] = _fold(dk.to(out.dtype), groups), _fold(dv.to(out.dtype), groups)
            ring.wait(dkv_works)  # the previous holder's sum for this block
            dkv = dkv if dkv_in is None else dkv + dkv_in
            dkv_works, dkv_in = ring.pass_on(dkv)  # on to the next holder; the last step: its owner
            ring.wait(kv_works)
            kv = kv_next
        ring.wait(dkv_works)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None


def _masked(block_mask: torch.Tensor | None) -> dict:
    """The kernel's keyword for a block's mask: none without one (every kernel takes that)."""
    return {} if block_mask is None else {"mask": block_mask}


def blockwise_causal_attention(kernel: BlockKernel, q, k, v, dout, blocks: int) -> list[torch.Tensor]:
    """One causal attention computed in one process as the ring computes it, to check a block kernel on any
    device: each of `blocks` query blocks attends the key blocks it sees, merged by lse (the ring's rule), and
    each block's backward runs from the merged out (made contiguous, as the ring's row slices are) and lse.
    Returns [out, dq, dk, dv] over the whole sequence, in at least fp32."""
    n, scale = q.shape[2] // blocks, q.shape[-1] ** -0.5
    qs, ks, vs, gs = ([t[:, :, i * n:(i + 1) * n].contiguous() for i in range(blocks)] for t in (q, k, v, dout))
    outs, lses = [], []
    for i in range(blocks):
        out = lse = None
        for j in range(i + 1):
            block_out, block_lse = kernel.forward(qs[i], ks[j], vs[j], i == j, scale)
            out, lse = ((block_out.float(), block_lse.float()) if out is None
                        else _merge(out, lse, block_out, block_lse))
        outs.append(out.to(q.dtype).contiguous())
        lses.append(lse)
    dq, dk, dv = ([torch.zeros_like(t, dtype=torch.float32) for t in ts] for ts in (qs, ks, vs))
    for i in range(blocks):
        for j in range(i + 1):
            a, b, c = kernel.backward(gs[i], qs[i], ks[j], vs[j], outs[i], lses[i], i == j, scale)
            dq[i] += a.float()
            dk[j] += b.float()
            dv[j] += c.float()
    return [torch.cat(t, 2) for t in (outs, dq, dk, dv)]
