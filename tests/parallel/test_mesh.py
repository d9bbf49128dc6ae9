"""Mesh coordinates and groups are pure arithmetic; the comm layer counts bytes as a ring sends them."""

import collections
import math

import pytest
import torch

from paratrain.comm import Comm
from paratrain.mesh import PER_DATA_RANK, WORLD, Axis, Mesh, MeshError, MeshShape, build_mesh, replicated_over
from paratrain.testing import Collectives, run_on_ranks


def test_tp_is_innermost_and_pp_outermost():
    shape = MeshShape(pp=2, dp=2, tp=2)
    assert shape.world_size == 8
    assert [{a: c[a] for a in ("pp", "dp", "tp")} for c in map(shape.coords, (0, 1, 2, 7))] == [
        {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1}, {"pp": 0, "dp": 1, "tp": 0},
        {"pp": 1, "dp": 1, "tp": 1}]
    assert shape.coords(2)["dp_shard"] == 1 and shape.coords(2)["dp_replicate"] == 0  # no split: one shard group
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("data_sharded", [False, True])
@pytest.mark.parametrize("tp_sharded", [False, True])
def test_every_set_of_copies_of_a_tensor_has_exactly_one_owner(data_sharded, tp_sharded):
    """Ranks holding the same copy differ only along the replicated axes: one of each such set owns it."""
    shape = MeshShape(pp=2, dp=4, tp=2, dp_shard=2)
    axes = replicated_over(data_sharded, tp_sharded)
    parts = {a for axis in axes for a in (("dp_shard", "dp_replicate") if axis == "dp" else (axis,))}
    copies = collections.defaultdict(list)
    for rank in range(shape.world_size):
        coords = shape.coords(rank)
        copies[tuple(coords[a] for a in ("pp", "dp_replicate", "dp_shard", "tp") if a not in parts)].append(rank)
    assert len(copies) == shape.world_size // math.prod(shape.size(a) for a in axes)
    for ranks in copies.values():
        assert [shape.owns(r, axes) for r in ranks].count(True) == 1, (axes, ranks)
    per_data_rank = [r for r in range(shape.world_size) if shape.owns(r, PER_DATA_RANK)]
    assert [shape.coords(r)["dp"] for r in per_data_rank] == list(range(shape.dp))


def test_what_is_replicated_where():
    # DDP's masters, tp-replicated: alike on every data rank and every cp rank (other tokens, same parameters)
    assert replicated_over(data_sharded=False, tp_sharded=False) == ("dp", "cp", "tp")
    assert replicated_over(data_sharded=True, tp_sharded=True) == ("dp_replicate",)  # a ZeRO shard of a tp slice


@pytest.mark.parametrize("pp, dp, tp", [(1, 4, 1), (2, 3, 2), (4, 1, 2), (3, 2, 1)])
def test_every_rank_is_in_exactly_one_group_per_axis(pp, dp, tp):
    shape = MeshShape(pp=pp, dp=dp, tp=tp)
    for axis in ("pp", "dp", "tp"):
        members = sorted(r for g in shape.groups(axis) for r in g)
        assert members == list(range(shape.world_size))
        for group in shape.groups(axis):
            assert len(group) == shape.size(axis)
            coords = [shape.coords(r) for r in group]
            assert [c[axis] for c in coords] == list(range(shape.size(axis)))
    for r in range(shape.world_size):
        assert shape.rank_of(**shape.coords(r)) == r


@pytest.mark.parametrize("shape, count", [(MeshShape(), 0), (MeshShape(dp=2), 2), (MeshShape(pp=2, dp=2, tp=2), 4),
                                          (MeshShape(pp=2, dp=1, tp=2), 3), (MeshShape(dp=4, dp_shard=2), 4)])
def test_each_rank_joins_the_world_group_and_one_per_axis_of_several_ranks(shape, count):
    """What `--mem-budget auto` counts an NCCL communicator for: the default group and each group of > 1 rank."""
    assert shape.num_communicators() == count
    assert count == (shape.world_size > 1) + sum(len(g) > 1 for a in shape.axes for g in shape.groups(a) if 0 in g)


def test_degrees_must_multiply_to_the_world():
    assert MeshShape.for_world(8, tp=2) == MeshShape(pp=1, dp=4, tp=2)
    with pytest.raises(MeshError, match=r"pp × dp × tp = 1 × 3 × 2 = 6 but the world has 8"):
        MeshShape.for_world(8, dp=3, tp=2)
    with pytest.raises(MeshError, match="not divisible by tp × pp = 3 × 1"):
        MeshShape.for_world(8, tp=3)
    with pytest.raises(MeshError, match="--tp must be at least 1"):
        MeshShape(tp=0)


def _counted(rank, world):
    mesh = build_mesh(MeshShape(dp=world))
    comm = Comm(mesh)
    x = torch.ones(1000)
    comm.all_reduce(x, "dp")
    out = torch.empty(1000 * world)
    comm.all_gather(out, torch.full((1000,), float(rank)), "dp")
    shard = torch.empty(1000)
    comm.reduce_scatter(shard, torch.ones(1000 * world), "dp")
    comm.all_reduce(torch.ones(10), "tp")  # a group of one: nothing to send
    summary = comm.summary()
    # In place (the output is this rank's chunk of the input), as ZeRO-1 reduces its buckets.
    whole = torch.arange(1000.0 * world) + rank
    with Collectives() as issued:
        comm.reduce_scatter(whole.view(world, -1)[rank], whole, "dp")
    mine = whole.view(world, -1)[rank]
    expected = world * torch.arange(1000.0 * world).view(world, -1)[rank] + sum(range(world))
    return (summary, x[0].item(), out.view(world, -1)[:, 0].tolist(), shard[0].item(),
            torch.equal(mine, expected), issued.bytes, comm.summary()["dp"]["reduce_scatter"])


