"""The process mesh: named axes over the world, this rank's coordinates, one group per axis.

Ranks are laid out ``pp × dp × tp`` with ``tp`` innermost, so the ranks of a
tensor-parallel group are neighbours (on one node, on fast links) and the
ranks of a pipeline group are far apart. ``MeshShape`` is pure arithmetic
(tested without processes); ``Mesh`` adds the process groups and the device
this process computes on. Besides the three axes, ``"world"`` names every
rank at once (the mesh-wide agreement of a training step is one collective).

Rank ownership is decided here once for every caller: a tensor that several ranks hold alike
(`replicated_over` names the axes it is copied along) is counted or written by the one copy at
coordinate 0 of each of those axes (`MeshShape.owns`). The gradient norm, the step's agreement,
the metrics per data rank, the checkpoint's boxes and the replica guard all ask that one rule.

The data axis may be split in two for hybrid sharding (HSDP):
``dp = dp_replicate × dp_shard``, ``dp_shard`` inner. ZeRO shards over a
group of ``dp_shard`` neighbouring data ranks (a node) and keeps
``dp_replicate`` replicas of those shards (across nodes): gradients are
reduce-scattered within the shard group and the shards all-reduced between
replicas. ``dp`` stays the whole data axis: batches, the loss and every
agreement are over it. With ``dp_shard == dp`` (the default) there is one
replica and the data axis is not split (`Mesh.shard_axis` is ``"dp"``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from paratrain.errors import ParatrainError

AXES = ("pp", "dp", "tp")
DATA_SUBAXES = ("dp_shard", "dp_replicate")  # the data axis split for hybrid sharding (dp = replicate × shard)
WORLD = "world"  # every rank of the mesh: not a parallelism axis, the group of mesh-wide agreements
# What every rank of one data rank's pipeline and tensor-parallel group holds alike: its batch and its counts.
PER_DATA_RANK = ("pp", "tp")


class MeshError(ParatrainError, ValueError):
    """Degrees that do not describe the world (product, positivity)."""


@dataclass(frozen=True)
class MeshShape:
    """Degrees of each axis; their product is the world size."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_shard: int = 0  # ranks a ZeRO shard group spans (0: the whole data axis, no replicas)

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"--{axis} must be at least 1, got {getattr(self, axis)}")
        if self.dp_shard == 0:
            object.__setattr__(self, "dp_shard", self.dp)
        if self.dp_shard < 1 or self.dp % self.dp_shard:
            raise MeshError(f"--dp-shard {self.dp_shard} must divide the data-parallel degree {self.dp}; "
                            f"choose among {_divisors(self.dp)}")

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes `build_mesh` makes groups for: pp, dp, tp, and the data axis's two parts when it keeps replicas."""
        return AXES + (DATA_SUBAXES if self.dp_replicate > 1 else ())

    def num_communicators(self) -> int:
        """Process groups of more than one rank that each rank belongs to: the default group over the world and
        its group on each axis of more than one rank. Under NCCL each holds a communicator with its own buffers
        (the default group's too when an axis spans the world and the mesh rides that axis's group)."""
        if self.world_size == 1:
            return 0
        return 1 + sum(self.size(axis) > 1 for axis in self.axes)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each axis (tp varies fastest), the data axis's two parts included."""
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        replicate, shard = divmod(dp, self.dp_shard)
        return {"pp": pp, "dp": dp, "tp": tp, "dp_shard": shard, "dp_replicate": replicate}

    def owns(self, rank: int, replicated_over: tuple[str, ...]) -> bool:
        """Whether `rank` is the one that counts or writes a tensor held alike along the axes `replicated_over`:
        the copy at coordinate 0 of each of them (a norm counts each element once, a checkpoint writes it once)."""
        coords = self.coords(rank)
        return all(coords[axis] == 0 for axis in replicated_over)

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0, dp_shard: int | None = None,
                dp_replicate: int | None = None) -> int:
        if dp_shard is not None or dp_replicate is not None:
            dp = (dp_replicate or 0) * self.dp_shard + (dp_shard or 0)
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis`: the ranks that differ only in their `axis` coordinate."""
        if axis == "dp_shard":  # runs of dp_shard neighbouring ranks of each data group
            return [g[i:i + self.dp_shard] for g in self.groups("dp") for i in range(0, self.dp, self.dp_shard)]
        if axis == "dp_replicate":  # every dp_shard-th rank of each data group: one per shard group
            return [g[i::self.dp_shard] for g in self.groups("dp") for i in range(self.dp_shard)]
        others = [a for a in AXES if a != axis]
        result = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            base = dict(zip(others, fixed))
            result.append([self.rank_of(**{**base, axis: i}) for i in range(self.size(axis))])
        return result

    @classmethod
    def for_world(cls, world_size: int, dp: int | None = None, tp: int = 1, pp: int = 1,
                  dp_shard: int | None = None) -> MeshShape:
        """Degrees for a world; dp defaults to what tp and pp leave. Explains a mismatch in one line."""
        if tp < 1 or pp < 1 or (dp is not None and dp < 1):
            raise MeshError(f"degrees must be at least 1 (dp={dp}, tp={tp}, pp={pp})")
        if dp is None:
            if world_size % (tp * pp):
                raise MeshError(f"world size {world_size} is not divisible by tp × pp = {tp} × {pp}; "
                                f"choose tp × pp among {_divisors(world_size)}")
            dp = world_size // (tp * pp)
        shape = cls(pp=pp, dp=dp, tp=tp, dp_shard=dp_shard or 0)
        if shape.world_size != world_size:
            raise MeshError(f"pp × dp × tp = {pp} × {dp} × {tp} = {shape.world_size} but the world has "
                            f"{world_size} process(es); e.g. dp={world_size // math.gcd(world_size, tp * pp)} "
                            f"needs tp × pp dividing {world_size}")
        return shape


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

    @property
    def shard_axis(self) -> str:
        """The axis ZeRO shards over: ``"dp"``, or ``"dp_shard"`` when the data axis keeps replicas (HSDP)."""
        return "dp" if self.shape.dp_replicate == 1 else "dp_shard"

    @property
    def replicas(self) -> int:
        """How many replicas of each ZeRO shard the data axis holds (its ``dp_replicate`` degree)."""
        return self.shape.dp_replicate

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on `axis`, in axis order."""
        if axis == WORLD:
            return list(range(self.shape.world_size))
        return next(g for g in self.shape.groups(axis) if self.rank in g)

    def owns(self, replicated_over: tuple[str, ...]) -> bool:
        """Whether this rank counts or writes a tensor held alike along `replicated_over` (`MeshShape.owns`)."""
        return self.shape.owns(self.rank, replicated_over)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def replicated_over(data_sharded: bool, tp_sharded: bool) -> tuple[str, ...]:
    """The axes along which ranks hold equal copies of one parameter's tensor (a master, its gradient, the
    parameter itself).

    Over the data axis: every data rank when the tensor is whole there (DDP's masters, ZeRO-1/2's
    parameters), else (ZeRO's shards) the replicas of each shard group, `dp_replicate` (one
    rank: no copies, without hybrid sharding). Over tp unless tensor parallelism splits it.
    Every stage of a pipeline holds its own parameters: never copies along pp.
    """
    return ("dp_replicate" if data_sharded else "dp",) + (() if tp_sharded else ("tp",))


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
    for axis in shape.axes:
        for ranks in shape.groups(axis):
            # new_group is collective over the whole world: every rank creates every group. Each group
            # carries its axis's name, which NCCL's flight recorder keeps with every collective.
            group = dist.new_group(ranks, timeout=timeout, group_desc=axis) if len(ranks) > 1 else None
            if rank in ranks:
                groups[axis] = group
    # When one axis is the whole world (the others have one rank), the mesh-wide agreement rides its group:
    # one process group over those ranks, not two (each holds its own threads, or NCCL communicator and
    # buffers, and a collective on a group that sat idle since the last step waits for it to wake).
    spanning = [axis for axis in AXES if world > 1 and shape.size(axis) == world]
    if spanning:
        groups[WORLD] = groups[spanning[0]]
    if device is None:
        from paratrain.distributed import default_device, detect_env

        device = default_device(detect_env())
    return Mesh(shape=shape, rank=rank, groups=groups, device=torch.device(device))


def init_mesh(dp: int | None = None, tp: int = 1, pp: int = 1, timeout_s: float | None = None,
              flight_records: str | None = None, dp_shard: int | None = None, store=None) -> Mesh:
    """Join the job described by the launcher's environment and build the mesh.

    Creates the default process group if none exists (one process alone gets a
    group of one, so every code path is the same). dp defaults to the world
    size divided by tp × pp; `dp_shard` splits it for hybrid sharding (None: no
    split). `timeout_s` bounds every collective (None: torch's default); a group
    that already exists keeps its own. `flight_records` is where
    NCCL's flight recorder dumps each rank's last collectives on a timeout (+ rank). `store`:
    the job's store, when the caller opened it before (`paratrain.distributed.launcher_store`).
    """
    from paratrain.distributed import backend_for, detect_env, init_distributed

    world = detect_env().world_size
    shape = MeshShape.for_world(world, dp=dp, tp=tp, pp=pp, dp_shard=dp_shard)  # fail before any group exists
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    _, device = init_distributed(**({"timeout_s": timeout_s} if timeout_s is not None else {}),
                                 flight_records=flight_records, store=store)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    return build_mesh(shape, timeout, device)
