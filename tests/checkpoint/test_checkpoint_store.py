"""Checkpoint storage: format, resharding reads, commit protocol, integrity, retention, faults, async, 2 ranks.

Most tests run in one process. Saves "from several ranks" run each rank in a
thread of this process with `ThreadCoordinator`, which implements the
coordinator interface with a barrier, so the whole protocol (one file per
rank, fragments, rank 0's commit) runs without processes. Two tests use real
gloo ranks: a save through DistCoordinator (and an async save on its own
group), and a rank killed after writing its shard.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from paratrain import faults
from paratrain.checkpoint import (
    AsyncCheckpointer, CheckpointError, CheckpointReader, CheckpointWarning, CorruptCheckpointError, check_free_space,
    DistCoordinator, IncompatibleCheckpointError, LocalCoordinator, ShardSpec, decode_state, encode_state,
    find_latest, list_checkpoints, quarantine_incomplete, read_latest_pointer, save_checkpoint, verify_checkpoint,
)
from paratrain.checkpoint.boxes import find_overlap, intersect
from paratrain.checkpoint.files import exchange_dirs, write_shard_file
from paratrain.checkpoint.store import apply_retention
from paratrain.testing import RankFailure, run_on_ranks

LOCAL = LocalCoordinator()


# -- helpers ------------------------------------------------------------------


class ThreadCoordinator:
    """The coordinator interface for ranks that are threads of one process."""

    def __init__(self, shared: dict, rank: int, world_size: int):
        self.shared, self.rank, self.world_size = shared, rank, world_size

    def barrier(self) -> None:
        self.shared["barrier"].wait()

    def broadcast_object(self, obj):
        if self.rank == 0:
            self.shared["slots"][0] = json.loads(json.dumps(obj))
        self.barrier()
        value = self.shared["slots"][0]
        self.barrier()
        return value

    def gather_objects(self, obj):
        self.shared["slots"][self.rank] = json.loads(json.dumps(obj))
        self.barrier()
        value = list(self.shared["slots"]) if self.rank == 0 else None
        self.barrier()
        return value


def on_threads(world_size: int, fn):
    """Run fn(rank, coordinator) on world_size threads; per rank its return value or the exception it raised."""
    shared = {"barrier": threading.Barrier(world_size, timeout=30), "slots": [None] * world_size}
    results: list = [None] * world_size

    def body(rank):
        try:
            results[rank] = fn(rank, ThreadCoordinator(shared, rank, world_size))
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def row_box(d0: int, n: int, r: int) -> tuple[int, int]:
    """ZeRO's rows of rank r of n: [r·c, min((r+1)·c, d0)), c = ceil(d0 / n)."""
    c = math.ceil(d0 / n)
    return min(r * c, d0), min((r + 1) * c, d0)


