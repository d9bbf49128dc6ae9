"""Rank 0's half of a save: merge what every rank reported into one index, and refuse an inconsistent one.

Each rank reports a fragment (a JSON dict) after writing its file::

    {"rank": 1, "step": 8, "file": "rank-00001.safetensors", "size": 4096, "sha256": "…",
     "shards": [{"key": "w", "name": "w", "dtype": "float32",
                 "global_shape": [8, 4], "offset": [4, 0], "shape": [4, 4]}, …],
     "rank_state": {…}, "shared_state": {…} | null}

or ``{"rank": 1, "error": "…"}`` when it could not. `build_index` checks what
no single rank can see: every rank saved the same step, every box of a tensor agrees on its dtype and global
shape, no two boxes overlap (a replicated tensor written by two ranks is a
bug in the caller's save plan), and the boxes cover the whole tensor.
"""

from __future__ import annotations

import math
from collections import defaultdict

from paratrain.checkpoint.boxes import covered_numel, find_overlap
from paratrain.checkpoint.format import Box, CheckpointError, FileDigest, Index, TensorEntry


def build_index(step: int, fragments: list[dict]) -> Index:
    """The index of a save from every rank's fragment (in rank order); CheckpointError naming the first inconsistent tensor."""
    assert [f["rank"] for f in fragments] == list(range(len(fragments))), "fragments out of rank order"
    for fragment in fragments:
        if fragment["step"] != step:
            raise CheckpointError(f"rank {fragment['rank']} saved step {fragment['step']} while rank 0 saved "
                                  f"step {step}; every rank must save the same step")
    pieces: dict[str, list[dict]] = defaultdict(list)
    for fragment in fragments:
        for shard in fragment["shards"]:
            pieces[shard["name"]].append({**shard, "rank": fragment["rank"], "file": fragment["file"]})
    tensors = {name: _merge_tensor(name, items) for name, items in sorted(pieces.items())}
    return Index(step=step, world_size=len(fragments), tensors=tensors,
                 shared_state=fragments[0].get("shared_state") or {},
                 rank_state={f["rank"]: f["rank_state"] for f in fragments})


def file_digests(fragments: list[dict]) -> dict[str, FileDigest]:
    """The data files (and rank 0's assets) of a save and their digests, as the ranks computed them while writing."""
    digests = {f["file"]: FileDigest(f["size"], f["sha256"]) for f in fragments}
    for fragment in fragments:
        digests.update({name: FileDigest(size, sha) for name, (size, sha) in (fragment.get("assets") or {}).items()})
    return digests


def _merge_tensor(name: str, items: list[dict]) -> TensorEntry:
    first = items[0]
    for item in items[1:]:
        if (item["dtype"], item["global_shape"]) != (first["dtype"], first["global_shape"]):
            raise CheckpointError(
                f"tensor {name!r}: rank {first['rank']} saved it as {first['global_shape']} {first['dtype']} "
                f"but rank {item['rank']} as {item['global_shape']} {item['dtype']}; every shard of a tensor "
                f"must give the same global shape and dtype")
    boxes = [(tuple(i["offset"]), tuple(i["shape"])) for i in items]
    clash = find_overlap(boxes)
    if clash is not None:
        a, b = (items[i] for i in clash)
        raise CheckpointError(
            f"internal error: tensor {name!r} is saved twice where rank {a['rank']} (key {a['key']!r}, offset "
            f"{a['offset']}, shape {a['shape']}) and rank {b['rank']} (key {b['key']!r}, offset {b['offset']}, "
            f"shape {b['shape']}) overlap; a replicated tensor must be saved by exactly one rank")
    total = math.prod(first["global_shape"])
    covered = covered_numel(boxes)
    if covered != total:
        raise CheckpointError(
            f"tensor {name!r}: the saved shards cover {covered} of its {total} elements "
            f"(global shape {first['global_shape']}); every element must be saved by exactly one rank")
    stored = tuple(Box(i["file"], i["key"], tuple(i["offset"]), tuple(i["shape"]))
                   for i in items if math.prod(i["shape"]) > 0)
    return TensorEntry(first["dtype"], tuple(first["global_shape"]), stored)
