"""Which rank is where when a collective fails: fingerprints of every rank's last collectives, kept in files.

Each rank mirrors the CallRecords of its `Comm` (kind, axis, shape, dtype and
sequence number of every collective, plus the training step) into a small
file of fixed-size slots, ``<out>/diagnostics/attempt-<A>/rank-<r>.ring``,
with one ``pwrite`` before each collective starts (a few microseconds). The
file outlives a rank that hangs, is killed, or is aborted inside the backend
(gloo aborts the process that receives more bytes than it expected), so the
rank whose collective fails can read every rank's fingerprint and say:

* where the sequences diverged: the first call number at which two ranks
  issued different collectives (kind, axis, shape or dtype), naming both;
* else who never arrived: the ranks whose last call is older than the one
  the others wait in (a rank hung outside a collective, or dead);
* else that every rank issued the same calls (the failure is elsewhere).

Files rather than the launcher's key-value store: they need no private
torch API and survive the processes for a post-mortem. They need the run
directory on a file system every rank sees, as checkpoints do.

Under NCCL the host does not wait for a collective, so a rank's own file says
what it issued, not where its GPU waits. There torch's flight recorder is the
per-rank history (each collective's group, sequence number, sizes and state,
dumped by the watchdog on a timeout to ``<attempt>/flight-rank-<r>``, see
`paratrain.distributed.nccl_diagnostics`), and `describe_flight_records` reads
the same one line from the dumps: which rank never issued the collective the
others wait in, else which rank waits in a pipeline transfer (a send or
receive) that its peer never posted, else which collective did not complete.
Each mesh group carries its axis's name, so the line names the axis; the gloo
path keeps its own fingerprints.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

from paratrain.comm import CallRecord
from paratrain.mesh import MeshShape
from paratrain.errors import RunFailure

FLIGHT_PREFIX = "flight-rank-"
SLOT_BYTES = 192
HISTORY = 64
FAILED_PREFIX = "failed-rank-"


class CollectiveFailure(RunFailure):
    """A collective failed or timed out; the message says which rank was in which call, and where ranks diverged."""


def ring_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.ring"


class FingerprintRing:
    """This rank's last HISTORY collectives in a file of fixed-size slots; slot 0 holds the current step.

    Register it as a `Comm` listener (`comm.listeners.append(ring)`); call `set_step` as each step starts.
    """

    def __init__(self, directory: Path, rank: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.rank, self.step = rank, 0
        self._fd = os.open(ring_path(directory, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._put(0, {"rank": rank, "step": 0, "pid": os.getpid()})

    def set_step(self, step: int) -> None:
        self.step = step
        self._put(0, {"rank": self.rank, "step": step, "pid": os.getpid()})

    def __call__(self, record: CallRecord) -> None:
        self._put(1 + record.seq % HISTORY, {"seq": record.seq, "kind": record.kind, "axis": record.axis,
                                             "shape": list(record.shape), "dtype": record.dtype, "step": self.step})

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _put(self, slot: int, doc: dict) -> None:
        data = json.dumps(doc, separators=(",", ":")).encode()[:SLOT_BYTES - 1]
        os.pwrite(self._fd, data.ljust(SLOT_BYTES - 1) + b"\n", slot * SLOT_BYTES)


def read_ring(path: Path) -> tuple[dict, list[dict]] | None:
    """(header, records oldest first) of one rank's file, or None if it is missing or unreadable."""
    try:
        slots = path.read_bytes().split(b"\n")
    except OSError:
        return None
    docs = []
    for slot in slots:
        try:
            docs.append(json.loads(slot))
        except ValueError:
            docs.append(None)  # a slot never written, or cut by a write in progress
    if not docs or docs[0] is None:
        return None
    return docs[0], sorted((d for d in docs[1:] if d and "seq" in d), key=lambda d: d["seq"])


def mark_failed(directory: Path, rank: int) -> None:
    """Leave a mark that this rank failed (peers stopping on SIGTERM then exit at once)."""
    try:
        (Path(directory) / f"{FAILED_PREFIX}{rank}").touch()
    except OSError:
        pass


