"""Goodput under failures: a run hit by a fault every T seconds, restarted from disk checkpoints alone or from snapshots.

    python benchmarks/bench_goodput.py                                  # 10 minutes per mode and fault
    python benchmarks/bench_goodput.py --budget 180 --fault-every 40    # shorter
    python benchmarks/bench_goodput.py --faults node --lock /tmp/x      # the node fault, holding a lock per mode

Each mode runs `paratrain train --max-restarts N` on a corpus tokenized once (`paratrain prepare`) for a fixed
wall-clock budget, under each fault (--faults), every --fault-every seconds, injected from outside:
- rank: one node of two CPU ranks (`--nproc 2`); rank 1's process killed with SIGKILL, and the launcher restarts
  the job, which resumes as it would after a real failure;
- node: two nodes of two CPU ranks on this machine (two launchers, `--nnodes 2 --nproc 2`, meeting at a c10d
  rendezvous on the loopback whose store node 0's launcher hosts; each node its own --snapshot-dir, its memory,
  and the buddy of each rank the same local rank on the other node); the second node lost: its launcher and every
  process under it SIGKILLed, its --snapshot-dir wiped, and a fresh launcher started in its place (a replaced
  node: its agent's attempt 0), while the first node's launcher restarts its workers. They meet once the lost
  node's heartbeat has expired (--node-timeout 3), and the replaced node's ranks restore from their buddies' copies.
Modes: "disk" (checkpoints at --disk-every, the trainer's default interval unless given) and "snapshots" (the same,
plus --snapshot-every K, in /dev/shm: memory). --lock holds a file's lock during each mode (a machine shared with
other measurements: one mode at a time).

Measured, per mode and fault: goodput = the steps that survive in metrics.jsonl (each step once, the last
attempt's) times the failure-free wall time per step (the first mode's pace under the same fault before its first
kill: a step's share of the loop's own work included, and no snapshot's cost) over the wall time; the steps lost
per failure (the last step recorded before the kill minus the step the restart resumed from); where each rank
restored from (the restarted job's first record: `restored_from`); the time from each kill to the first step after
it, and where it goes: the old workers' exit, the launcher's restart, the new workers' imports, their rendezvous,
the run's build, the restore and the first step (the restarted job's first record carries the times of these
points: `launch_times`). The first kill comes --fault-every seconds after the first step, each next one
--fault-every seconds after the run recovered.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import doc_parser, fmt_load, machine, write_results

TINY = ["--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "128",
        "--seq-len", "64", "--global-batch", "8", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress"]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_of_rank(launcher: int, rank: int) -> int | None:
    """The training process of `rank` under the launcher: the one holding its fingerprint file open
    (`paratrain.run.diagnose.ring_path`; a forked worker's /proc environ does not show the RANK it was given)."""
    for pid in descendants(launcher):
        try:
            targets = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        if any(t.endswith(f"rank-{rank:05d}.ring") for t in targets):
            return pid
    return None


class MetricsTail:
    """metrics.jsonl read as it grows: only the new complete lines are parsed at each `poll`; the file replaced (a
    resume cuts it back to the resumed step) is read again whole."""

    def __init__(self, path: Path):
        self.path, self.records, self._inode, self._offset, self._partial = path, [], None, 0, b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self._inode:
                    self.records, self._inode, self._offset, self._partial = [], inode, 0, b""
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return self.records
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        self.records += [json.loads(line) for line in lines if line.strip()]
        return self.records

    @property
    def last_step(self) -> int:
        return self.records[-1]["step"] if self.records else 0


def workers(launcher: int) -> list[int]:
    """The launcher's training processes (those holding a fingerprint file open)."""
    found = []
    for pid in descendants(launcher):
        try:
            if any(os.readlink(fd).endswith(".ring") for fd in Path(f"/proc/{pid}/fd").iterdir()):
                found.append(pid)
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Where the time from a kill to the first step after it goes: each phase ends at a point the restarted job's first
# record carries (`launch_times`, rank 0's: paratrain.metrics.LaunchTimes), the first at the old workers' exit.
PHASES = [
    ("detect and stop", "the kill until every worker of the failed attempt has exited"),
    ("restart processes", "the launcher's restart: its rendezvous, the new workers forked"),
    ("imports", "a new worker's start until the trainer runs"),
    ("rendezvous", "the workers' process group"),
    ("build", "data, model, optimizer, checkpoint and snapshot groups"),
    ("restore", "the snapshot or checkpoint found, agreed on, read"),
    ("first step", "the first step after the restore"),
]


def breakdown(kill: float, gone: float, times: dict) -> dict[str, float]:
    points = [kill, gone, times["process"] or times["train"], times["train"], times["group"], times["resume"],
              times["resumed"], times["first_step"]]
    return {name: points[i + 1] - points[i] for i, (name, _) in enumerate(PHASES)}


def commands(run: str, extra: list[str], workdir: Path, memory: Path, nodes: int) -> list[list[str]]:
    """Each node's launcher of one run, `nodes` of 2 ranks: one, or several meeting at a rendezvous on the loopback
    (the job's id `run`), each with its own --snapshot-dir (that node's memory, `node_memory`). The global batch
    of 8 sequences is the same on any number of nodes (a micro-batch of 4 // nodes per rank)."""
    common = [sys.executable, "-m", "paratrain", "train", *TINY, "--data", str(workdir / "data"), "--steps", "1000000",
              "--micro-batch", str(4 // nodes), "--nproc", "2", "--max-restarts", "1000", "--out", str(workdir / run), *extra]
    if nodes == 1:
        return [[*common, "--snapshot-dir", str(node_memory(memory, run, 0))]]
    with socket.socket() as s:  # a free port for the rendezvous; node 0's launcher hosts its store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [[*common, "--nnodes", str(nodes), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run,
             "--node-timeout", "3", "--snapshot-dir", str(node_memory(memory, run, node))] for node in range(nodes)]


def node_memory(memory: Path, run: str, node: int) -> Path:
    return memory / run / f"node{node}"


def endpoint_of(command: list[str]) -> tuple[str, int] | None:
    if "--rdzv-endpoint" not in command:
        return None
    host, port = command[command.index("--rdzv-endpoint") + 1].rsplit(":", 1)
    return host, int(port)


def listening(address: tuple[str, int]) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(address, timeout=1):
        return True
    return False


class Job:
    """The launcher of one mode's run (a list: one launcher per node) and its log."""

    def __init__(self, commands: list[list[str]], logs: list[Path]):
        self.commands, self.logs, self.processes = commands, logs, [None] * len(commands)
        for node in range(len(commands)):
            self.start(node)
            endpoint = endpoint_of(commands[node])
            # Node 0's launcher binds the rendezvous store before another starts: the store lives with node 0 (the
            # node a node fault never kills), not with whichever launcher came first.
            deadline = time.monotonic() + 120
            while endpoint and node == 0 and not listening(endpoint) and time.monotonic() < deadline:
                if self.processes[0].poll() is not None:
                    said = logs[0].read_text().strip().splitlines()[-1:] if logs[0].exists() else []
                    raise SystemExit(f"node 0's launcher exited ({self.processes[0].returncode}): {' '.join(said)}")
                time.sleep(0.1)

    def start(self, node: int) -> None:
        with open(self.logs[node], "a") as log:
            # Unbuffered: a line is in the log when it is printed, not lost when the run is killed at the end.
            self.processes[node] = subprocess.Popen(self.commands[node], stdout=log, stderr=subprocess.STDOUT,
                                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def workers(self) -> list[int]:
        return [pid for process in self.processes for pid in workers(process.pid)]

    def log_sizes(self) -> list[int]:
        return [path.stat().st_size if path.exists() else 0 for path in self.logs]

    def said_since(self, sizes: list[int], prefix: str, until: list[int] | None = None) -> list[str]:
        """The lines of the logs from `sizes` (to `until`) that start with `prefix`."""
        found = []
        for node, (path, size) in enumerate(zip(self.logs, sizes)):
            with open(path, "rb") as f:
                f.seek(size)
                text = f.read(until[node] - size if until else -1).decode(errors="replace")
            found += [line.strip() for line in text.splitlines() if line.startswith(prefix)]
        return found

    def kill_tree(self, node: int) -> None:
        process = self.processes[node]
        for pid in [process.pid, *descendants(process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()

    def close(self) -> None:
        for node in range(len(self.processes)):
            self.kill_tree(node)


def kill_rank(job: Job, memory: Path) -> list[int] | None:
    """SIGKILL rank 1's training process; return the training processes the failure ends (each to wait for), or
    None when no rank 1 runs yet."""
    victim = worker_of_rank(job.processes[0].pid, 1)
    if victim is None:
        return None
    ended = job.workers()
    os.kill(victim, signal.SIGKILL)
    return ended


def kill_node(job: Job, memory: Path) -> list[int] | None:
    """The last node lost: its launcher and every process under it SIGKILLed, its memory (--snapshot-dir) wiped,
    and a fresh launcher started in its place (a replaced node: its agent's attempt 0) while the other nodes'
    launchers restart their workers. Returns the training processes the failure ends, or None when the node runs
    none yet."""
    node = len(job.processes) - 1
    if not workers(job.processes[node].pid):
        return None
    ended = job.workers()
    job.kill_tree(node)
    shutil.rmtree(memory)
    memory.mkdir()
    job.start(node)
    return ended


FAULTS = {"rank": kill_rank, "node": kill_node}
NODES = {"rank": 1, "node": 2}  # the nodes of 2 ranks each fault's run has


def run_mode(name: str, fault: str, extra: list[str], args, workdir: Path, memory: Path) -> dict:
    run = f"{name}-{fault}"
    launchers = commands(run, extra, workdir, memory, NODES[fault])
    for node in range(len(launchers)):
        node_memory(memory, run, node).mkdir(parents=True)
    load_start, start = os.getloadavg(), time.monotonic()
    job = Job(launchers, [workdir / f"{run}-node{n}.log" for n in range(len(launchers))])
    tail = MetricsTail(workdir / run / "metrics.jsonl")
    failures, next_kill, kill = [], math.inf, None  # the first fault comes --fault-every after the first step
    clean = None  # (seconds, steps) from the first step recorded to the first kill: the failure-free pace
    first_seen = None
    try:
        while time.monotonic() - start < args.budget and not (args.max_kills and len(failures) >= args.max_kills):
            time.sleep(0.05)
            records, now = tail.poll(), time.monotonic()
            if first_seen is None and records:
                first_seen, next_kill = (now, tail.last_step), now + args.fault_every
            if kill is not None:  # waiting for the restarted job's first step
                first = next((r for r in records if "launch_times" in r and r["launch_times"]["train"] > kill["at"]),
                             None)
                if first is not None:
                    kill.update(resumed=first["step"] - 1, phases=breakdown(kill["at"], kill["gone"],
                                                                            first["launch_times"]))
                    kill["lost"] = kill["reached"] - kill["resumed"]
                    kill["recovery_s"] = first["launch_times"]["first_step"] - kill["at"]
                    kill["restored"] = first.get("restored_from")
                    failures.append(kill)
                    kill, next_kill = None, now + args.fault_every
            elif now >= next_kill and records:  # the job is stepping
                at, sizes = time.time(), job.log_sizes()
                ended = FAULTS[fault](job, node_memory(memory, run, len(launchers) - 1))
                if ended is None:
                    continue
                if clean is None and first_seen is not None:
                    clean = (now - first_seen[0], tail.last_step - first_seen[1])
                kill = {"at": at, "log_at": sizes}
                while any(alive(pid) for pid in ended) and time.time() - at < 60:
                    time.sleep(0.005)
                kill["gone"] = time.time()
                tail.poll()
                kill["reached"] = tail.last_step  # the survivor may have recorded the step under way
    finally:
        wall = time.monotonic() - start
        job.close()
    for failure, after in zip(failures, [*failures[1:], None]):  # what each restart said it resumed from
        said = job.said_since(failure.pop("log_at"), "paratrain: resumed", after and after["log_at"])
        failure["resumed_from"] = said[0] if said else "a fresh start (nothing to resume from)"
    kept = tail.poll()
    if clean is None and first_seen is not None:  # no kill: the whole run
        clean = (wall - (first_seen[0] - start), tail.last_step - first_seen[1])
    return {"mode": name, "fault": fault, "commands": [" ".join(c[1:]) for c in launchers], "wall_s": wall,
            "steps_kept": len(kept), "step_time_s": sum(r["step_time_s"] for r in kept),
            "clean_s_per_step": clean[0] / clean[1] if clean and clean[1] else None,
            "kills": len(failures) + (kill is not None), "failures": failures,
            "load_start": load_start, "load_end": os.getloadavg()}


MODES = {"disk": lambda args: ["--checkpoint-every", args.disk_every],
         "snapshots": lambda args: ["--checkpoint-every", args.disk_every, "--snapshot-every", str(args.snapshot_every)]}


@contextlib.contextmanager
def holding(lock: str | None):
    """The exclusive flock of `lock` held (none: nothing): a machine others measure on too."""
    if not lock:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> None:
    p = doc_parser(__doc__)
    p.add_argument("--budget", type=float, default=600, help="wall-clock seconds of each mode")
    p.add_argument("--fault-every", type=float, default=60,
                   help="seconds from a recovery (at first from the first step) to the next fault")
    # Young/Daly's interval, sqrt(2 C M): a snapshot's cost C about 30 ms of these steps' time (K = 20 slowed the
    # 30 ms step by 1.5 ms), M = 60 s between faults: 1.9 s, about 60 steps; 50 keeps the steps lost below it.
    p.add_argument("--snapshot-every", type=int, default=50, help="K of the snapshots mode")
    p.add_argument("--disk-every", default="30m", help="--checkpoint-every of both modes (the trainer's default)")
    p.add_argument("--max-kills", type=int, default=0,
                   help="end a mode once this many kills have been recovered from (0: run out the budget)")
    p.add_argument("--modes", default="disk,snapshots", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--faults", default="rank,node",
                   help="comma-separated, of rank (rank 1's process killed, one node of 2 ranks) and node (the "
                        "second of 2 nodes of 2 ranks killed, launcher and workers, its memory wiped and a fresh "
                        "launcher started in its place); each mode runs under each fault")
    p.add_argument("--lock", default="", help="a file whose exclusive lock (flock) each mode holds while it runs")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory of the results")
    args = p.parse_args()
    modes, faults = args.modes.split(","), args.faults.split(",")
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes {args.modes}: expected a comma-separated list of {', '.join(MODES)}")
    if not faults or set(faults) - set(FAULTS):
        p.error(f"--faults {args.faults}: expected a comma-separated list of {', '.join(FAULTS)}")
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    # The node's memory, as the trainer's default --snapshot-dir is: a tmpfs where there is one.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp, \
            tempfile.TemporaryDirectory(prefix="bench-goodput-", dir=shm) as memory:
        # Tokenized once, as a production run's corpus is (`paratrain prepare`): a launch maps it, not re-reads text.
        subprocess.run([sys.executable, "-m", "paratrain", "prepare", "--out", str(Path(tmp) / "data")], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fault in faults:
            for name in modes:
                with holding(args.lock):
                    rows.append(run_mode(name, fault, MODES[name](args), args, Path(tmp), Path(memory)))
    text = report(rows, args, now)
    print(text)
    write_results(args.out, "goodput", now, text, {"rows": rows, "machine": machine(), "args": vars(args)})


FAULT_TEXT = {"rank": "one node of 2 CPU ranks, rank 1's process killed with SIGKILL",
              "node": "two nodes of 2 CPU ranks (two launchers meeting at a rendezvous on the loopback, each its own "
                      "--snapshot-dir), the second node killed (its launcher and every process under it, SIGKILL), "
                      "its --snapshot-dir wiped and a fresh launcher started in its place"}


def restored_text(failure: dict) -> str:
    """Where a restart's ranks restored from, by its first record's `restored_from`."""
    restored = failure.get("restored") or {}
    if restored.get("source") != "snapshots":
        return restored.get("source", "?")
    ranks = restored["ranks"]
    kinds = {kind: [r for r, k in enumerate(ranks) if k == kind] for kind in dict.fromkeys(ranks)}
    return "memory: " + ", ".join(f"{kind} {','.join(map(str, rs))}" for kind, rs in kinds.items())


def report(rows: list[dict], args, now: datetime.datetime) -> str:
    """The results in markdown: goodput per mode and fault, the lost steps, where a failure's time goes."""
    m = machine()
    lines = [f"# Goodput under failures ({now:%Y-%m-%d %H:%M} UTC)", "",
             f"{m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}, Python {m['python']}; load average "
             + "; ".join(f"{r['mode']}/{r['fault']} {fmt_load(r['load_start'])} at the start, "
                         f"{fmt_load(r['load_end'])} at the end" for r in rows)
             + f". A fault every {args.fault_every:g} s (after the previous recovery) for {args.budget:g} s per mode "
             f"and fault, disk checkpoints every {args.disk_every}, snapshots every {args.snapshot_every} step(s). "
             + " ".join(f"Fault {f}: {FAULT_TEXT[f]}." for f in dict.fromkeys(r["fault"] for r in rows)), "",
             "Goodput: the steps kept (each once) times the failure-free wall time per step (the first mode's pace "
             "under the same fault before its first kill), over the wall time (the first start included); beside "
             "it the steps' own step_time_s summed over the wall time.", "",
             "| fault | mode | pace (ms/step) | goodput | by own step times | steps kept | kills | steps lost per failure "
             "| kill to next step (s) |", "|---|---|---|---|---|---|---|---|---|"]
    paces = {}
    for r in rows:
        paces.setdefault(r["fault"], r["clean_s_per_step"] or float("nan"))
        pace = r["pace_s"] = paces[r["fault"]]
        r["goodput"] = r["steps_kept"] * pace / r["wall_s"]
        r["goodput_own_step_time"] = r["step_time_s"] / r["wall_s"]
        lost = [f["lost"] for f in r["failures"]]
        recovery = [f["recovery_s"] for f in r["failures"]]
        lines.append(f"| {r['fault']} | {r['mode']} | {pace * 1e3:.1f} | {r['goodput']:.3f} | "
                     f"{r['goodput_own_step_time']:.3f} | {r['steps_kept']} | {r['kills']} | "
                     f"{', '.join(map(str, lost)) or '—'} | "
                     + (f"{statistics.median(recovery):.2f} median, {min(recovery):.2f}–{max(recovery):.2f}"
                        if recovery else "—") + " |")
    lines.append("")
    for r in rows:
        if r["mode"] == "snapshots" and r["failures"]:
            most = max(f["lost"] for f in r["failures"])
            lines.append(f"- {r['fault']}, snapshots: at most {most} step(s) lost per failure, K = {args.snapshot_every} "
                         f"({'within' if most <= args.snapshot_every else 'beyond'} K); restored per failure (rank "
                         f"by rank: own = its node's memory, copy = the buddy's copy): "
                         + "; ".join(restored_text(f) for f in r["failures"]))
        base = next(b for b in rows if b["fault"] == r["fault"])
        if base is not r and base["goodput"]:
            lines.append(f"- {r['fault']}: {r['mode']} / {base['mode']} goodput {r['goodput'] / base['goodput']:.2f}x")
    lines += ["", "Where a failure's time goes, from the kill to the first step after it (median seconds per failure):",
              "", "| phase | what | " + " | ".join(f"{r['mode']}/{r['fault']}" for r in rows) + " |",
              "|---|---|" + "---|" * len(rows)]
    for name, what in PHASES:
        cells = [f"{statistics.median(f['phases'][name] for f in r['failures']):.3f}" if r["failures"] else "—"
                 for r in rows]
        lines.append(f"| {name} | {what} | " + " | ".join(cells) + " |")
    cells = [f"{statistics.median(f['lost'] for f in r['failures']) * r['pace_s']:.3f}" if r["failures"] else "—"
             for r in rows]
    lines += [f"| steps redone | the lost steps at the failure-free pace | " + " | ".join(cells) + " |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
