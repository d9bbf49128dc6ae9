"""The load-balanced causal split of a sequence over the cp ranks.

A sequence of S tokens is cut into 2·cp chunks of c = S / (2·cp) tokens; rank i holds chunk i
and chunk 2·cp−1−i, in that order (Megatron-Core's and torchtitan's layout). Under a causal mask
a query attends to every key before it, so a late chunk costs more than an early one; pairing
the i-th earliest with the i-th latest gives every rank the same number of visible
(query, key) pairs, c²·(2·cp−1) + c·(c+1) (`causal_pairs`), where a plain split into cp
contiguous pieces would leave the last rank with about 2·cp−1 times the first rank's work.

Tokens, labels and positions are split the same way; positions are what let RoPE (and the
ring's causal masks) know where each held token sits in the whole sequence. Everything here is
pure indexing: no communication.
"""

from __future__ import annotations

import torch

from paratrain.errors import ParatrainError


class ContextSplitError(ParatrainError, ValueError):
    """A sequence that the cp ranks cannot split evenly; the message names the fix."""


def chunk_length(seq_len: int, cp: int) -> int:
    """Tokens per chunk: seq_len / (2·cp), which must be whole."""
    if seq_len % (2 * cp):
        fit = seq_len - seq_len % (2 * cp) or 2 * cp
        raise ContextSplitError(f"sequence length {seq_len} is not divisible by 2 × cp = {2 * cp} (each rank holds "
                                f"2 load-balanced chunks); use --seq-len {fit}")
    return seq_len // (2 * cp)


def positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions in the whole sequence of the 2·c tokens `rank` holds: chunk rank, then chunk 2·cp−1−rank."""
    c = chunk_length(seq_len, cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the sequence): a copy of 2·c of its seq_len entries."""
    if cp == 1:
        return x
    c = chunk_length(x.shape[dim], cp)
    chunks = x.split(c, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def unshard_sequence(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `shard_sequence` (in rank order): its inverse, for tests and eval."""
    cp = len(pieces)
    halves = [p.chunk(2, dim=dim) for p in pieces]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


def causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """(query, key) pairs that `rank`'s queries attend to under the causal mask: the same on every rank."""
    pos = positions(seq_len, cp, rank)
    return int((pos + 1).sum())