def any_failed(directory: Path) -> bool:
    try:
        return any(p.name.startswith(FAILED_PREFIX) for p in Path(directory).iterdir())
    except OSError:
        return False


def _call(doc: dict) -> str:
    return f"#{doc['seq']} {doc['kind']} over {doc['axis']} shape {doc['shape']} {doc['dtype']} (step {doc['step']})"


def _fingerprint(doc: dict) -> tuple:
    return doc["kind"], doc["axis"], tuple(doc["shape"]), doc["dtype"]


def describe(directory: Path, rank: int, shape: MeshShape) -> str:
    """One line: where this rank is, and how the other ranks of its pipeline stage differ from it."""
    rings = _stage_rings(directory, rank, shape)
    mine = rings.get(rank)
    if mine is None or not mine[1]:
        return f"rank {rank} had issued no collective"
    here = f"rank {rank} failed at step {mine[0]['step']}, its last collective {_call(mine[1][-1])}"
    silent = [r for r, ring in rings.items() if ring is None]
    others = {r: ring for r, ring in rings.items() if ring is not None}
    report = (_divergence(others) or _laggards(others)
              or "every rank of its stage issued the same collectives (a peer may have died in the last one)")
    if silent:
        report += f"; no fingerprint from rank(s) {silent}"
    return f"{here}: {report}"


def divergence(directory: Path, rank: int, shape: MeshShape) -> str:
    """Where the collectives of `rank`'s pipeline stage diverged, or '' if they did not (for a launcher's summary)."""
    rings = {r: ring for r, ring in _stage_rings(directory, rank, shape).items() if ring is not None}
    return _divergence(rings) or ""


def _stage_rings(directory: Path, rank: int, shape: MeshShape) -> dict[int, tuple[dict, list[dict]] | None]:
    """The fingerprints of the ranks that run the same program as `rank` (its pipeline stage)."""
    pp = shape.coords(rank)["pp"]
    return {r: read_ring(ring_path(directory, r)) for r in range(shape.world_size) if shape.coords(r)["pp"] == pp}


def _divergence(rings: dict[int, tuple[dict, list[dict]]]) -> str | None:
    """The first call number at which two ranks issued different collectives, naming each variant."""
    by_seq: dict[int, dict[int, dict]] = {}
    for r, (_, records) in rings.items():
        for doc in records:
            by_seq.setdefault(doc["seq"], {})[r] = doc
    for seq in sorted(by_seq):
        docs = by_seq[seq]
        variants: dict[tuple, list[int]] = {}
        for r, doc in sorted(docs.items()):
            variants.setdefault(_fingerprint(doc), []).append(r)
        if len(variants) > 1:
            parts = [f"rank(s) {ranks} {_call(docs[ranks[0]])}" for ranks in variants.values()]
            return f"collectives diverged at call #{seq}: " + " vs ".join(parts)
    return None


def _laggards(rings: dict[int, tuple[dict, list[dict]]]) -> str | None:
    """The ranks that never issued the newest call the others are in."""
    last = {r: records[-1] if records else None for r, (_, records) in rings.items()}
    newest = max((d["seq"] for d in last.values() if d), default=0)
    behind = [r for r, d in last.items() if d is None or d["seq"] < newest]
    if not behind:
        return None
    ahead = next(d for d in last.values() if d and d["seq"] == newest)
    parts = []
    for r in behind:
        header, doc = rings[r][0], last[r]
        was = f"its last was {_call(doc)}" if doc else "it issued none"
        parts.append(f"rank {r} never issued call #{newest} ({ahead['kind']} over {ahead['axis']} shape "
                     f"{ahead['shape']}): {was} and it is at step {header['step']}, hung or dead outside a collective")
    return "; ".join(parts)


# -- NCCL: torch's flight recorder ---------------------------------------------------------------------

