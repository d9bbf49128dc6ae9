"""Snapshots in node memory, each replicated to a buddy rank on another node: a restart that reads no disk.

    snapshots = PeerSnapshots(directory, rank, world_size, local_world_size)  # collective: its own gloo group
    snapshots.save(step, shards, rank_state, shared_state)  # returns once the tensors are copied to host memory
    ...                                                     # after a restart, on every rank:
    plan = coordinator.broadcast_object(plan_restore(coordinator.gather_objects(snapshots.inventory()), disk_step))
    path = snapshots.fetch(plan)                            # this rank's snapshot, brought from where it is held

`directory` is node-local (a tmpfs such as /dev/shm: memory), one per job:

    rank-00003/step-00000012/   rank 3's own snapshot: a checkpoint in the layout-free format saved by rank 3 alone
                                (world size 1: the boxes it holds, replicated ones too, its state, the shared state)
    copy-00002/step-00000012/   the copy of rank 2's, held here because a rank of this node is rank 2's buddy

Each rank saves its own snapshot in the background (`AsyncCheckpointer`: the step waits only for the copy of
the tensors to host memory, and for the previous snapshot if it is still in flight), then, still in the
background, sends the committed files to its buddy and receives its sender's, over a gloo group of its own.
A received copy is written under a temporary name and renamed into place whole, and an own snapshot commits
as a checkpoint does (manifest last): a snapshot torn by a crash mid-write is never complete, so never read.

The buddy of rank r is by default (--snapshot-buddy next-node) the rank of the same local rank on the next node
(node n = r // local world size; the last node's buddy node is the first): its copy survives the loss of r's
whole node. On a single node the buddy is the next local rank, which survives the loss of a process, not of the
node. --snapshot-buddy next-rank pairs r with r + 1 wherever it runs; an explicit map ("0:2,1:3,2:0,3:1") pairs
as it says (every rank once, one copy held per rank). A job of one process has no buddy.

Every rank keeps its newest `KEPT` snapshots and as many copies: the ranks snapshot at the same steps, and a rank
starts a snapshot only once its previous one is over, so when one rank has committed step s + 2k the slowest has
committed step s at least; three then leave a step complete on every rank.

After a restart each rank lists what its directory holds (`inventory`); one rank plans (`plan_restore`): the newest
step complete for every rank, each from the nearest copy (its own directory first, then its own snapshot held on
another rank's node, then a buddy's copy), unless a disk checkpoint is newer; `fetch` moves the files of the ranks
whose snapshot is held elsewhere (point to point) and returns where this rank's is.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.checkpoint.async_save import AsyncCheckpointer
from paratrain.checkpoint.coordinator import LocalCoordinator
from paratrain.checkpoint.format import TEMP_PREFIX, CheckpointError, parse_step_dirname, step_dirname
from paratrain.checkpoint.save import EventHook, Shards
from paratrain.checkpoint.store import apply_retention, list_checkpoints, quarantine_incomplete, verify_checkpoint
from paratrain.errors import ParatrainError

KEPT = 3
OWN, COPY = "rank", "copy"
_SIZE_TAG, _DATA_TAG = 7301, 7302  # point-to-point tags of a file set's length and its bytes


# --snapshot-buddy: who holds each rank's copy. A rule by name, or an explicit map "0:2,1:3,2:0,3:1" (rank:buddy).
BUDDY_RULES = {
    "next-node": "the same local rank on the next node (the last node's: the first's); on one node the next local rank",
    "next-rank": "rank r + 1 (the last rank's: rank 0), wherever it runs",
}
DEFAULT_BUDDY = "next-node"


class BuddyError(ParatrainError, ValueError):
    """--snapshot-buddy names no pairing: an unknown rule, or a map that is not one buddy per rank."""


def parse_buddies(rule: str, world_size: int | None = None) -> str | dict[int, int]:
    """--snapshot-buddy's value: a rule's name, or the map's {rank: buddy}, which must pair every rank 0..n-1 with
    another, each rank holding one copy (a permutation without a fixed point) and, given `world_size`, n equal to
    it. Raises BuddyError, one line."""
    text = rule.strip()
    if text in BUDDY_RULES:
        return text
    if ":" not in text:
        raise BuddyError(f"--snapshot-buddy {rule!r}: expected {' or '.join(BUDDY_RULES)}, or a map of every rank "
                         f"to its buddy such as 0:1,1:0")
    pairs: dict[int, int] = {}
    for item in text.split(","):
        rank, _, buddy = item.strip().partition(":")
        if not (rank.strip().isdigit() and buddy.strip().isdigit()):
            raise BuddyError(f"--snapshot-buddy {rule!r}: {item.strip()!r} is not RANK:BUDDY (two whole numbers)")
        if int(rank) in pairs:
            raise BuddyError(f"--snapshot-buddy {rule!r}: rank {int(rank)} is given two buddies")
        pairs[int(rank)] = int(buddy)
    n, why = len(pairs), ""
    if set(pairs) != set(range(n)):
        why = f"the ranks must be 0 to {n - 1}, each once"
    elif sorted(pairs.values()) != list(range(n)):
        held = sorted(b for b in set(pairs.values()) if list(pairs.values()).count(b) > 1 or b >= n)
        why = f"each rank holds one copy, but rank(s) {_ranks(held)} would hold several or are no rank of the map"
    elif any(r == b for r, b in pairs.items()):
        why = f"rank(s) {_ranks([r for r, b in pairs.items() if r == b])} would hold their own copy"
    elif world_size is not None and n != world_size:
        why = f"it pairs {n} rank(s), the job has {world_size}"
    if why:
        raise BuddyError(f"--snapshot-buddy {rule!r}: {why}")
    return pairs


def buddies(world_size: int, local_world_size: int, rule: str = DEFAULT_BUDDY) -> list[int | None]:
    """Every rank's buddy, the rank that holds its copy, by --snapshot-buddy `rule`; None for a job of one process."""
    if world_size <= 1:
        return [None] * world_size
    parsed = parse_buddies(rule, world_size)
    if isinstance(parsed, dict):
        return [parsed[r] for r in range(world_size)]
    if parsed == "next-rank":
        return [(r + 1) % world_size for r in range(world_size)]
    local = max(1, min(local_world_size, world_size))
    nodes = world_size // local
    if nodes > 1:
        return [((r // local + 1) % nodes) * local + r % local for r in range(world_size)]
    return [(r + 1) % local for r in range(world_size)]


def buddy_of(rank: int, world_size: int, local_world_size: int, rule: str = DEFAULT_BUDDY) -> int | None:
    """The rank that holds `rank`'s copy."""
    return buddies(world_size, local_world_size, rule)[rank]


def sender_of(rank: int, world_size: int, local_world_size: int, rule: str = DEFAULT_BUDDY) -> int | None:
    """The rank whose copy `rank` holds (the one whose buddy it is)."""
    found = buddies(world_size, local_world_size, rule)
    return found.index(rank) if rank in found else None


def entry_name(kind: str, rank: int) -> str:
    """``rank-00003`` (rank 3's own snapshots) or ``copy-00003`` (the copies of rank 3's held here)."""
    return f"{kind}-{rank:05d}"


class PeerSnapshots:
    """This rank's snapshots in `directory`, the copies it holds of its sender's, and the exchange with its buddy.

    Collective to build (the gloo group of the exchange, when there is more than one rank). `on_event` hears
    the events of the own snapshot's save (`paratrain.checkpoint.save.EventHook`: injected faults).
    """

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, local_world_size: int, *,
                 timeout_s: float = 600.0, on_event: EventHook = None, buddy_rule: str = DEFAULT_BUDDY):
        self.dir, self.rank, self.world_size = Path(directory), rank, world_size
        self.buddy = buddy_of(rank, world_size, local_world_size, buddy_rule)
        self.sender = sender_of(rank, world_size, local_world_size, buddy_rule)
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if world_size > 1 and dist.is_initialized() else None)
        self.own_root = self.dir / entry_name(OWN, rank)
        self.saver = AsyncCheckpointer(self.own_root, keep_latest=KEPT, coordinator=LocalCoordinator(),
                                       on_event=on_event, after_commit=self._replicate if self.group else None)

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, shards: Shards, rank_state: dict, shared_state: dict) -> float:
        """Start snapshot `step` of this rank (every rank at the same steps); return the seconds the step waited:
        for the previous snapshot still in flight, then for the copy of the tensors to host memory."""
        start = time.perf_counter()
        self.saver.wait()
        self.saver.save(step, shards, rank_state, shared_state, overwrite=True)
        return time.perf_counter() - start

    def _replicate(self, step: int, path: Path | None) -> None:
        """Background: send this snapshot's files to the buddy (none when the save failed) and keep the sender's."""
        outgoing = pack_files(path) if path is not None else torch.empty(0, dtype=torch.uint8)
        received = exchange(self.group, {self.buddy: outgoing}, [self.sender])[self.sender]
        if received.numel():
            install(self.dir / entry_name(COPY, self.sender), step, unpack_files(received))

    def wait(self) -> None:
        """Block until no snapshot is in flight; raise the error of one that failed."""
        self.saver.wait()

    def abandon(self) -> None:
        """The training failed: a snapshot in flight is given up (never waited for: its buddy may be gone)."""
        self.saver.abandon()

    def close(self) -> None:
        self.saver.close()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None

    def _written_here(self) -> list[Path]:
        """The entries this rank writes: its own snapshots and the copies of its sender's."""
        return [self.own_root] + ([self.dir / entry_name(COPY, self.sender)] if self.sender is not None else [])

    # -- restoring ---------------------------------------------------------------------------
    def inventory(self) -> dict:
        """What this rank's directory holds, complete: {"rank": {r: [steps]}, "copy": {r: [steps]}}.

        Leftovers of snapshots that died mid-write are deleted first (only this rank writes its own entry and
        its sender's copies); complete means committed with every file of the size its manifest records.
        """
        for entry in self._written_here():
            if entry.is_dir():
                quarantine_incomplete(entry, delete=True)
        found: dict[str, dict[str, list[int]]] = {OWN: {}, COPY: {}}
        for entry in sorted(self.dir.iterdir()) if self.dir.is_dir() else ():
            kind, _, number = entry.name.partition("-")
            if kind not in found or not number.isdigit():
                continue
            steps = [parse_step_dirname(p.name) for p in list_checkpoints(entry) if _complete(p)]
            if steps:
                found[kind][str(int(number))] = steps
        return found

    def fetch(self, plan: dict) -> Path:
        """Carry out `plan_restore`'s plan (collective): send the snapshots held here that other ranks need, receive
        this rank's if it is held elsewhere (written back as its own); return the directory this rank loads."""
        step, holders = plan["step"], [tuple(h) for h in plan["holders"]]
        sends = {r: pack_files(self.dir / entry_name(kind, r) / step_dirname(step))
                 for r, (q, kind) in enumerate(holders) if q == self.rank and r != self.rank}
        holder, kind = holders[self.rank]
        received = exchange(self.group, sends, [holder] if holder != self.rank else [])
        if holder != self.rank:
            return install(self.own_root, step, unpack_files(received[holder]))
        return self.dir / entry_name(kind, self.rank) / step_dirname(step)

    def discard_newer(self, step: int) -> None:
        """Delete this rank's snapshots and held copies newer than `step` (the run continues from `step`: they belong
        to a branch it abandoned)."""
        for entry in self._written_here():
            for path in list_checkpoints(entry):
                if parse_step_dirname(path.name) > step:
                    shutil.rmtree(path, ignore_errors=True)

    def remove(self) -> None:
        """Delete this rank's snapshots and the copies it holds (a finished run), and the job's directory once empty."""
        for entry in self._written_here():
            shutil.rmtree(entry, ignore_errors=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass  # another rank's entries are still there


def _complete(path: Path) -> bool:
    try:
        verify_checkpoint(path, checksums=False)
        return True
    except CheckpointError:
        return False


def plan_restore(inventories: list[dict], newest_disk_step: int | None) -> dict:
    """From every rank's `inventory` (in rank order): {"source": "memory", "step", "holders": [[rank holding it,
    "rank" | "copy"] per rank]} for the newest step complete for every rank, or {"source": "disk", "why": why
    memory is not used ('' when no snapshot was found anywhere, or a disk checkpoint is newer)}.

    For each rank the nearest copy: one in its own directory, else its own snapshot on another node (the ranks
    were renumbered), else a buddy's copy; then the lowest rank holding it.
    """
    world = len(inventories)
    available: list[dict[int, tuple[int, str]]] = [{} for _ in range(world)]
    for holder, inventory in enumerate(inventories):
        for kind in (OWN, COPY):
            for owner, steps in inventory.get(kind, {}).items():
                owner = int(owner)
                if owner >= world:
                    continue
                for step in steps:
                    best = available[owner].get(step)
                    if best is None or _distance(owner, (holder, kind)) < _distance(owner, best):
                        available[owner][step] = (holder, kind)
    common = set.intersection(*(set(steps) for steps in available)) if world else set()
    step = max(common, default=None)
    if step is None:
        lacking = [r for r in range(world) if not available[r]]
        anything = any(available)
        if not anything:
            return {"source": "disk", "why": ""}
        why = (f"rank(s) {_ranks(lacking)} have none (own snapshot and buddy's copy both lost)" if lacking else
               "no step is complete on every rank")
        return {"source": "disk", "why": f"no snapshot in memory is complete on every rank: {why}"}
    if newest_disk_step is not None and newest_disk_step > step:
        return {"source": "disk", "why": ""}
    return {"source": "memory", "step": step, "holders": [list(available[r][step]) for r in range(world)]}


def _distance(owner: int, held: tuple[int, str]) -> tuple:
    holder, kind = held
    return holder != owner, kind != OWN, holder


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:8]) + (f", … ({len(ranks)} in all)" if len(ranks) > 8 else "")


