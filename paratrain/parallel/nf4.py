"""NF4: 4-bit NormalFloat weights with double-quantized block scales, as QLoRA stores a frozen base.

    packed = NF4.encode(weight)            # weight: a float tensor whose numel is a multiple of 64
    weight_again = packed.decode()         # in the weight's dtype (or `decode(torch.float32)`)

The format is torchao's `NF4Tensor` (QLoRA, Dettmers et al. 2023), reproduced bit for bit (the tests compare
against torchao, which paratrain does not depend on):

- The weight, flattened, is cut into blocks of `block_size` (64) elements; each block's absmax is its scale.
  Every element is divided by its block's scale and coded as the index of the nearest of the 16 NF4 levels
  (the first of two equally near), two codes per byte, the first element in the high nibble.
- Double quantization: the scales less their mean are cut into blocks of `scaler_block_size` (256) scales;
  each is coded as round(scale · 256 / (2 · absmax of its block)), clamped to int8, and the factor
  256 / (2 · absmax) of each scaler block is kept in the weight's dtype, as is the mean.
- Every step computes in the weight's dtype, as torchao does (bf16 weights: bf16 scales and levels), so the
  codes of a bf16 weight are those of torchao for that bf16 weight.

Decoding: level[code] · (int8 scale / factor + mean), in the weight's dtype. torchao needs the number of blocks
to be a multiple of `scaler_block_size`; here a last, shorter block of scales is coded the same way over the
scales it has (so any weight of a multiple of 64 elements encodes), which equals torchao wherever torchao runs.

A weight's bytes: numel / 2 for the codes, numel / 64 for the int8 scales, and one factor per 16384 elements:
4.127 bits per parameter (with bf16 factors), the 0.5 bytes per parameter QLoRA's memory claims rest on.

Held as rows (`rows`, `from_rows`): one uint8 row per block, its block_size / 2 code bytes then its scale's byte,
beside the factors and the mean. Rows split anywhere split on whole blocks, and a block decodes from its row, the
factors and the mean alone: so ZeRO-3 shards and gathers an NF4 weight by rows, in its 4-bit form. A part of the
rows (a tensor-parallel shard: whole output rows, or of each output row the blocks of some input columns) decodes
with the whole weight's factors and mean, given where its blocks lie in the whole weight's (`NF4.layout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paratrain.errors import ParatrainError
from paratrain.parallel.rules import NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE

# The 16 NF4 levels (QLoRA's quantiles of N(0, 1), normalized to [-1, 1]) as torchao writes them.
LEVELS = (-1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
          0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000)
_CHUNK = 1024 ** 2  # elements coded at a time: the nearest-level search holds 16 differences per element


class NF4Error(ParatrainError, ValueError):
    """A tensor NF4 cannot encode (its size or dtype); the message says why."""


@dataclass
class NF4:
    """One weight in NF4: its packed codes, double-quantized block scales, shape and dtype."""

    codes: torch.Tensor  # uint8 [numel / 2]: two 4-bit level indices per byte
    scales: torch.Tensor  # int8 [numel / block_size]: each block's absmax less the mean, quantized
    factors: torch.Tensor  # dtype [scaler blocks]: 256 / (2 · absmax) of each block of scales
    mean: torch.Tensor  # dtype []: the mean of the block absmaxes
    shape: torch.Size
    dtype: torch.dtype
    block_size: int = NF4_BLOCK_SIZE
    scaler_block_size: int = NF4_SCALER_BLOCK_SIZE
    # None: the whole weight's blocks. Else a part of a weight (a tensor-parallel shard) whose factors and mean are
    # the whole weight's: (offset, run, stride), its block b being the whole weight's block
    # offset + (b // run) · stride + b % run (runs of `run` blocks, `stride` apart), whose factor it decodes with.
    layout: tuple[int, int, int] | None = None

    @classmethod
    @torch.no_grad()
    def encode(cls, weight: torch.Tensor, block_size: int = NF4_BLOCK_SIZE,
               scaler_block_size: int = NF4_SCALER_BLOCK_SIZE) -> NF4:
        check_encodable(weight.shape, weight.dtype, block_size)
        flat = weight.detach().contiguous().flatten()
        n_blocks = flat.numel() // block_size
        absmax = flat.view(n_blocks, block_size).abs().amax(dim=1)
        scales, factors, mean = _double_quantize(absmax, scaler_block_size)
        levels = torch.tensor(LEVELS, dtype=flat.dtype, device=flat.device)
        scaled = (flat.view(n_blocks, block_size) / absmax.unsqueeze(-1)).flatten()
        index = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):
            part = scaled[start:start + _CHUNK]
            index[start:start + _CHUNK] = (part.unsqueeze(-1) - levels).abs().min(dim=-1).indices.to(torch.uint8)
        codes = index[::2] << 4 | index[1::2]
        return cls(codes, scales, factors, mean, weight.shape, weight.dtype, block_size, scaler_block_size)

    def decode(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight, in its own dtype (computed there, as torchao does), then cast to `dtype` if given.

        Each code byte looks up its two levels at once (a table of the 256 pairs, in the weight's order), and each
        block is scaled in place: besides the weight, one int32 index per byte lives meanwhile (2 bytes a
        parameter)."""
        levels = torch.tensor(LEVELS, dtype=self.dtype, device=self.codes.device)
        pairs = torch.stack([levels.repeat_interleave(16), levels.repeat(16)], dim=-1)  # byte -> (high, low)
        weight = pairs[self.codes.reshape(-1).int()]
        weight.view(-1, self.block_size).mul_(self.block_scales().unsqueeze(-1))
        weight = weight.reshape(self.shape)
        return weight if dtype is None else weight.to(dtype)

    def block_scales(self) -> torch.Tensor:
        """Each block's scale as decoding uses it: int8 scale / its scaler block's factor + mean, in the dtype."""
        if self.layout is None:
            per_scale = self.factors.repeat_interleave(self.scaler_block_size)[:self.scales.numel()]
        else:
            offset, run, stride = self.layout
            local = torch.arange(self.scales.numel(), device=self.scales.device)
            per_scale = self.factors[(offset + local // run * stride + local % run) // self.scaler_block_size]
        return (self.scales / per_scale).to(self.dtype) + self.mean

    def rows(self) -> torch.Tensor:
        """The codes and scales as uint8 [blocks, block_size / 2 + 1]: each block's codes, then its scale's byte
        (`from_rows` takes them in any shape whose last dim is that row: [out, in / block_size, ...] to split by
        input columns)."""
        codes = self.codes.reshape(-1, self.block_size // 2)
        return torch.cat([codes, self.scales.view(torch.uint8).unsqueeze(1)], dim=1)

    @classmethod
    def from_rows(cls, rows: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor, shape: torch.Size,
                  dtype: torch.dtype, block_size: int = NF4_BLOCK_SIZE,
                  scaler_block_size: int = NF4_SCALER_BLOCK_SIZE, layout: tuple[int, int, int] | None = None) -> NF4:
        """The weight (or with `layout`, the part of one) whose `rows` (views: nothing copied), factors and mean
        these are."""
        rows = rows.reshape(-1, rows.shape[-1])
        return cls(rows[:, :-1], rows[:, -1].view(torch.int8), factors, mean.reshape(()), torch.Size(shape), dtype,
                   block_size, scaler_block_size, layout)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "factors": self.factors, "mean": self.mean}

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def to(self, device) -> NF4:
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return NF4(**moved, shape=self.shape, dtype=self.dtype, block_size=self.block_size,
                   scaler_block_size=self.scaler_block_size, layout=self.layout)


def check_encodable(shape, dtype: torch.dtype, block_size: int = NF4_BLOCK_SIZE) -> None:
    """NF4Error (one line) for a weight NF4 cannot hold: not floating point, or not whole blocks."""
    if not dtype.is_floating_point:
        raise NF4Error(f"NF4 encodes floating-point weights, not {dtype}")
    numel = math.prod(shape)
    if numel == 0 or numel % block_size:
        raise NF4Error(f"a weight of shape {tuple(shape)} ({numel} elements) is not a whole number of NF4 blocks "
                       f"of {block_size}")


def _double_quantize(absmax: torch.Tensor, scaler_block_size: int):
    """(int8 scales, factor per block of scales, mean): the block absmaxes less their mean, absmax-quantized by
    blocks of `scaler_block_size` (the last block may be shorter), all in the absmaxes' dtype."""
    mean = absmax.mean()
    centred = absmax - mean
    n = centred.numel()
    n_full, rest = divmod(n, scaler_block_size)
    pieces, factors = [], []
    if n_full:
        blocks = centred[:n_full * scaler_block_size].view(n_full, scaler_block_size)
        factor = 256 / (2 * blocks.abs().amax(dim=1))
        pieces.append((blocks * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten())
        factors.append(factor)
    if rest:
        block = centred[n_full * scaler_block_size:]
        factor = 256 / (2 * block.abs().amax(dim=0, keepdim=True))
        pieces.append((block * factor).round().clamp(-128, 127))
        factors.append(factor)
    return torch.cat(pieces).to(torch.int8), torch.cat(factors).contiguous(), mean