def test_comm_counts_ring_bytes_and_results_are_right():
    summary, reduced, gathered, scattered, in_place_right, issued, counted = run_on_ranks(_counted, 4, timeout=60)[0]
    assert reduced == 4 and gathered == [0, 1, 2, 3] and scattered == 4
    assert summary["dp"]["all_reduce"] == {"calls": 1, "bytes": 2 * 4000 * 3 // 4}
    assert summary["dp"]["all_gather"] == {"calls": 1, "bytes": 4 * 4000 * 3 // 4}
    assert summary["dp"]["reduce_scatter"] == {"calls": 1, "bytes": 4 * 4000 * 3 // 4}
    assert "tp" not in summary
    # A reduce-scatter into its own input leaves the rank's chunk reduced; on gloo, whose
    # reduce-scatter sends an all-reduce's bytes anyway, it is issued as that all-reduce (no
    # copies), and still counted as the reduce-scatter it stands for.
    assert in_place_right
    assert list(issued.values()) == [2 * 16000 * 3 / 4] and counted == {"calls": 2, "bytes": 2 * 4 * 4000 * 3 // 4}


def test_each_comm_resolves_its_own_meshs_axes_once_and_alike():
    """What a collective reads per axis (`Comm.axes`) is what the mesh answers, on every axis of a mesh whose data
    axis is split twice (hybrid shards, expert blocks) and flattened with cp, for each of two meshes in one process."""
    shapes = [MeshShape(pp=2, dp=4, cp=2, tp=2, dp_shard=2, ep=2), MeshShape(dp=2, tp=2)]
    for shape in shapes:
        comms = [Comm(Mesh(shape=shape, rank=rank, groups={axis: f"{axis}@{rank}" for axis in shape.axes}))
                 for rank in range(shape.world_size)]
        for rank, comm in enumerate(comms):
            mesh = comm.mesh
            for axis in Axis:
                on = comm.axes[axis]
                assert (on.group, on.size, on.coord, list(on.ranks)) == \
                    (mesh.group(axis), mesh.size(axis), mesh.coord(axis), mesh.ranks(axis)), (shape, rank, axis)
                assert on.ranks[on.coord] == rank and len(on.ranks) == on.size


def _world_groups(rank, world):
    import torch.distributed as dist

    whole, split = build_mesh(MeshShape(dp=world)), build_mesh(MeshShape(dp=world // 2, tp=2))
    total = torch.ones(3)
    Comm(whole).all_reduce(total, WORLD)
    return (whole.group(WORLD) is whole.group("dp"), split.group(WORLD) is dist.group.WORLD,
            split.group(WORLD) not in (split.group("dp"), split.group("tp")), total.tolist())


def test_the_agreement_shares_the_group_of_an_axis_that_is_the_whole_world():
    """One process group over the world, not two: with dp alone the mesh-wide group is dp's (whose last
    collective, the gradients', came just before the agreement); with dp × tp it is the default group."""
    for shared, default, apart, total in run_on_ranks(_world_groups, 4, timeout=60):
        assert shared and default and apart and total == [4.0, 4.0, 4.0]


def _late_receiver(rank, world):
    """Rank 1 posts its receive only after rank 0's exchange has returned: a deferred send must not wait for it."""
    import datetime

    import torch.distributed as dist

    mesh = build_mesh(MeshShape(dp=world))
    comm = Comm(mesh)
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=30))
    if rank == 0:
        comm.exchange([(torch.arange(5.0), 1)], [], "dp", defer_sends=True)
        store.set("sender returned", "yes")
        comm.settle_sends("dp")  # completes once rank 1 has received
        return None
    store.wait(["sender returned"])  # raises after 30 s if the sender is still blocked in its exchange
    received = torch.empty(5)
    comm.exchange([], [(received, 0)], "dp")
    return received.tolist()


def test_a_deferred_send_returns_before_its_receive_is_posted():
    assert run_on_ranks(_late_receiver, 2, timeout=60)[1] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_cp_sits_between_dp_and_tp_and_its_gradients_group_spans_dp_and_cp():
    """pp × dp × cp × tp: a cp group is tp-strided neighbours; dp × cp reduces the gradients."""
    shape = MeshShape(pp=2, dp=2, cp=2, tp=2)
    assert shape.world_size == 16
    assert {a: shape.coords(6)[a] for a in ("pp", "dp", "cp", "tp")} == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}
    assert shape.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert shape.groups("cp")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert shape.groups("dp")[:2] == [[0, 4], [1, 5]]
    assert shape.groups("pp")[0] == [0, 8]
    assert shape.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    for axis in ("pp", "dp", "cp", "tp", "dp_cp"):
        assert sorted(r for g in shape.groups(axis) for r in g) == list(range(16))
        for group in shape.groups(axis):
            assert [shape.coords(r)[axis] for r in group] == list(range(shape.size(axis)))
    for r in range(16):
        assert shape.rank_of(**shape.coords(r)) == r
    assert "dp_cp" in shape.axes and "dp_cp" not in MeshShape(dp=4).axes
    assert MeshShape.for_world(8, cp=2, tp=2) == MeshShape(dp=2, cp=2, tp=2)
    with pytest.raises(MeshError, match=r"not divisible by tp × cp × pp = 1 × 3 × 1"):
        MeshShape.for_world(8, cp=3)
    with pytest.raises(MeshError, match="--cp must be at least 1"):
        MeshShape(cp=0)
