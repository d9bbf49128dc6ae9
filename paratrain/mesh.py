"""The process mesh: named axes over the world, this rank's coordinates, one group per axis.

Ranks are laid out ``pp × dp × cp × tp`` with ``tp`` innermost, so the ranks of a
tensor-parallel group are neighbours (on one node, on fast links) and the
ranks of a pipeline group are far apart. ``cp`` (context parallelism: each rank
holds 2 of the 2·cp chunks of every sequence) sits just outside ``tp``: its
ring sends K/V blocks in every attention layer, forward and backward, so it
is the second most talkative axis and gets the next nearest ranks (a node
holds tp × cp ranks where it can), as in Megatron-Core and torchtitan; the
data axis, which talks once per step, and the pipeline, once per
micro-batch and stage boundary, go across nodes. ``MeshShape`` is pure arithmetic
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

Context-parallel ranks see different tokens of the same sequences, so their
gradients are partial sums like data ranks': with cp > 1 the gradients are
reduced (and ZeRO shards) over ``"dp_cp"``, the ranks that differ only in
their dp or cp coordinate (`Mesh.data_axis`), as torchtitan folds cp into
FSDP's mesh. Batches, the loss and the agreement's counts stay per data rank.

Expert parallelism splits the data axis once more: ``dp = ep_replicate × ep``, ``ep`` inner.
The ``ep`` neighbouring data ranks of a group each hold E/ep experts of every MoE layer and send
each other their tokens (all-to-all); the ``ep_replicate`` data ranks at one ``ep`` coordinate
hold the same experts, which are copies only along that axis (`replicated_over`) and whose
gradients are reduced over it. Every other parameter stays under the whole data axis.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist
from paratrain.errors import ParatrainError



class Axis(StrEnum):
    """A named axis of the mesh: what a strategy is handed to talk in (`Comm`'s collectives take one).

    Equal to its name as a string (and hashed alike), so tables keyed by axis read the same either way
    and a report prints "dp", not a class name.
    """

    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"
    DP_CP = "dp_cp"  # the ranks that differ only in dp and cp: what gradients are reduced over with cp > 1
    DP_SHARD = "dp_shard"  # hybrid sharding (dp = dp_replicate × dp_shard): the ranks of one ZeRO shard group
    DP_REPLICATE = "dp_replicate"  # ... and the ranks holding the same shard
    # Expert parallelism (dp = ep_replicate × ep): `ep` neighbouring data ranks hold the experts of each MoE
    # layer between them; the `ep_replicate` ranks at one ep coordinate hold the same block.
    EP = "ep"
    EP_REPLICATE = "ep_replicate"
    WORLD = "world"  # every rank of the mesh: not a parallelism axis, the group of mesh-wide agreements


AXES = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)
DATA_CP = Axis.DP_CP
DATA_SUBAXES = (Axis.DP_SHARD, Axis.DP_REPLICATE)  # the data axis split for hybrid sharding
EXPERT_AXES = (Axis.EP, Axis.EP_REPLICATE)  # the data axis split for expert parallelism
WORLD = Axis.WORLD
# What every rank of one data rank's pipeline and tensor-parallel group holds alike: its batch and its counts.
PER_DATA_RANK = (Axis.PP, Axis.CP, Axis.TP)


class MeshError(ParatrainError, ValueError):
    """Degrees that do not describe the world (product, positivity)."""


@dataclass(frozen=True)
class MeshShape:
    """Degrees of each axis; their product is the world size."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_shard: int = 0  # ranks a ZeRO shard group spans (0: the whole data axis, no replicas)
    cp: int = 1  # context parallelism: ranks that split each sequence (after dp_shard: positional callers keep theirs)
    ep: int = 1  # expert parallelism: neighbouring data ranks that split the experts (divides dp)

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"--{axis} must be at least 1, got {getattr(self, axis)}")
        if self.dp_shard == 0:
            object.__setattr__(self, "dp_shard", self.dp)
        if self.dp_shard < 1 or self.dp % self.dp_shard:
            raise MeshError(f"--dp-shard {self.dp_shard} must divide the data-parallel degree {self.dp}; "
                            f"choose among {_divisors(self.dp)}")
        if self.ep < 1 or self.dp % self.ep:
            raise MeshError(f"--ep {self.ep} must divide the data-parallel degree {self.dp}; "
                            f"choose among {_divisors(self.dp)}")

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def ep_replicate(self) -> int:
        return self.dp // self.ep

    def size(self, axis: Axis) -> int:
        return self.dp * self.cp if axis == DATA_CP else getattr(self, axis)

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The axes `build_mesh` makes groups for: pp, dp, cp, tp, the data axis's two parts when it keeps
        replicas, dp × cp together when cp > 1 (the gradients' group), and the expert axes when ep > 1."""
        return (AXES + (DATA_SUBAXES if self.dp_replicate > 1 else ()) + ((DATA_CP,) if self.cp > 1 else ())
                + (EXPERT_AXES if self.ep > 1 else ()))

    def num_communicators(self) -> int:
        """Process groups of more than one rank that each rank belongs to: the default group over the world and
        its group on each axis of more than one rank. Under NCCL each holds a communicator with its own buffers
        (the default group's too when an axis spans the world and the mesh rides that axis's group)."""
        if self.world_size == 1:
            return 0
        return 1 + sum(self.size(axis) > 1 for axis in self.axes)

    def coords(self, rank: int) -> dict[Axis, int]:
        """This rank's coordinate on each axis (tp varies fastest, then cp), the data axis's parts included."""
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp, rest = divmod(rest, self.cp * self.tp)
        cp, tp = divmod(rest, self.tp)
        replicate, shard = divmod(dp, self.dp_shard)
        ep_replicate, ep = divmod(dp, self.ep)
        return {Axis.PP: pp, Axis.DP: dp, Axis.CP: cp, Axis.TP: tp, Axis.DP_SHARD: shard, Axis.DP_REPLICATE: replicate,
                Axis.DP_CP: dp * self.cp + cp, Axis.EP: ep, Axis.EP_REPLICATE: ep_replicate}

    def owns(self, rank: int, replicated_over: tuple[Axis, ...]) -> bool:
        """Whether `rank` is the one that counts or writes a tensor held alike along the axes `replicated_over`:
        the copy at coordinate 0 of each of them (a norm counts each element once, a checkpoint writes it once)."""
        coords = self.coords(rank)
        return all(coords[axis] == 0 for axis in replicated_over)

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0, dp_shard: int | None = None,
                dp_replicate: int | None = None, cp: int = 0, dp_cp: int | None = None, ep: int | None = None,
                ep_replicate: int | None = None) -> int:
        if dp_shard is not None or dp_replicate is not None:
            dp = (dp_replicate or 0) * self.dp_shard + (dp_shard or 0)
        if ep is not None or ep_replicate is not None:
            dp = (ep_replicate or 0) * self.ep + (ep or 0)
        if dp_cp is not None:
            dp, cp = divmod(dp_cp, self.cp)
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, axis: Axis) -> list[list[int]]:
        """Every group of `axis`: the ranks that differ only in their `axis` coordinate."""
        if axis == Axis.DP_SHARD:  # runs of dp_shard neighbouring ranks of each data group
            return [g[i:i + self.dp_shard] for g in self.groups(Axis.DP) for i in range(0, self.dp, self.dp_shard)]
        if axis == Axis.DP_REPLICATE:  # every dp_shard-th rank of each data group: one per shard group
            return [g[i::self.dp_shard] for g in self.groups(Axis.DP) for i in range(self.dp_shard)]
        if axis == Axis.EP:  # runs of ep neighbouring ranks of each data group
            return [g[i:i + self.ep] for g in self.groups(Axis.DP) for i in range(0, self.dp, self.ep)]
        if axis == Axis.EP_REPLICATE:  # every ep-th rank of each data group: the holders of one block of experts
            return [g[i::self.ep] for g in self.groups(Axis.DP) for i in range(self.ep)]
        if axis == DATA_CP:  # every (dp, cp) pair of one (pp, tp) position, dp-major
            return [[self.rank_of(pp=p, tp=t, dp_cp=i) for i in range(self.dp * self.cp)]
                    for p in range(self.pp) for t in range(self.tp)]
        others = [a for a in AXES if a != axis]
        result = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            base = dict(zip(others, fixed))
            result.append([self.rank_of(**{**base, axis: i}) for i in range(self.size(axis))])
        return result

    @classmethod
    def for_world(cls, world_size: int, dp: int | None = None, tp: int = 1, pp: int = 1,
                  dp_shard: int | None = None, cp: int = 1, ep: int = 1) -> MeshShape:
        """Degrees for a world; dp defaults to what tp, cp and pp leave. Explains a mismatch in one line."""
        if tp < 1 or pp < 1 or cp < 1 or (dp is not None and dp < 1):
            raise MeshError(f"degrees must be at least 1 (dp={dp}, cp={cp}, tp={tp}, pp={pp})")
        others, named = tp * cp * pp, "tp × pp" if cp == 1 else "tp × cp × pp"
        spelled = f"{tp} × {pp}" if cp == 1 else f"{tp} × {cp} × {pp}"
        if dp is None:
            if world_size % others:
                raise MeshError(f"world size {world_size} is not divisible by {named} = {spelled}; "
                                f"choose {named} among {_divisors(world_size)}")
            dp = world_size // others
        shape = cls(pp=pp, dp=dp, tp=tp, dp_shard=dp_shard or 0, cp=cp, ep=ep)
        if shape.world_size != world_size:
            degrees = f"{pp} × {dp} × {tp}" if cp == 1 else f"{pp} × {dp} × {cp} × {tp}"
            raise MeshError(f"pp × dp{'' if cp == 1 else ' × cp'} × tp = {degrees} = {shape.world_size} but the "
                            f"world has {world_size} process(es); e.g. dp={world_size // math.gcd(world_size, others)} "
                            f"needs {named} dividing {world_size}")
        return shape


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group on one axis of a mesh, resolved once (`Mesh.on`): what a collective over the axis reads
    on every call, as plain values, so that issuing one asks the mesh nothing."""

    axis: Axis
    group: dist.ProcessGroup | None  # None: the axis has one rank here, there is no group to talk in
    size: int
    coord: int  # this rank's index in `ranks`
    ranks: tuple[int, ...]  # the global ranks of the group, in axis order


@dataclass
class Mesh:
    """A MeshShape bound to this process: its rank, coordinates and one process group per axis."""

    shape: MeshShape
    rank: int
    groups: dict[Axis, dist.ProcessGroup | None] = field(repr=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def size(self, axis: Axis) -> int:
        return self.shape.world_size if axis == WORLD else self.shape.size(axis)

    def coord(self, axis: Axis) -> int:
        return self.rank if axis == WORLD else self.shape.coords(self.rank)[axis]

    def group(self, axis: Axis) -> dist.ProcessGroup | None:
        return self.groups.get(axis)  # an axis of one rank may have no entry: there is no group to talk in

    @property
    def data_axis(self) -> Axis:
        """The axis gradients are reduced over: ``"dp"``, or ``"dp_cp"`` with context parallelism (cp ranks
        hold different tokens of the same sequences, so their gradients are partial sums too)."""
        return Axis.DP if self.shape.cp == 1 else Axis.DP_CP

    @property
    def shard_axis(self) -> Axis:
        """The axis ZeRO shards over: the data axis (`data_axis`), or ``"dp_shard"`` when it keeps replicas (HSDP)."""
        return self.data_axis if self.shape.dp_replicate == 1 else Axis.DP_SHARD

    @property
    def replicas(self) -> int:
        """How many replicas of each ZeRO shard the data axis holds (its ``dp_replicate`` degree)."""
        return self.shape.dp_replicate

    def ranks(self, axis: Axis) -> list[int]:
        """Global ranks of this rank's group on `axis`, in axis order."""
        if axis == WORLD:
            return list(range(self.shape.world_size))
        return next(g for g in self.shape.groups(axis) if self.rank in g)

    def on(self, axis: Axis) -> AxisGroup:
        """This rank's group on `axis` with its size, this rank's coordinate and the group's ranks, resolved now
        (a `Comm` resolves each axis once, when it is made)."""
        return AxisGroup(axis, self.group(axis), self.size(axis), self.coord(axis), tuple(self.ranks(axis)))

    def owns(self, replicated_over: tuple[Axis, ...]) -> bool:
        """Whether this rank counts or writes a tensor held alike along `replicated_over` (`MeshShape.owns`)."""
        return self.shape.owns(self.rank, replicated_over)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def replicated_over(data_sharded: bool, tp_sharded: bool, expert: bool = False) -> tuple[Axis, ...]:
    """The axes along which ranks hold equal copies of one parameter's tensor (a master, its gradient, the
    parameter itself).

    Over the data axis: every data rank when the tensor is whole there (DDP's masters, ZeRO-1/2's
    parameters), and every cp rank, which holds the same parameters for other tokens; else (ZeRO's
    shards, over dp × cp) the replicas of each shard group, `dp_replicate` (one rank: no copies, without
    hybrid sharding). Over tp unless tensor parallelism splits it.
    Every stage of a pipeline holds its own parameters: never copies along pp.
    An expert tensor (`expert`: a block of E/ep experts) is whole on the `ep_replicate` data ranks
    that hold the same block, and sharded over them by ZeRO: copies along `ep_replicate` or none.
    """
    if expert:
        return (() if data_sharded else (Axis.EP_REPLICATE,)) + (() if tp_sharded else (Axis.TP,))
    return ((Axis.DP_REPLICATE,) if data_sharded else (Axis.DP, Axis.CP)) + (() if tp_sharded else (Axis.TP,))


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
    groups: dict[Axis, dist.ProcessGroup | None] = {WORLD: dist.group.WORLD}
    for axis in shape.axes:
        for ranks in shape.groups(axis):
            # new_group is collective over the whole world: every rank creates every group. Each group
            # carries its axis's name, which NCCL's flight recorder keeps with every collective.
            group = dist.new_group(ranks, timeout=timeout, group_desc=str(axis)) if len(ranks) > 1 else None
            if rank in ranks:
                groups[axis] = group
    # When one axis is the whole world (the others have one rank), the mesh-wide agreement rides its group:
    # one process group over those ranks, not two (each holds its own threads, or NCCL communicator and
    # buffers, and a collective on a group that sat idle since the last step waits for it to wake).
    spanning = [axis for axis in shape.axes if world > 1 and shape.size(axis) == world and axis in AXES + (DATA_CP,)]
    if spanning:
        groups[WORLD] = groups[spanning[0]]
    if device is None:
        from paratrain.distributed import default_device, detect_env

        device = default_device(detect_env())
    return Mesh(shape=shape, rank=rank, groups=groups, device=torch.device(device))


