"""The process mesh: named axes over the world, this rank's coordinates, one group per axis.

Ranks are laid out ``pp × dp × tp`` with ``tp`` innermost, so the ranks of a
tensor-parallel group are neighbours (on one node, on fast links) and the
ranks of a pipeline group are far apart. ``MeshShape`` is pure arithmetic
(tested without processes); ``Mesh`` adds the process groups and the device
this process computes on. Besides the three axes, ``"world"`` names every
rank at once (the mesh-wide agreement of a training step is one collective).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from paratrain.errors import ParatrainError, Violation

AXES = ("pp", "dp", "tp")
WORLD = "world"  # every rank of the mesh: not a parallelism axis, the group of mesh-wide agreements


class MeshError(ParatrainError, ValueError):
    """Degrees that do not describe the world (product, positivity)."""


@dataclass(frozen=True)
class MeshShape:
    """Degrees of each axis; their product is the world size."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"--{axis} must be at least 1, got {getattr(self, axis)}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each axis (tp varies fastest)."""
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp}

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis`: the ranks that differ only in their `axis` coordinate."""
        others = [a for a in AXES if a != axis]
        result = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            base = dict(zip(others, fixed))
            result.append([self.rank_of(**{**base, axis: i}) for i in range(self.size(axis))])
        return result

    @classmethod
    def for_world(cls, world_size: int, dp: int | None = None, tp: int = 1, pp: int = 1) -> MeshShape:
        """Degrees for a world; dp defaults to what tp and pp leave. Explains a mismatch in one line."""
        if tp < 1 or pp < 1 or (dp is not None and dp < 1):
            raise MeshError(f"degrees must be at least 1 (dp={dp}, tp={tp}, pp={pp})")
        if dp is None:
            if world_size % (tp * pp):
                raise MeshError(f"world size {world_size} is not divisible by tp × pp = {tp} × {pp}; "
                                f"choose tp × pp among {_divisors(world_size)}")
            dp = world_size // (tp * pp)
        shape = cls(pp=pp, dp=dp, tp=tp)
        if shape.world_size != world_size:
            raise MeshError(f"pp × dp × tp = {pp} × {dp} × {tp} = {shape.world_size} but the world has "
                            f"{world_size} process(es); e.g. dp={world_size // math.gcd(world_size, tp * pp)} "
                            f"needs tp × pp dividing {world_size}")
        return shape


def degree_violations(world_size: int | None, dp: int, tp: int, pp: int) -> list[Violation]:
    """The rule of the degrees themselves: pp × dp × tp is the world size (when it is known)."""
    if world_size is None or dp * tp * pp == world_size:
        return []
    return [Violation("world", f"dp × tp × pp = {dp} × {tp} × {pp} = {dp * tp * pp} ≠ {world_size} ranks")]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Mesh:
    """A MeshShape bound to this process: its rank, coordinates and one process group per axis."""

    shape: MeshShape
    rank: int
    groups: dict[str, dist.ProcessGroup | None] = field(repr=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def size(self, axis: str) -> int:
        return self.shape.world_size if axis == WORLD else self.shape.size(axis)

    def coord(self, axis: str) -> int:
        return self.rank if axis == WORLD else self.shape.coords(self.rank)[axis]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return self.groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on `axis`, in axis order."""
        if axis == WORLD:
            return list(range(self.shape.world_size))
        return next(g for g in self.shape.groups(axis) if self.rank in g)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def build_mesh(shape: MeshShape, timeout: timedelta | None = None, device: torch.device | str | None = None) -> Mesh:
    """Create the process groups of every axis (collectively: every rank must call this).

    `timeout` bounds each collective of the new groups (None: torch's default, 30 minutes;
    torch does not inherit the default group's timeout). `device` is where this rank computes
    (None: the launcher's choice, `paratrain.distributed.default_device`): every tensor the
    strategies allocate lives there.
    """
    if not dist.is_initialized():
        raise MeshError("no process group: call paratrain.init_mesh(), or init torch.distributed first")
    rank, world = dist.get_rank(), dist.get_world_size()
    if shape.world_size != world:
        raise MeshError(f"mesh {shape} has {shape.world_size} ranks but the world has {world}")
    groups: dict[str, dist.ProcessGroup | None] = {WORLD: dist.group.WORLD}
    for axis in AXES:
        for ranks in shape.groups(axis):
            # new_group is collective over the whole world: every rank creates every group. Each group
            # carries its axis's name, which NCCL's flight recorder keeps with every collective.
            group = dist.new_group(ranks, timeout=timeout, group_desc=axis) if len(ranks) > 1 else None
            if rank in ranks:
                groups[axis] = group
    if device is None:
        from paratrain.distributed import default_device, detect_env

        device = default_device(detect_env())
    return Mesh(shape=shape, rank=rank, groups=groups, device=torch.device(device))


def init_mesh(dp: int | None = None, tp: int = 1, pp: int = 1, timeout_s: float | None = None,
              flight_records: str | None = None) -> Mesh:
    """Join the job described by the launcher's environment and build the mesh.

    Creates the default process group if none exists (one process alone gets a
    group of one, so every code path is the same). dp defaults to the world
    size divided by tp × pp. `timeout_s` bounds every collective (None: torch's
    default); a group that already exists keeps its own. `flight_records` is where
    NCCL's flight recorder dumps each rank's last collectives on a timeout (+ rank).
    """
    from paratrain.distributed import backend_for, detect_env, init_distributed

    world = detect_env().world_size
    shape = MeshShape.for_world(world, dp=dp, tp=tp, pp=pp)  # fail before any group exists
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    _, device = init_distributed(**({"timeout_s": timeout_s} if timeout_s is not None else {}),
                                 flight_records=flight_records)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    return build_mesh(shape, timeout, device)
