"""The one sharding layout of ZeRO: every parameter split along its first dimension.

Rank r of N holds rows [r·c, min((r+1)·c, d0)) of a parameter whose first
dimension is d0, with c = ceil(d0 / N); flat communication buffers pad each
rank's piece to c rows so that chunks are equal. A shard is therefore always
a rectangular slice of the global tensor (offset r·c on dim 0), which is what
checkpoints record and what lets any layout be loaded into any other.
"""

from __future__ import annotations

import math

import torch


def rows_per_rank(d0: int, n: int) -> int:
    """Rows of the padded chunk every rank holds."""
    return math.ceil(d0 / n)


def row_range(d0: int, n: int, rank: int) -> tuple[int, int]:
    """The real (unpadded) rows [lo, hi) that `rank` owns; empty for trailing ranks of a short tensor."""
    c = rows_per_rank(d0, n)
    return min(rank * c, d0), min((rank + 1) * c, d0)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View a tensor as 2-D rows × rest (a 0-d tensor is one row of one element)."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(t.shape[0], -1)


def padded_chunk_numel(shape: torch.Size, n: int) -> int:
    """Elements of one rank's padded chunk of a tensor of `shape`."""
    d0 = shape[0] if len(shape) else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    return rows_per_rank(d0, n) * rest


# How a tensor's rows lie in its padded chunks, as index expressions over plain slices: a layout computed once
# (`row_tiles`) and applied to each step's fresh buffers. A tile is (rows, shape, part): `rows[rows_slice]` (the
# tensor as [d0, width]) reshaped to `shape` is `chunks[part]` (the [N, c·width] columns that hold it).
Tile = tuple[slice, tuple[int, int], tuple[slice, slice]]


def row_tiles(d0: int, n: int, width: int) -> tuple[list[Tile], list[tuple[slice, slice]]]:
    """(tiles, padding) of a tensor of `d0` rows of `width` elements in its `n` padded chunks of c rows each.

    The ranks whose c rows are all real take one rectangular tile; a last, partly filled rank a second one.
    The padding is the parts of the chunks (`chunks[part]`) that hold no row, each non-empty.
    """
    c = rows_per_rank(d0, n)
    if c == 0:
        return [], []
    whole, tail = divmod(d0, c)
    tiles = [(slice(0, whole * c), (whole, c * width), (slice(0, whole), slice(0, c * width)))]
    pads = []
    if tail:
        tiles.append((slice(whole * c, d0), (1, tail * width), (slice(whole, whole + 1), slice(0, tail * width))))
        pads.append((slice(whole, whole + 1), slice(tail * width, c * width)))
        whole += 1
    if whole < n:
        pads.append((slice(whole, n), slice(0, c * width)))
    return tiles, pads if width else []


def chunk_tiles(rows: torch.Tensor, chunks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching (rows part, chunks part) pairs of a tensor's rows and its padded chunks (`row_tiles`).

    `rows` is the tensor as [d0, rest] (`as_rows`), `chunks` the [N, c·rest] columns of a flat
    [N, C] communication buffer that hold it (chunk r: rank r's rows, then padding).
    """
    d0, rest = rows.shape
    tiles, _ = row_tiles(d0, chunks.shape[0], rest)
    return [(rows[part].reshape(shape), chunks[columns]) for part, shape, columns in tiles]


def chunk_padding(d0: int, rest: int, chunks: torch.Tensor) -> list[torch.Tensor]:
    """The parts of `chunks` (as in `chunk_tiles`) that hold no row: the padding to zero."""
    return [chunks[part] for part in row_tiles(d0, chunks.shape[0], rest)[1]]
