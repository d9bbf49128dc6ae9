"""Which mesh axis each ZeRO-3 parameter is sharded over, and the units that keep two axes apart.

Most parameters are copies on every data rank, and ZeRO-3 splits each over the shard axis (the data
axis, or its dp_shard part under hybrid sharding). A block of experts (expert parallelism) is a copy
only on the `ep_replicate` data ranks that hold the same block, so it is split over those: each of
its elements then lives on exactly one data rank, as a dense parameter's does, and the two kinds
differ only in the group that gathers them and reduce-scatters their gradients.

A unit is gathered by one collective over one axis, so a module holding parameters of another axis
than the default (`GroupedExperts`) becomes a unit of its own, nested in its block: its gather runs
inside the block's forward, when the block calls it, over its own group.
"""

from __future__ import annotations

from torch import nn

from paratrain.mesh import Axis, Mesh
from paratrain.parallel.data.units import ZeroConfigError


def axis_units(model: nn.Module, picked: list[tuple[str, nn.Module]], other_axis: set[str]) -> list[tuple[str, nn.Module]]:
    """`picked` units and, in module order, every other module that itself holds a parameter named in
    `other_axis` (sharded over another axis than the rest)."""
    chosen = {id(m) for _, m in picked}
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    extra = [(name, m) for name, m in model.named_modules() if id(m) not in chosen and m is not model
             and any(f"{name}.{attr}" in other_axis for attr, p in m._parameters.items() if p is not None)]
    return sorted(picked + extra, key=lambda named: order[id(named[1])])


def unit_axis(unit_name: str, axes: list[Axis], default: Axis) -> Axis:
    """The one axis the parameters of a unit are sharded over (a unit is one collective)."""
    distinct = sorted(set(axes))
    if len(distinct) > 1:
        raise ZeroConfigError(f"ZeRO-3 unit {unit_name or 'the root'!r} holds parameters sharded over {distinct}; "
                              "hold each kind in a module of its own (a tied weight cannot join an expert block)")
    return distinct[0] if distinct else default


def shard_place(mesh: Mesh, axis: Axis) -> tuple[int, int]:
    """(ranks the axis has, this rank's coordinate on it)."""
    return mesh.size(axis), mesh.coord(axis)