def flight_record_prefix(cfg) -> str:
    """Where this attempt's flight-recorder dumps go (+ rank): beside the fingerprints, where the launcher's
    failure summary reads them. Known before the process group exists (torch reads it then), as the
    run directory is (`paratrain.run.build.shared_run_dir`)."""
    from paratrain.run.rundir import diagnostics_dir

    return str(diagnostics_dir(Path(cfg.run.out)) / FLIGHT_PREFIX)


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, strings, numbers): a dump that names any class or function
    is refused, so reading one executes nothing."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a flight record names {module}.{name}; only plain data is read")


def read_flight_record(path: Path) -> dict | None:
    """One rank's flight-recorder dump (torch writes pickle on a timeout; `write_flight_record` writes JSON)."""
    try:
        data = Path(path).read_bytes()
        if data.lstrip()[:1] == b"{":
            return json.loads(data)
        return _PlainData(io.BytesIO(data)).load()
    except (OSError, ValueError, pickle.UnpicklingError, EOFError):
        return None


def write_flight_record(path: Path) -> None:
    """This rank's flight record now, as JSON (`paratrain.compat.flight_record_json`; the flight recorder keeps
    entries only when TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE is set)."""
    from paratrain.compat import flight_record_json

    Path(path).write_bytes(flight_record_json())


def _collectives(dump: dict) -> dict[str, list[dict]]:
    """Per process group (name): its collectives in this rank's dump, by sequence number."""
    groups: dict[str, list[dict]] = {}
    for entry in dump.get("entries", []):
        if not entry.get("is_p2p"):
            groups.setdefault(str(entry["process_group"][0]), []).append(entry)
    return {name: sorted(entries, key=lambda e: e["collective_seq_id"]) for name, entries in groups.items()}


def _flight_call(entry: dict) -> str:
    kind = str(entry.get("profiling_name", "?")).split(":")[-1]
    return f"#{entry['collective_seq_id']} {kind} over {_axis(entry)} sizes {entry.get('input_sizes')}"


def _axis(entry: dict) -> str:
    axis = entry["process_group"][1]
    return "world" if axis == "default_pg" else axis


def _unfinished(entry: dict) -> bool:
    return entry.get("state") in ("scheduled", "started") and not entry.get("retired", False)


def describe_flight_records(directory: Path, world_size: int) -> str:
    """One line from every rank's flight-recorder dump in `directory`: who never reached the collective the
    others wait in, else who waits in a transfer its peer never posted, else which collective did not complete;
    '' when there are no dumps to read."""
    dumps = {r: read_flight_record(Path(directory) / f"{FLIGHT_PREFIX}{r}") for r in range(world_size)}
    dumps = {r: d for r, d in dumps.items() if d is not None}
    if not dumps:
        return ""
    per_rank = {r: _collectives(d) for r, d in dumps.items()}
    for group in sorted({g for groups in per_rank.values() for g in groups}):
        last = {r: groups[group][-1] for r, groups in per_rank.items() if group in groups}
        newest = max(e["collective_seq_id"] for e in last.values())
        behind = sorted(r for r, e in last.items() if e["collective_seq_id"] < newest)
        if behind:
            waiting = sorted(r for r, e in last.items() if e["collective_seq_id"] == newest)
            r = behind[0]
            return (f"rank {r} never issued collective {_flight_call(last[waiting[0]])} that rank(s) {waiting} "
                    f"wait in; its last there was {_flight_call(last[r])}")
    hang = _transfer_hang(dumps)
    if hang:
        return hang
    stuck = [(r, e) for r, groups in per_rank.items() for entries in groups.values() for e in entries if _unfinished(e)]
    if stuck:
        r, entry = stuck[0]
        return f"rank {r} is in collective {_flight_call(entry)}, {entry['state']}, not completed"
    missing = sorted(set(range(world_size)) - set(dumps))
    return ("every dump shows the same collectives and transfers completed"
            + (f"; no dump from rank(s) {missing}" if missing else ""))


# -- point-to-point transfers (pipeline parallelism) in the flight recorder ------------------------------
#
# torch records each send as "nccl:send S->D" and each receive as "nccl:recv D<-S" (ranks of the group),
# numbered per group by `p2p_seq_id`, not `collective_seq_id`. The sends and receives of one
# batch_isend_irecv share one number and end with a "coalesced" entry, which alone carries the batch's
# state. Ranks issue different transfers (a stage sends what the next receives), so they are compared
# pairwise: the rank that waits in a transfer, and what its peer last did with it.