def init_mesh(dp: int | None = None, tp: int = 1, pp: int = 1, timeout_s: float | None = None,
              flight_records: str | None = None, dp_shard: int | None = None, store=None, cp: int = 1,
              ep: int = 1) -> Mesh:
    """Join the job described by the launcher's environment and build the mesh.

    Creates the default process group if none exists (one process alone gets a
    group of one, so every code path is the same). dp defaults to the world
    size divided by tp × cp × pp; `dp_shard` splits it for hybrid sharding (None: no
    split); `cp` splits every sequence over that many neighbouring ranks (context parallelism); `ep` splits
    the experts of MoE layers over that many neighbouring data ranks (expert parallelism). `timeout_s` bounds every collective (None: torch's default); a group
    that already exists keeps its own. `flight_records` is where
    NCCL's flight recorder dumps each rank's last collectives on a timeout (+ rank). `store`:
    the job's store, when the caller opened it before (`paratrain.distributed.launcher_store`).
    """
    from paratrain.distributed import backend_for, detect_env, init_distributed

    world = detect_env().world_size
    shape = MeshShape.for_world(world, dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, cp=cp, ep=ep)  # fail before any group exists
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    _, device = init_distributed(**({"timeout_s": timeout_s} if timeout_s is not None else {}),
                                 flight_records=flight_records, store=store)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    return build_mesh(shape, timeout, device)
