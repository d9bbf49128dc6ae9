"""Goodput under failures: a run killed every T seconds, restarted from disk checkpoints alone or from snapshots.

    python benchmarks/bench_goodput.py                                  # 10 minutes per mode, a kill every 60 s
    python benchmarks/bench_goodput.py --budget 180 --fault-every 40    # shorter

Each mode runs `paratrain train --nproc 2 --max-restarts N` (one node of two CPU ranks) for a fixed wall-clock
budget; every --fault-every seconds this script kills rank 1's worker with SIGKILL, from outside, and the
launcher restarts the job, which resumes as it would after a real failure. Modes: "disk" (checkpoints at
--disk-every, the trainer's default interval unless given) and "snapshots" (the same, plus --snapshot-every K).

Measured, per mode: goodput = the step time of the steps that survive in metrics.jsonl (each step once, the last
attempt's) over the wall time; the steps lost per failure (the last step recorded before the kill minus the step
the restart resumed from); the time from each kill to the first step recorded after it. The next kill comes
--fault-every seconds after the run recovered.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import doc_parser, fmt_load, machine, write_results

TINY = ["--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "128",
        "--seq-len", "64", "--global-batch", "8", "--micro-batch", "4", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress"]


STARTED = "paratrain: tiny ("  # the line rank 0 prints once the run is built and resumed, at each attempt


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


def records(out: Path) -> list[dict]:
    try:
        lines = (out / "metrics.jsonl").read_text().split("\n")[:-1]
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def run_mode(name: str, extra: list[str], args, workdir: Path) -> dict:
    out = workdir / name
    command = [sys.executable, "-m", "paratrain", "train", *TINY, "--steps", "1000000", "--nproc", "2",
               "--max-restarts", "1000", "--snapshot-dir", str(workdir / "memory"), "--out", str(out), *extra]
    log = open(workdir / f"{name}.log", "w")
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    kills, recoveries, lost, next_kill = [], [], [], start + args.fault_every
    attempts, reached, resumed = 0, None, None  # after a kill: the first lines so far, the newest step recorded, the resumed step
    try:
        while time.monotonic() - start < args.budget:
            time.sleep(0.1)
            now, steps = time.monotonic(), [r["step"] for r in records(out)]
            if reached is not None and resumed is None:  # until the restarted job has resumed (its first line)
                reached = max([reached, *steps])  # the survivor may record the step under way
                if (workdir / f"{name}.log").read_text().count(STARTED) > attempts:
                    resumed = steps[-1] if steps else 0  # metrics.jsonl cut back to the resumed step
            elif resumed is not None and steps and steps[-1] > resumed:  # the first step after the kill
                recoveries.append(now - kills[-1])
                lost.append(reached - resumed)
                reached = resumed = None
                next_kill = now + args.fault_every
            elif reached is None and now >= next_kill:
                pid = worker_of_rank(process.pid, 1)
                if pid is not None:
                    attempts = (workdir / f"{name}.log").read_text().count(STARTED)
                    reached = max(steps, default=0)
                    os.kill(pid, signal.SIGKILL)
                    kills.append(now)
    finally:
        wall = time.monotonic() - start
        for pid in [process.pid, *descendants(process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()
        log.close()
    kept = records(out)
    useful = sum(r["step_time_s"] for r in kept)
    return {"mode": name, "command": " ".join(command[1:]), "wall_s": wall, "steps_kept": len(kept),
            "useful_s": useful, "goodput": useful / wall, "kills": len(kills), "lost_per_failure": lost,
            "recovery_s": recoveries}


def main() -> None:
    p = doc_parser(__doc__)
    p.add_argument("--budget", type=float, default=600, help="wall-clock seconds of each mode")
    p.add_argument("--fault-every", type=float, default=60, help="seconds between kills of rank 1")
    p.add_argument("--snapshot-every", type=int, default=1, help="K of the snapshots mode")
    p.add_argument("--disk-every", default="30m", help="--checkpoint-every of both modes (the trainer's default)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory of the results")
    args = p.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        rows = [run_mode(name, extra, args, Path(tmp)) for name, extra in (
            ("disk", ["--checkpoint-every", args.disk_every]),
            ("snapshots", ["--checkpoint-every", args.disk_every, "--snapshot-every", str(args.snapshot_every)]))]
    load_end = os.getloadavg()
    m = machine()
    lines = [f"# Goodput under failures ({now:%Y-%m-%d %H:%M} UTC)", "",
             f"{m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}, Python {m['python']}; load average "
             f"{fmt_load(load_start)} at the start, {fmt_load(load_end)} at the end. One node of 2 CPU ranks, "
             f"rank 1 killed every {args.fault_every:g} s for {args.budget:g} s per mode, checkpoints every "
             f"{args.disk_every}, snapshots every {args.snapshot_every} step(s).", "",
             "| mode | goodput | steps kept | kills | steps lost per failure | kill to next step (s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        recovery = f"{statistics.median(r['recovery_s']):.1f} median" if r["recovery_s"] else "—"
        lines.append(f"| {r['mode']} | {r['goodput']:.3f} | {r['steps_kept']} | {r['kills']} | "
                     f"{', '.join(map(str, r['lost_per_failure'])) or '—'} | {recovery} |")
    ratio = rows[1]["goodput"] / rows[0]["goodput"] if rows[0]["goodput"] else float("inf")
    # A step of the snapshots mode is slower (its background writes share the cores): its steps counted at the
    # disk mode's mean step time say what the snapshots' own cost leaves of the run.
    clean_s = rows[0]["useful_s"] / rows[0]["steps_kept"] if rows[0]["steps_kept"] else float("nan")
    for r in rows:
        r["goodput_at_disk_step"] = r["steps_kept"] * clean_s / r["wall_s"]
    lines += ["", f"snapshots / disk goodput: {ratio:.2f}x; counting every kept step at the disk mode's mean step "
                  f"time ({clean_s * 1e3:.1f} ms): {rows[0]['goodput_at_disk_step']:.3f} and "
                  f"{rows[1]['goodput_at_disk_step']:.3f}", ""]
    text = "\n".join(lines)
    print(text)
    write_results(args.out, "goodput", now, text, {"rows": rows, "machine": m, "load_start": load_start,
                                                     "load_end": load_end, "args": vars(args)})


if __name__ == "__main__":
    main()