def _transfers(dump: dict) -> dict[str, dict[int, dict]]:
    """Per process group: this rank's transfers by number, each {"seq", "ops": [(kind, peer's global rank,
    sizes)], "entry": the entry that carries its state}."""
    groups: dict[str, dict[int, dict]] = {}
    for entry in dump.get("entries", []):
        if not entry.get("is_p2p"):
            continue
        name = str(entry["process_group"][0])
        transfer = groups.setdefault(name, {}).setdefault(
            entry["p2p_seq_id"], {"seq": entry["p2p_seq_id"], "ops": [], "entry": entry})
        kind, _, ends = str(entry.get("profiling_name", "")).split(":")[-1].partition(" ")
        if kind == "coalesced":
            transfer["entry"] = entry
        elif kind in ("send", "recv"):
            peer = (ends.split("->") if kind == "send" else ends.split("<-"))[-1]  # "S->D" / "D<-S": the other end
            if peer.strip().isdigit():
                transfer["ops"].append((kind, _global_rank(dump, name, int(peer)), entry.get("input_sizes")))
    return groups


def _global_rank(dump: dict, group: str, group_rank: int) -> int:
    """The global rank of `group_rank` in `group`, by the dump's group table (the default group's is empty)."""
    ranks = dump.get("pg_config", {}).get(group, {}).get("ranks", [])
    try:
        ranks = json.loads(ranks) if isinstance(ranks, str) else list(ranks)  # NCCL writes "[0, 1]"
    except (TypeError, ValueError):
        ranks = []
    return int(ranks[group_rank]) if group_rank < len(ranks) else group_rank


def _transfer_text(transfer: dict) -> str:
    ops = " + ".join(f"{'send to' if kind == 'send' else 'recv from'} rank {peer} sizes {sizes}"
                     for kind, peer, sizes in transfer["ops"])
    return f"#{transfer['seq']} over {_axis(transfer['entry'])} ({ops})"


def _transfer_hang(dumps: dict[int, dict]) -> str | None:
    """The first rank that waits in a transfer, and why: its peer waits too, is stuck elsewhere, or never
    posted its side."""
    transfers = {r: _transfers(d) for r, d in dumps.items()}
    for r in sorted(transfers):
        for group, mine in sorted(transfers[r].items()):
            waiting = [t for _, t in sorted(mine.items()) if _unfinished(t["entry"]) and t["ops"]]
            if not waiting:
                continue
            t = waiting[0]
            peer = t["ops"][0][1]
            here = f"rank {r} waits in transfer {_transfer_text(t)}, {t['entry']['state']}, not completed"
            return f"{here}; {_peer_side(dumps, transfers, group, r, peer)}"
    return None


def _peer_side(dumps: dict[int, dict], transfers: dict, group: str, rank: int, peer: int) -> str:
    """What `peer` was doing about `rank`'s transfer in `group`."""
    if peer not in dumps:
        return f"no dump from rank {peer}"
    with_rank = [t for _, t in sorted(transfers[peer].get(group, {}).items()) if any(p == rank for _, p, _ in t["ops"])]
    if with_rank and _unfinished(with_rank[-1]["entry"]):
        return f"rank {peer} waits in transfer {_transfer_text(with_rank[-1])} too"
    other = [t for _, theirs in sorted(transfers[peer].items()) for _, t in sorted(theirs.items())
             if _unfinished(t["entry"]) and t["ops"]]
    if other:
        return f"rank {peer} waits in transfer {_transfer_text(other[0])} instead"
    collective = [e for e in dumps[peer].get("entries", []) if _unfinished(e) and not e.get("is_p2p")]
    if collective:
        return f"rank {peer} is in collective {_flight_call(collective[0])} instead"
    last = f"its last transfer with rank {rank} there was {_transfer_text(with_rank[-1])}, completed" if with_rank \
        else f"it had no transfer with rank {rank} there"
    return f"rank {peer} never posted its side (a pipeline hang): {last}"
