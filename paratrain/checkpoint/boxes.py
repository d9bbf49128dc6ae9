"""Arithmetic on boxes (rectangular slices of a global tensor): intersection, overlap search, coverage.

A box is an ``(offset, shape)`` pair of equal-length int tuples. A box with a
zero in its shape is empty: it holds nothing and overlaps nothing (the
trailing ranks of a short tensor under ZeRO hold such boxes).
"""

from __future__ import annotations

import math
from typing import Sequence

Shape = tuple[int, ...]


def intersect(offset_a: Shape, shape_a: Shape, offset_b: Shape, shape_b: Shape) -> tuple[Shape, Shape] | None:
    """The common box of a and b as (offset, shape), or None when they share no element."""
    lo = tuple(max(oa, ob) for oa, ob in zip(offset_a, offset_b))
    hi = tuple(min(oa + na, ob + nb) for oa, na, ob, nb in zip(offset_a, shape_a, offset_b, shape_b))
    shape = tuple(h - l for l, h in zip(lo, hi))
    if any(n <= 0 for n in shape):  # also true when either box is empty
        return None
    return lo, shape


def slices(offset: Shape, shape: Shape, origin: Shape) -> tuple[slice, ...]:
    """Index of the box (offset, shape) inside a tensor whose element 0 sits at `origin`."""
    return tuple(slice(o - base, o - base + n) for o, n, base in zip(offset, shape, origin))


def find_overlap(boxes: Sequence[tuple[Shape, Shape]]) -> tuple[int, int] | None:
    """Indices (i, j) of two boxes that share an element, or None when all are disjoint.

    Sweeps the boxes in order of their start on dim 0 and compares each only
    with the earlier ones still open on dim 0, so layouts split along dim 0
    (ZeRO) cost O(n log n) and a dim-0 band split t ways (TP) costs O(t) per box.
    """
    live = [i for i, (_, shape) in enumerate(boxes) if math.prod(shape) > 0]
    if not live:
        return None
    if len(boxes[live[0]][0]) == 0:  # scalars: any two stored copies overlap
        return (live[0], live[1]) if len(live) > 1 else None
    live.sort(key=lambda i: boxes[i][0][0])
    open_boxes: list[int] = []
    for i in live:
        start = boxes[i][0][0]
        open_boxes = [j for j in open_boxes if boxes[j][0][0] + boxes[j][1][0] > start]
        for j in open_boxes:
            if intersect(*boxes[j], *boxes[i]) is not None:
                return j, i
        open_boxes.append(i)
    return None


def covered_numel(boxes: Sequence[tuple[Shape, Shape]]) -> int:
    """Elements held by a set of pairwise disjoint boxes."""
    return sum(math.prod(shape) for _, shape in boxes)