def layout_boxes(shape: tuple[int, ...], layout: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offset, shape) per rank of a named layout of a 2-D tensor (rank order: dp outer, tp inner)."""
    d0, d1 = shape
    if layout.startswith("dp") and layout[2:].isdigit():
        n = int(layout[2:])
        return [((lo, 0), (hi - lo, d1)) for lo, hi in (row_box(d0, n, r) for r in range(n))]
    if layout == "tp2_cols":
        return [((0, k * d1 // 2), (d0, d1 // 2)) for k in range(2)]
    if layout == "tp2_rows":
        return [((k * d0 // 2, 0), (d0 // 2, d1)) for k in range(2)]
    if layout == "dp2_tp2":  # ZeRO rows of a tensor-parallel column chunk
        boxes = []
        for dp in range(2):
            for tp in range(2):
                lo, hi = row_box(d0, 2, dp)
                boxes.append(((lo, tp * d1 // 2), (hi - lo, d1 // 2)))
        return boxes
    if layout == "tp2_rows_dp2":  # ZeRO rows inside a tensor-parallel row chunk
        boxes = []
        for dp in range(2):
            for tp in range(2):
                lo, hi = row_box(d0 // 2, 2, dp)
                boxes.append(((tp * d0 // 2 + lo, 0), (hi - lo, d1)))
        return boxes
    raise ValueError(layout)


def shard_of(full: torch.Tensor, name: str, offset, shape) -> tuple[ShardSpec, torch.Tensor]:
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return ShardSpec(name, tuple(full.shape), tuple(offset)), full[index].clone()


def save_layout(root: Path, step: int, tensors: dict[str, torch.Tensor], layout: str, **kwargs) -> list:
    """Save 2-D `tensors` split by `layout`, one thread-rank per box; the per-rank results."""
    boxes = {name: layout_boxes(tuple(t.shape), layout) for name, t in tensors.items()}
    world = len(next(iter(boxes.values())))

    def rank_fn(rank, coordinator):
        shards = {name: shard_of(t, name, *boxes[name][rank]) for name, t in tensors.items()}
        return save_checkpoint(root, step, shards, {"rank": rank}, {"step": step}, coordinator=coordinator,
                               on_event=faults.checkpoint_events(rank), **kwargs)

    return on_threads(world, rank_fn)


def save_simple(root: Path, step: int, value: float = 0.0, **kwargs) -> Path:
    """A one-process checkpoint of two small tensors whose contents depend on `value`."""
    shards = {"w": (ShardSpec("w", (4, 3), (0, 0)), torch.full((4, 3), value)),
              "b": (ShardSpec("b", (3,), (0,)), torch.arange(3.0) + value)}
    return save_checkpoint(root, step, shards, {"seed": step}, {"step": step}, coordinator=LOCAL,
                           on_event=faults.checkpoint_events(0), **kwargs)


def hidden_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# -- pure parts: boxes, state encoding, file format ---------------------------------


def test_boxes_intersect_and_overlap():
    assert intersect((0, 0), (4, 4), (2, 2), (4, 4)) == ((2, 2), (2, 2))
    assert intersect((0, 0), (2, 4), (2, 0), (2, 4)) is None  # touching rows share nothing
    assert intersect((0,), (0,), (0,), (5,)) is None  # an empty box overlaps nothing
    assert intersect((), (), (), ()) == ((), ())  # scalars
    rows = [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (3, 6)), ((9, 0), (0, 6))]
    assert find_overlap(rows) is None
    assert find_overlap(layout_boxes((8, 6), "dp2_tp2")) is None
    assert find_overlap(rows + [((2, 5), (2, 1))]) in {(0, 4), (4, 1), (1, 4), (4, 0)}
    assert find_overlap([((), ()), ((), ())]) == (0, 1)


def test_state_round_trip_keeps_tensors_bytes_and_non_finite_floats():
    rng = torch.get_rng_state()
    state = {"rng": rng, "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "empty": torch.zeros(0, 3),
             "blob": b"\x00\xff", "best": float("inf"), "nan": float("nan"), "nested": {"a": [1, (2, 3)]},
             "none": None, "flag": True}
    encoded = encode_state(state)
    text = json.dumps(encoded, allow_nan=False)  # strict JSON
    back = decode_state(json.loads(text))
    assert torch.equal(back["rng"], rng) and back["rng"].dtype == torch.uint8
    assert torch.equal(back["bf16"], state["bf16"]) and back["bf16"].dtype == torch.bfloat16
    assert back["empty"].shape == (0, 3)
    assert back["blob"] == b"\x00\xff" and back["best"] == float("inf") and math.isnan(back["nan"])
    assert back["nested"] == {"a": [1, [2, 3]]} and back["none"] is None and back["flag"] is True


@pytest.mark.parametrize("bad, message", [
    ({"a": {1: "x"}}, r"state\['a'\] has the key 1 of type int"),
    ({"a": [object()]}, r"state\['a'\]\[0\] is a object"),
    ({"__tensor__": 1}, "reserved key"),
])
def test_state_encoding_names_the_bad_value(bad, message):
    with pytest.raises(CheckpointError, match=message):
        encode_state(bad)


def test_shard_files_are_standard_safetensors(tmp_path):
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "i64": torch.arange(4),
               "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 4),
               "strided": torch.randn(4, 6)[:, ::2]}
    digest = write_shard_file(tmp_path / "x.safetensors", tensors)
    assert digest.size == (tmp_path / "x.safetensors").stat().st_size
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert loaded.keys() == tensors.keys()
    for key, t in tensors.items():
        assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), key
    with pytest.raises(FileExistsError):  # never overwrites
        write_shard_file(tmp_path / "x.safetensors", tensors)


def test_exchange_dirs_swaps_contents(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from_a").touch()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "from_b").touch()
    if not exchange_dirs(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this system")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["from_b"]
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["from_a"]


# -- saving and resharding reads -------------------------------------------------------


@pytest.mark.parametrize("layout, shape", [
    ("dp4", (10, 6)),          # rows 3, 3, 3, 1
    ("dp4", (5, 6)),           # rows 2, 2, 1, 0: the last rank holds nothing
    ("tp2_cols", (8, 6)),
    ("dp2_tp2", (7, 6)),       # rows of column chunks
    ("tp2_rows_dp2", (8, 6)),  # rows of row chunks
])
def test_any_layout_reads_back_bit_exactly_in_any_box(tmp_path, layout, shape):
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(shape, generator=gen), "h": torch.randn(shape, generator=gen).to(torch.bfloat16)}
    results = save_layout(tmp_path, 3, tensors, layout)
    assert all(r == tmp_path / "step-00000003" for r in results), results
    world = len(results)
    with CheckpointReader(tmp_path / "step-00000003") as ckpt:
        assert ckpt.num_saved_ranks == world and ckpt.names() == ["h", "w"]
        assert ckpt.global_shape("w") == shape and ckpt.dtype("h") == torch.bfloat16
        rnd = random.Random(1)
        for name, full in tensors.items():
            assert torch.equal(ckpt.read(name), full)
            for other in ("dp3", "tp2_cols", "dp2_tp2"):  # another layout's shards
                for offset, extent in layout_boxes(shape, other):
                    index = tuple(slice(o, o + n) for o, n in zip(offset, extent))
                    assert torch.equal(ckpt.read(name, offset, extent), full[index])
            for _ in range(20):  # arbitrary boxes
                lo = [rnd.randrange(d) for d in shape]
                extent = [rnd.randrange(d - o + 1) for o, d in zip(lo, shape)]
                index = tuple(slice(o, o + n) for o, n in zip(lo, extent))
                assert torch.equal(ckpt.read(name, lo, extent), full[index])
        assert ckpt.read("h", dtype=torch.float32).dtype == torch.float32
        assert [ckpt.rank_state(r) for r in range(world)] == [{"rank": r} for r in range(world)]
    files = sorted(p.name for p in (tmp_path / "step-00000003").iterdir())
    assert files == ["index.json", "manifest.json"] + [f"rank-{r:05d}.safetensors" for r in range(world)]
    assert hidden_entries(tmp_path) == []


def test_one_rank_may_hold_several_boxes_and_3d_tensors(tmp_path):
    full = torch.randn(4, 5, 6)
    shards = {f"x.{k}": shard_of(full, "x", (0, 0, 3 * k), (4, 5, 3)) for k in range(2)}
    shards["s"] = (ShardSpec("s", (), ()), torch.tensor(7, dtype=torch.int32))
    path = save_checkpoint(tmp_path, 0, shards, coordinator=LOCAL)
    ckpt = CheckpointReader(path)
    assert torch.equal(ckpt.read("x"), full)
    assert torch.equal(ckpt.read("x", (1, 2, 2), (2, 3, 2)), full[1:3, 2:5, 2:4])
    assert ckpt.read("s").item() == 7 and ckpt.read("s").dim() == 0
    assert ckpt.shared_state() == {} and ckpt.rank_state(0) == {}


def test_read_errors_name_the_tensor_and_box(tmp_path):
    path = save_simple(tmp_path, 1)
    ckpt = CheckpointReader(path)
    with pytest.raises(CheckpointError, match="has no tensor 'ww'; did you mean 'w'"):
        ckpt.read("ww")
    with pytest.raises(CheckpointError, match=r"offset \[2, 0\] shape \[3, 3\] is not a box inside .*\[4, 3\]"):
        ckpt.read("w", (2, 0), (3, 3))
    with pytest.raises(CheckpointError, match="no state of rank 1"):
        ckpt.rank_state(1)
    with pytest.raises(CorruptCheckpointError, match=r"is a checkpoint root, not a checkpoint; .* find_latest\("):
        CheckpointReader(tmp_path)
    # An index that lost a box (only reachable by editing it): a clear partial-coverage error.
    full = torch.randn(4, 3)
    halves = {f"w.{k}": shard_of(full, "w", (2 * k, 0), (2, 3)) for k in range(2)}
    path = save_checkpoint(tmp_path, 2, halves, coordinator=LOCAL)
    index = json.loads((path / "index.json").read_text())
    del index["tensors"]["w"]["boxes"][1]
    (path / "index.json").write_text(json.dumps(index))
    ckpt = CheckpointReader(path, verify=False)
    assert torch.equal(ckpt.read("w", (0, 1), (2, 2)), full[:2, 1:])
    with pytest.raises(CheckpointError, match=r"tensor 'w' at offset \[1, 0\] shape \[3, 3\] is only partly "
                                              r"stored \(3 of 9 elements\)"):
        ckpt.read("w", (1, 0), (3, 3))
    # The stored shape of a box is checked against the index.
    index["tensors"]["w"]["boxes"][0]["shape"] = [1, 3]
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000\.safetensors holds 'w\.0' with shape \[2, 3\], "
                                                     r"but index\.json says \[1, 3\]"):
        CheckpointReader(path, verify=False).read("w", (0, 0), (1, 3))


def test_overlapping_boxes_from_two_ranks_are_refused(tmp_path):
    save_simple(tmp_path, 1)
    full = torch.randn(4, 3)

    def both_save_the_replicated_tensor(rank, coordinator):
        return save_checkpoint(tmp_path, 2, {"w": shard_of(full, "w", (0, 0), (4, 3))}, coordinator=coordinator)

    results = on_threads(2, both_save_the_replicated_tensor)
    for r in results:
        assert isinstance(r, CheckpointError), r
        assert "internal error: tensor 'w' is saved twice" in str(r) and "rank 0" in str(r) and "rank 1" in str(r)
        assert "last good checkpoint step-00000001 intact" in str(r)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert hidden_entries(tmp_path) == []


@pytest.mark.parametrize("case, message", [
    ("gap", r"tensor 'w': the saved shards cover 6 of its 12 elements"),
    ("shape", r"tensor 'w': rank 0 saved it as \[4, 3\] float32 but rank 1 as \[4, 4\] float32"),
    ("dtype", r"rank 0 saved it as \[4, 3\] float32 but rank 1 as \[4, 3\] float64"),
    ("bounds", r"rank 1: shard of 'w': local shape \[2, 3\] at offset \[3, 0\] exceeds the global shape"),
    ("step", r"rank 1 saved step 6 while rank 0 saved step 5; every rank must save the same step"),
    ("state", r"rank 1: rank_state\['f'\] is a builtin_function_or_method, which checkpoint state"),
])
def test_inconsistent_saves_fail_on_every_rank_with_one_message(tmp_path, case, message):
    full = torch.randn(4, 3)

    def rank_fn(rank, coordinator):
        spec, t = shard_of(full, "w", (2 * rank, 0), (2, 3))
        state = {}
        if rank == 1 and case == "gap":
            return save_checkpoint(tmp_path, 5, {}, coordinator=coordinator)
        if rank == 1 and case == "shape":
            spec = ShardSpec("w", (4, 4), (2, 0))
            t = torch.randn(2, 4)
        if rank == 1 and case == "dtype":
            t = t.double()
        if rank == 1 and case == "bounds":
            spec = ShardSpec("w", (4, 3), (3, 0))
        if rank == 1 and case == "state":
            state = {"f": print}
        step = 6 if rank == 1 and case == "step" else 5
        return save_checkpoint(tmp_path, step, {"w": (spec, t)}, state, coordinator=coordinator)

    results = on_threads(2, rank_fn)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert str(results[0]) == str(results[1])
    assert results[0].args[0].count("\n") == 0
    assert results[0].args[0].startswith("saving step-00000005 failed: ")
    assert re.search(message, str(results[0])), str(results[0])
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_per_rank_state_returns_to_its_rank_and_shared_state_comes_from_rank_0(tmp_path):
    def rank_fn(rank, coordinator):
        gen = torch.Generator().manual_seed(100 + rank)
        rng = gen.get_state()
        shards = {"w": shard_of(torch.ones(3, 2), "w", (rank, 0), (1, 2))}
        path = save_checkpoint(tmp_path, 9, shards, {"rng": rng, "sampler": {"epoch": 1, "offset": 10 * rank}},
                               {"step": 9, "from": rank}, coordinator=coordinator)
        return path, rng

    results = on_threads(3, rank_fn)
    ckpt = CheckpointReader(results[0][0])
    for rank, (_, rng) in enumerate(results):
        state = ckpt.rank_state(rank)
        assert torch.equal(state["rng"], rng) and state["sampler"] == {"epoch": 1, "offset": 10 * rank}
    assert not torch.equal(ckpt.rank_state(0)["rng"], ckpt.rank_state(1)["rng"])
    assert ckpt.shared_state() == {"step": 9, "from": 0}


# -- integrity -------------------------------------------------------------------------------


@pytest.fixture
def two_rank_checkpoint(tmp_path) -> Path:
    tensors = {"w": torch.randn(8, 6)}
    save_layout(tmp_path, 8, tensors, "dp2")
    return tmp_path / "step-00000008"


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"step-00000008 invalid: rank-00001\.safetensors size (\d+) ≠ expected (\d+)$"),
    ("flip", r"step-00000008 invalid: checksum mismatch in rank-00001\.safetensors$"),
    ("delete", r"step-00000008 invalid: rank-00001\.safetensors is missing$"),
    ("no_manifest", r"step-00000008 invalid: incomplete checkpoint, no commit marker \(manifest\.json missing\)$"),
    ("garbage_manifest", r"step-00000008 invalid: manifest\.json is not valid JSON \("),
    ("binary_manifest", r"step-00000008 invalid: manifest\.json is not valid JSON \("),
    ("manifest_schema", r"step-00000008 invalid: manifest\.json: field 'files' must be a JSON dict"),
    ("garbage_index", r"step-00000008 invalid: checksum mismatch in index\.json$"),
])
def test_verify_names_the_damaged_file(two_rank_checkpoint, damage, message):
    path = two_rank_checkpoint
    verify_checkpoint(path)
    shard = path / "rank-00001.safetensors"
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "flip":
        _flip_byte(shard, shard.stat().st_size - 3)
    elif damage == "delete":
        shard.unlink()
    elif damage == "no_manifest":
        (path / "manifest.json").unlink()
    elif damage == "garbage_manifest":
        (path / "manifest.json").write_text("{not json")
    elif damage == "binary_manifest":
        (path / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "manifest_schema":
        doc = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**doc, "files": []}))
    elif damage == "garbage_index":
        (path / "index.json").write_text("x" * (path / "index.json").stat().st_size)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        verify_checkpoint(path)
    if damage == "truncate":
        got, expected = map(int, info.value.args[0].rsplit("size ", 1)[1].split(" ≠ expected "))
        assert got == expected // 2
    with pytest.raises(CorruptCheckpointError, match=message):
        CheckpointReader(path)  # an explicitly named invalid checkpoint is never loaded


def test_index_parse_errors_are_clear_even_with_a_matching_manifest(two_rank_checkpoint):
    from paratrain.checkpoint.files import file_digest
    path = two_rank_checkpoint

    def replace_index(text: str) -> None:
        (path / "index.json").write_text(text)
        manifest = json.loads((path / "manifest.json").read_text())
        digest = file_digest(path / "index.json")
        manifest["files"]["index.json"] = {"size": digest.size, "sha256": digest.sha256}
        (path / "manifest.json").write_text(json.dumps(manifest))

    original = json.loads((path / "index.json").read_text())
    replace_index("garbage")
    with pytest.raises(CorruptCheckpointError, match=r"^step-00000008 invalid: index\.json is not valid JSON"):
        verify_checkpoint(path)
    del original["tensors"]["w"]["boxes"][0]["offset"]
    replace_index(json.dumps(original))
    with pytest.raises(CorruptCheckpointError, match=r"index\.json: tensor 'w' box 0: field 'offset' is missing"):
        verify_checkpoint(path)
    original["tensors"]["w"]["boxes"][0]["offset"] = [0, 0]
    original["tensors"]["w"]["boxes"][0]["file"] = "rank-00009.safetensors"
    replace_index(json.dumps(original))
    with pytest.raises(CorruptCheckpointError, match=r"refers to rank-00009\.safetensors, which manifest\.json"):
        verify_checkpoint(path)


def test_assets_are_kept_whole_and_verified_like_the_data(tmp_path):
    """Rank 0's assets land whole under assets/ and in the manifest, from a sync, a multi-rank or an async save; a
    damaged or missing one fails verification naming it; a name that is a path is refused, nothing committed."""
    tokenizer = json.dumps({"model": {"type": "BPE"}}).encode() * 40
    path = save_simple(tmp_path, 1, assets={"tokenizer.json": tokenizer, "config.json": b"{}"})
    assert (path / "assets" / "tokenizer.json").read_bytes() == tokenizer
    assert {"assets/tokenizer.json", "assets/config.json"} <= json.loads((path / "manifest.json").read_text())["files"].keys()
    verify_checkpoint(path)
    _flip_byte(path / "assets" / "tokenizer.json", 10)
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in assets/tokenizer\.json$"):
        verify_checkpoint(path)
    (path / "assets" / "config.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"assets/config\.json is missing"):
        verify_checkpoint(path, checksums=False)
    with pytest.raises(CheckpointError, match=r"asset '\.\./escape\.json' is not a plain file name"):
        save_simple(tmp_path, 2, assets={"../escape.json": b"x"})
    assert list_checkpoints(tmp_path) == [path] and not (tmp_path / "escape.json").exists()

    ranks = save_layout(tmp_path / "dp2", 3, {"w": torch.ones(4, 2)}, "dp2", assets={"a.txt": b"rank 0's"})
    assert (ranks[0] / "assets" / "a.txt").read_bytes() == b"rank 0's"
    verify_checkpoint(ranks[0])
    saver = AsyncCheckpointer(tmp_path / "async", coordinator=LOCAL)
    saver.save(4, {"b": (ShardSpec("b", (3,), (0,)), torch.arange(3.0))}, assets={"a.txt": b"async"})
    committed = saver.wait()
    assert (committed / "assets" / "a.txt").read_bytes() == b"async"
    verify_checkpoint(committed)


def test_find_latest_skips_invalid_newer_checkpoints_with_a_warning(tmp_path):
    for step in (4, 8, 12):
        save_simple(tmp_path, step, value=step)
    assert find_latest(tmp_path) == tmp_path / "step-00000012"
    os.truncate(tmp_path / "step-00000012" / "rank-00000.safetensors", 10)
    (tmp_path / "step-00000016").mkdir()  # a step directory without a commit marker
    with pytest.warns(CheckpointWarning) as record:
        found = find_latest(tmp_path)
    assert found == tmp_path / "step-00000008"
    messages = [str(w.message) for w in record]
    assert messages[0].startswith("step-00000016 invalid: incomplete checkpoint, no commit marker")
    assert messages[1].startswith("step-00000012 invalid: rank-00000.safetensors size 10 ≠ expected")
    assert torch.equal(CheckpointReader(found).read("b"), torch.arange(3.0) + 8)
    _flip_byte(tmp_path / "step-00000008" / "rank-00000.safetensors", -1)
    with pytest.warns(CheckpointWarning):
        assert find_latest(tmp_path) == tmp_path / "step-00000004"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_latest(tmp_path / "nowhere") is None


def test_quarantine_moves_leftovers_of_dead_saves(tmp_path):
    save_simple(tmp_path, 4)
    (tmp_path / ".tmp-step-00000008-abcd").mkdir()
    (tmp_path / ".tmp-step-00000008-abcd" / "rank-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "step-00000012").mkdir()
    (tmp_path / ".deleting-step-00000001-ff").mkdir()
    with pytest.warns(CheckpointWarning, match="incomplete checkpoint, no commit marker"):
        moved = quarantine_incomplete(tmp_path)
    assert sorted(p.name for p in moved) == [".deleting-step-00000001-ff", ".incomplete-step-00000008-abcd",
                                             ".incomplete-step-00000012"]
    assert hidden_entries(tmp_path) == [".incomplete-step-00000008-abcd", ".incomplete-step-00000012"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004"]
    (tmp_path / ".tmp-step-00000016-0000").mkdir()
    with pytest.warns(CheckpointWarning, match="deleted"):
        quarantine_incomplete(tmp_path, delete=True)
    assert hidden_entries(tmp_path) == [".incomplete-step-00000008-abcd", ".incomplete-step-00000012"]
    verify_checkpoint(tmp_path / "step-00000004")


# -- retention, latest, re-saving ----------------------------------------------------------------


def test_retention_keeps_the_newest_and_latest_follows_commits(tmp_path):
    for step in range(1, 6):
        save_simple(tmp_path, step, keep_latest=2)
        assert read_latest_pointer(tmp_path) == f"step-{step:08d}"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    assert hidden_entries(tmp_path) == []
    # A lower step committed after higher ones survives its own retention, with a warning.
    with pytest.warns(CheckpointWarning, match="committed step-00000002 while newer step-00000005 exists"):
        save_simple(tmp_path, 2, keep_latest=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000005"]
    assert read_latest_pointer(tmp_path) == "step-00000002"


def test_a_failing_purge_only_warns(tmp_path, monkeypatch):
    save_simple(tmp_path, 1)

    def fail(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("paratrain.checkpoint.store.shutil.rmtree", fail)
    with pytest.warns(CheckpointWarning, match="could not delete old checkpoint step-00000001"):
        path = save_simple(tmp_path, 2, keep_latest=1)
    verify_checkpoint(path)
    assert apply_retention(tmp_path, 1, path) == []


def test_resaving_a_committed_step_is_refused_without_overwrite(tmp_path):
    path = save_simple(tmp_path, 8, value=1.0)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(CheckpointError, match=r"step-00000008 already exists; pass overwrite=True"):
        save_simple(tmp_path, 8, value=2.0)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert hidden_entries(tmp_path) == []


@pytest.mark.parametrize("atomic_swap", [True, False])
def test_overwrite_replaces_a_step_only_once_the_new_save_is_committed(tmp_path, monkeypatch, atomic_swap):
    path = save_simple(tmp_path, 8, value=1.0)
    if not atomic_swap:
        monkeypatch.setattr("paratrain.checkpoint.save.exchange_dirs", lambda a, b: False)
    # A failed re-save leaves the old checkpoint as it was.
    monkeypatch.setenv(faults.FAULT_ENV, "ckpt_enospc@rank0:step8")
    with pytest.raises(CheckpointError, match="no space left on device"):
        save_simple(tmp_path, 8, value=2.0, overwrite=True)
    verify_checkpoint(path)
    assert torch.equal(CheckpointReader(path).read("w"), torch.full((4, 3), 1.0))
    monkeypatch.delenv(faults.FAULT_ENV)
    assert save_simple(tmp_path, 8, value=2.0, overwrite=True) == path
    verify_checkpoint(path)
    assert torch.equal(CheckpointReader(path).read("w"), torch.full((4, 3), 2.0))
    assert hidden_entries(tmp_path) == []


def test_a_failed_replacement_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    path = save_simple(tmp_path, 8, value=1.0)
    monkeypatch.setattr("paratrain.checkpoint.save.exchange_dirs", lambda a, b: False)
    real_rename = os.rename

    def rename(src, dst):
        new = Path(src).name.startswith(".tmp-") and not Path(src).name.endswith("-replaced")
        if new and Path(dst).name == "step-00000008":
            raise OSError(5, "Input/output error", str(dst))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="could not write step-00000008: Input/output error; "
                                              "last good checkpoint step-00000008 intact"):
        save_simple(tmp_path, 8, value=2.0, overwrite=True)
    monkeypatch.undo()
    verify_checkpoint(path)
    assert torch.equal(CheckpointReader(path).read("w"), torch.full((4, 3), 1.0))
    assert hidden_entries(tmp_path) == []


# -- disk full -------------------------------------------------------------------------------------


def test_disk_full_reports_the_file_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    save_simple(tmp_path, 4)
    monkeypatch.setenv(faults.FAULT_ENV, "ckpt_enospc@rank0:step8")
    with pytest.raises(CheckpointError) as info:
        save_simple(tmp_path, 8)
    assert str(info.value) == ("saving step-00000008 failed: rank 0: no space left on device while writing "
                               "rank-00000.safetensors; last good checkpoint step-00000004 intact")
    assert hidden_entries(tmp_path) == [] and read_latest_pointer(tmp_path) == "step-00000004"
    assert find_latest(tmp_path) == tmp_path / "step-00000004"
    monkeypatch.setenv(faults.RESTART_ENV, "1")  # the fault is for attempt 0 only
    save_simple(tmp_path, 8)


def test_disk_full_on_one_rank_fails_the_save_on_all(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "ckpt_enospc@rank1:step2")
    results = save_layout(tmp_path, 2, {"w": torch.randn(6, 4)}, "dp3")
    assert all(isinstance(r, CheckpointError) for r in results)
    assert str(results[2]) == ("saving step-00000002 failed: rank 1: no space left on device while writing "
                               f"rank-00001.safetensors; no earlier checkpoint in {tmp_path}")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_while_rank_0_commits(tmp_path, monkeypatch):
    save_simple(tmp_path, 4)
    real = __import__("paratrain.checkpoint.save", fromlist=["write_durable"]).write_durable

    def full_at_manifest(path, text):
        if path.name == "manifest.json":
            raise OSError(28, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr("paratrain.checkpoint.save.write_durable", full_at_manifest)
    with pytest.raises(CheckpointError, match=r"no space left on device while writing manifest\.json; "
                                              r"last good checkpoint step-00000004 intact"):
        save_simple(tmp_path, 8)
    assert hidden_entries(tmp_path) == []


def test_an_unexpected_error_in_rank_0s_commit_still_reaches_every_rank(tmp_path, monkeypatch):
    def broken(step, fragments):
        raise TypeError("bug")

    monkeypatch.setattr("paratrain.checkpoint.save.build_index", broken)
    results = save_layout(tmp_path, 3, {"w": torch.randn(4, 2)}, "dp2")
    assert [str(r) for r in results] == [f"saving step-00000003 failed: internal error while writing "
                                         f"step-00000003: TypeError: bug; no earlier checkpoint in {tmp_path}"] * 2
    assert list(tmp_path.iterdir()) == []


def test_free_space_preflight(tmp_path):
    check_free_space(tmp_path / "not" / "yet", 1)
    with pytest.raises(CheckpointError, match=r"a checkpoint needs about 1073741824\.0 GiB but only .* is free"):
        check_free_space(tmp_path, 1 << 60)


# -- compatibility ---------------------------------------------------------------------------------


def test_check_compatible_names_tensor_shapes_dtypes_and_keys(tmp_path):
    ckpt = CheckpointReader(save_simple(tmp_path, 1))
    ok = {"w": ((4, 3), torch.float32), "b": (torch.Size([3]), "float32")}
    assert ckpt.check_compatible(ok).missing == ()
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"^step-00000001 does not match the model: tensor 'w' is \[4, 3\] float32 in the "
                             r"checkpoint but \[4, 8\] float32 is expected$"):
        ckpt.check_compatible({**ok, "w": ((4, 8), torch.float32)})
    with pytest.raises(IncompatibleCheckpointError, match=r"tensor 'b' is \[3\] float32 in the checkpoint but "
                                                          r"\[3\] bfloat16 is expected"):
        ckpt.check_compatible({**ok, "b": ((3,), torch.bfloat16)})
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"missing from the checkpoint: extra\.0, extra\.1; unexpected in the checkpoint: b$"):
        ckpt.check_compatible({"w": ok["w"], "extra.0": ((1,), torch.float32), "extra.1": ((1,), torch.float32)})
    loose = ckpt.check_compatible({"w": ok["w"], "extra": ((1,), torch.float32)}, strict=False)
    assert loose.missing == ("extra",) and loose.unexpected == ("b",)


# -- async saves ----------------------------------------------------------------------------------------


def test_async_save_commits_in_the_background_from_a_snapshot(tmp_path, monkeypatch):
    root, gate = tmp_path / "checkpoints", tmp_path / "gate"
    monkeypatch.setenv(faults.FAULT_ENV, "ckpt_slow_write@rank0:step2")
    monkeypatch.setenv(faults.GATE_ENV, str(gate))  # the write of step 2 is held until the checks below are done
    saver = AsyncCheckpointer(root, keep_latest=1, coordinator=LOCAL, on_event=faults.checkpoint_events(0))
    w = torch.zeros(4, 3)
    saver.save(1, {"w": (ShardSpec("w", (4, 3), (0, 0)), w)})
    assert saver.wait() == root / "step-00000001"
    saver.save(2, {"w": (ShardSpec("w", (4, 3), (0, 0)), w)}, {"rng": torch.get_rng_state()}, {"step": 2})
    w.fill_(5.0)  # after the snapshot: not in the checkpoint
    assert saver.in_flight
    assert read_latest_pointer(root) == "step-00000001"  # latest and retention wait for the commit
    assert [p.name for p in list_checkpoints(root)] == ["step-00000001"]
    gate.touch()
    assert saver.wait() == root / "step-00000002"
    assert read_latest_pointer(root) == "step-00000002"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002"]
    assert torch.equal(CheckpointReader(root / "step-00000002").read("w"), torch.zeros(4, 3))
    # A background failure surfaces at the next call, once.
    monkeypatch.setenv(faults.FAULT_ENV, "ckpt_enospc@rank0:step3")
    saver.save(3, {"w": (ShardSpec("w", (4, 3), (0, 0)), w)})
    with pytest.raises(CheckpointError, match="no space left on device.*last good checkpoint step-00000002"):
        saver.save(4, {"w": (ShardSpec("w", (4, 3), (0, 0)), w)})
    saver.save(4, {"w": (ShardSpec("w", (4, 3), (0, 0)), w)})
    assert saver.close() == root / "step-00000004"


# -- two real ranks ---------------------------------------------------------------------------------------


def _global_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {"emb": torch.randn(9, 4, generator=gen), "norm": torch.randn(4, generator=gen).to(torch.bfloat16)}


def _rank_shards(rank: int, world_size: int) -> dict:
    tensors = _global_tensors()
    lo, hi = row_box(9, world_size, rank)
    shards = {"emb": shard_of(tensors["emb"], "emb", (lo, 0), (hi - lo, 4))}
    if rank == 0:  # replicated: one rank writes it
        shards["norm"] = shard_of(tensors["norm"], "norm", (0,), (4,))
    return shards


def _save_on_ranks(rank, world_size, root):
    torch.manual_seed(1000 + rank)
    rng = torch.get_rng_state()
    coordinator = DistCoordinator()
    path = save_checkpoint(root, 1, _rank_shards(rank, world_size), {"rng": rng},
                           {"step": 1}, coordinator=coordinator, keep_latest=2)
    # An async save coordinates over its own group while training collectives run on the default one.
    with AsyncCheckpointer(root, keep_latest=2) as saver:
        saver.save(2, _rank_shards(rank, world_size), {"rank": rank}, {"step": 2})
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == world_size
        assert saver.wait() == Path(root) / "step-00000002"
    return str(path), rng


def test_two_ranks_save_and_one_process_loads(tmp_path):
    paths = run_on_ranks(_save_on_ranks, 2, str(tmp_path), timeout=60)
    assert [p for p, _ in paths] == [str(tmp_path / "step-00000001")] * 2
    expected = _global_tensors()
    ckpt = CheckpointReader(tmp_path / "step-00000001")
    assert ckpt.num_saved_ranks == 2 and ckpt.shared_state() == {"step": 1}
    for name, full in expected.items():
        assert torch.equal(ckpt.read(name), full)
    for rank, (_, rng) in enumerate(paths):
        assert torch.equal(ckpt.rank_state(rank)["rng"], rng)
    latest = CheckpointReader(find_latest(tmp_path))
    assert latest.step == 2 and latest.rank_state(1) == {"rank": 1}
    assert torch.equal(latest.read("emb", (3, 1), (5, 2)), expected["emb"][3:8, 1:3])


def _save_twice(rank, world_size, root):
    coordinator = DistCoordinator()
    events = faults.checkpoint_events(rank)
    save_checkpoint(root, 4, _rank_shards(rank, world_size), coordinator=coordinator, on_event=events)
    save_checkpoint(root, 8, _rank_shards(rank, world_size), coordinator=coordinator, on_event=events)


def test_a_rank_killed_after_its_shard_leaves_no_commit(tmp_path):
    env = {faults.FAULT_ENV: "ckpt_kill_after_shard@rank1:step8"}
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_save_twice, 2, str(tmp_path), timeout=60, env=env)
    assert info.value.rank == 1 and info.value.exitcode == -9
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004"]
    assert read_latest_pointer(tmp_path) == "step-00000004"
    assert find_latest(tmp_path) == tmp_path / "step-00000004"
    assert torch.equal(CheckpointReader(tmp_path / "step-00000004").read("emb"), _global_tensors()["emb"])
    (leftover,) = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-00000008-")]
    with pytest.warns(CheckpointWarning, match=f"{leftover}: incomplete checkpoint, no commit marker"):
        quarantine_incomplete(tmp_path)
    assert hidden_entries(tmp_path) == [leftover.replace(".tmp-", ".incomplete-")]