# -- moving a snapshot between ranks: its files as one byte tensor -------------------------------

def pack_files(path: Path) -> torch.Tensor:
    """The files of directory `path` as one uint8 tensor: a length-prefixed JSON list of [name, size], then the bytes."""
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    blobs = [(path / name).read_bytes() for name in names]
    header = json.dumps([[name, len(blob)] for name, blob in zip(names, blobs)]).encode("utf-8")
    data = b"".join([len(header).to_bytes(8, "little"), header, *blobs])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack_files(payload: torch.Tensor) -> dict[str, bytes]:
    """{name: bytes} of what `pack_files` packed."""
    data = payload.numpy().tobytes()
    length = int.from_bytes(data[:8], "little")
    at, files = 8 + length, {}
    for name, size in json.loads(data[8:at]):
        if "/" in name or name.startswith("."):
            raise CheckpointError(f"a snapshot received from another rank names the file {name!r}")
        files[name] = data[at:at + size]
        at += size
    if at != len(data):
        raise CheckpointError(f"a snapshot received from another rank is {len(data)} bytes, its header says {at}")
    return files


def install(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """Write `files` as ``root/step-N`` under a temporary name, then rename it into place (replacing an older
    one of the same step); keep the newest `KEPT`. Returns the directory."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dirname(step)
    tmp = root / f"{TEMP_PREFIX}{final.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    apply_retention(root, KEPT, protect=final)
    return final


def exchange(group, sends: dict[int, torch.Tensor], sources: list[int]) -> dict[int, torch.Tensor]:
    """Send each tensor of `sends` (destination rank: uint8 tensor) and receive one from each rank of `sources`,
    all at once (no order between pairs to deadlock on); the received tensors by source."""
    sizes_out = {dst: torch.tensor([t.numel()], dtype=torch.int64) for dst, t in sends.items()}
    sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
    _wait([dist.isend(size, dst, group=group, tag=_SIZE_TAG) for dst, size in sizes_out.items()]
          + [dist.irecv(size, src, group=group, tag=_SIZE_TAG) for src, size in sizes_in.items()])
    received = {src: torch.empty(int(size.item()), dtype=torch.uint8) for src, size in sizes_in.items()}
    _wait([dist.isend(t, dst, group=group, tag=_DATA_TAG) for dst, t in sends.items() if t.numel()]
          + [dist.irecv(t, src, group=group, tag=_DATA_TAG) for src, t in received.items() if t.numel()])
    return received


def _wait(requests) -> None:
    for request in requests:
        request.wait()
