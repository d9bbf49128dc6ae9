"""Snapshots in node memory with a copy on a buddy (`paratrain.checkpoint.snapshot`) and stragglers named.

The launched tests run `paratrain train` in subprocesses: one node of 2 ranks, or two or three "nodes" of one rank
each (launchers meeting at one rendezvous on this machine, each with its own --snapshot-dir as a node's memory).
A run is killed (--max-restarts 0: the launch fails), the test does to the snapshot directories what the failure
would (a node replaced: its directory wiped), then relaunches the same command. A run whose output is not read (a
killed one, an uninterrupted reference) has every node's launcher in the test's process (`launch_nodes_here`),
without an interpreter to start.
"Bit-equal" compares every step's loss as float.hex and the final weights with one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint.snapshot import (
    COPY, OWN, BuddyError, buddies, buddy_of, entry_name, install, pack_files, parse_buddies, plan_restore, sender_of,
    unpack_files,
)
from paratrain.config import Config
from paratrain.distributed import free_port
from paratrain.metrics import StragglerWatch, read_metrics
from paratrain.run.checkpoints import describe_sources
from paratrain.train import train
from test_faults_launched import assert_bit_equal as bit_equal, environment, injected

TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress"]
STEPS = 10
ARGS = [*TINY, "--steps", str(STEPS), "--checkpoint-every", "4"]
LAUNCH_TIMEOUT = 300


# -- in-process: the pairing, the plan, the files --------------------------------------------------------------

def test_the_buddy_is_the_same_local_rank_on_the_next_node_or_the_next_local_rank_on_one_node():
    assert [buddy_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [buddy_of(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [buddy_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]
    assert buddy_of(0, 1, 1) is None
    for world, local in ((8, 4), (6, 2), (4, 4), (2, 1)):
        for r in range(world):
            assert buddy_of(r, world, local) != r and sender_of(buddy_of(r, world, local), world, local) == r
            if world > local:
                assert buddy_of(r, world, local) // local != r // local  # another node


def test_the_pairing_is_overridden_by_a_rule_or_an_explicit_map():
    assert [buddy_of(r, 8, 4, "next-rank") for r in range(8)] == [1, 2, 3, 4, 5, 6, 7, 0]
    pairs = "0:2, 1:3,2:0,3:1"
    assert [buddy_of(r, 4, 2, pairs) for r in range(4)] == [2, 3, 0, 1]
    assert [buddy_of(r, 4, 4, pairs) for r in range(4)] == [2, 3, 0, 1]  # a map pairs as it says, whatever the nodes
    assert [sender_of(r, 3, 3, "0:2,1:0,2:1") for r in range(3)] == [1, 2, 0]
    assert parse_buddies("next-node") == "next-node" and parse_buddies("1:0,0:1", 2) == {0: 1, 1: 0}
    assert buddy_of(0, 1, 1, "0:1,1:0") is None  # one process: no buddy, whatever the rule


@pytest.mark.parametrize("rule, world, message", [
    ("next-door", None, "--snapshot-buddy 'next-door': expected next-node or next-rank, or a map of every rank"),
    ("0:1,1", None, "--snapshot-buddy '0:1,1': '1' is not RANK:BUDDY (two whole numbers)"),
    ("0:1,0:2,2:0", None, "rank 0 is given two buddies"),
    ("0:1,2:0", None, "the ranks must be 0 to 1, each once"),
    ("0:1,1:1", None, "each rank holds one copy, but rank(s) 1 would hold several or are no rank of the map"),
    ("0:5,1:0", None, "rank(s) 5 would hold several or are no rank of the map"),
    ("0:0,1:1", None, "rank(s) 0, 1 would hold their own copy"),
    ("0:1,1:0", 4, "--snapshot-buddy '0:1,1:0': it pairs 2 rank(s), the job has 4"),
])
def test_a_pairing_that_is_not_one_buddy_per_rank_is_refused_in_one_line(rule, world, message):
    with pytest.raises(BuddyError) as refused:
        parse_buddies(rule, world)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    if world:
        with pytest.raises(BuddyError):
            buddies(world, world, rule)


def inventory(own: dict[int, list[int]] | None = None, copy: dict[int, list[int]] | None = None) -> dict:
    return {OWN: {str(r): s for r, s in (own or {}).items()}, COPY: {str(r): s for r, s in (copy or {}).items()}}


def test_the_plan_takes_the_newest_step_complete_for_every_rank_from_the_nearest_copy():
    # rank 1 died writing step 7; rank 0 holds rank 1's copies of 5 and 6, rank 1 rank 0's of 5..7
    plan = plan_restore([inventory({0: [5, 6, 7]}, {1: [5, 6]}), inventory({1: [5, 6]}, {0: [5, 6, 7]})], 4)
    assert plan == {"source": "memory", "step": 6, "holders": [[0, OWN], [1, OWN]]}
    # node 1 replaced: its directory is empty, rank 1's copy is on rank 0
    plan = plan_restore([inventory({0: [5, 6]}, {1: [5, 6]}), inventory()], 4)
    assert plan == {"source": "memory", "step": 6, "holders": [[0, OWN], [0, COPY]]}
    # the ranks renumbered: rank 0's own snapshot is now in rank 1's directory and rank 0 holds a copy of it
    plan = plan_restore([inventory(copy={0: [6]}), inventory({0: [6]}, {1: [6]})], None)
    assert plan["holders"] == [[0, COPY], [1, COPY]]
    plan = plan_restore([inventory(), inventory({0: [6]}, {1: [6]})], None)
    assert plan["holders"] == [[1, OWN], [1, COPY]]


def test_the_first_line_says_where_each_ranks_snapshot_came_from():
    assert describe_sources([[0, OWN], [1, OWN]]) == "every rank from its own"
    assert describe_sources([[0, OWN], [0, COPY]]) == "rank(s) 1 from the copy a buddy held, the others from their own"
    assert describe_sources([[1, OWN], [1, COPY]]) == ("rank(s) 1 from the copy a buddy held, rank(s) 0 from their "
                                                       "own held on another node")


def test_the_plan_falls_back_to_disk_when_a_rank_has_no_copy_or_the_disk_is_newer():
    both_lost = plan_restore([inventory({0: [5, 6]}), inventory()], 4)
    assert both_lost["source"] == "disk" and "rank(s) 1 have none" in both_lost["why"]
    apart = plan_restore([inventory({0: [6]}), inventory({1: [5]})], 4)
    assert apart["source"] == "disk" and "no step is complete on every rank" in apart["why"]
    assert plan_restore([inventory({0: [6]}), inventory({1: [6]})], 8) == {"source": "disk", "why": ""}
    assert plan_restore([inventory(), inventory()], None) == {"source": "disk", "why": ""}
    assert plan_restore([inventory({0: [8]}), inventory({1: [8]})], 8)["source"] == "memory"  # a tie: memory


def test_a_snapshot_travels_as_one_tensor_and_is_installed_whole(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    files = {"index.json": b"{}", "manifest.json": b"[]", "rank-00000.safetensors": bytes(range(256)) * 3}
    for name, data in files.items():
        (source / name).write_bytes(data)
    assert unpack_files(pack_files(source)) == files
    root = tmp_path / entry_name(COPY, 1)
    for step in (1, 2, 3, 4):
        install(root, step, files)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003", "step-00000004"]
    assert {p.name: p.read_bytes() for p in (root / "step-00000004").iterdir()} == files


def test_a_straggler_is_named_after_the_steps_in_a_row_and_a_noisy_rank_is_not():
    watch = StragglerWatch(0.2, 3, ["a", "b", "c"])
    named = [watch.observe([0.010, 0.060, 0.011]) for _ in range(4)]
    assert [len(new) for _, new in named] == [0, 0, 1, 0]  # named once, at the third slow step
    assert [[s["rank"] for s in stragglers] for stragglers, _ in named] == [[], [], [1], [1]]
    first = named[2][1][0]
    assert first["host"] == "b" and first["median_s"] == 0.011 and first["compute_s"] == 0.060
    assert "rank 1 on b is a straggler: its compute took 60.0 ms at step 7 against the median's 11.0 ms" in \
        watch.describe(first, 7)
    noisy = StragglerWatch(0.2, 3, ["a", "b"])
    assert not any(noisy.observe(times)[0] for times in [[0.01, 0.05], [0.01, 0.01], [0.05, 0.01]] * 5)


def _snapshotting_run(tmp_path: Path, steps: int) -> Config:
    """One process of a one-layer model, a snapshot every step in tmp_path/memory, no disk checkpoint."""
    cfg = Config()
    cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 1, 32, 4, 2, 64
    cfg.data.seq_len = 32
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch = steps, 4, 4
    cfg.train.eval_every, cfg.train.eval_batches, cfg.train.sample_tokens = 0, 1, 0
    cfg.checkpoint.every, cfg.checkpoint.snapshot_every = 0, 1
    cfg.checkpoint.snapshot_dir = str(tmp_path / "memory")
    cfg.run.out, cfg.run.progress = str(tmp_path / "run"), False
    return cfg


def test_a_run_snapshots_each_step_within_its_checkpoint_time_and_leaves_no_snapshot_when_it_finishes(tmp_path):
    """One process, in this process: every step's snapshot is timed inside the step's checkpoint time (the stall
    of the copy), and the finished run deletes the job's snapshot directory."""
    cfg = _snapshotting_run(tmp_path, steps=4)
    train(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # The launch's way to its first step, in the first record alone: each point after the one before it.
    times = records[0]["launch_times"]
    order = ["process", "train", "group", "resume", "resumed", "first_step"]
    assert set(times) == set(order) and [times[k] for k in order] == sorted(times.values())
    assert times["first_step"] - times["resume"] < times["first_step"] - times["process"]
    assert not any("launch_times" in r for r in records[1:])
    breakdowns = [r["time_breakdown_s"] for r in records]
    assert breakdowns[0]["snapshot_s"] == 0.0  # a record tells the save after the step before it
    assert all(0 < b["snapshot_s"] <= b["checkpoint_s"] for b in breakdowns[1:]), breakdowns
    assert list((tmp_path / "memory").iterdir()) == []


def test_a_launch_that_is_no_restart_continues_a_run_that_has_snapshots_but_no_checkpoint(tmp_path, monkeypatch):
    """A node replacing a lost one starts its agent afresh (attempt 0) while the other nodes' agents restart: with
    snapshots on, or on several nodes (--nnodes, or a launcher's world beyond its node's ranks), its ranks continue
    the run in --out (the restore decides from where) rather than refuse it for lacking a disk checkpoint; one node
    without snapshots, another run's --out, or a finished run, are refused as before."""
    from paratrain.config import ConfigError
    from paratrain.run.rundir import claim_run_dir

    cfg = _snapshotting_run(tmp_path, steps=2)
    train(cfg)
    out = tmp_path / "run"
    cfg = Config.from_dict(json.loads((out / "config.json").read_text()))  # the options as the run resolved them
    shutil.move(out / "final", tmp_path / "final")  # as a run killed before its first disk checkpoint leaves it
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    assert claim_run_dir(cfg, restarted=False).fresh is False
    without = Config.from_dict(cfg.to_dict())
    without.checkpoint.snapshot_every = 0
    with pytest.raises(ConfigError, match="has no checkpoint to resume"):
        claim_run_dir(without, restarted=False)
    nodes = Config.from_dict(without.to_dict())
    nodes.run.nnodes, nodes.run.rdzv_endpoint, nodes.run.rdzv_id = 2, "127.0.0.1:29400", "job"
    assert claim_run_dir(nodes, restarted=False).fresh is False
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # under torchrun: 2 of the job's 4 ranks on this node
    assert claim_run_dir(without, restarted=False).fresh is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="has no checkpoint to resume"):
        claim_run_dir(without, restarted=False)
    other = Config.from_dict(cfg.to_dict())
    other.train.lr = cfg.train.lr * 2
    with pytest.raises(ConfigError, match="holds another run"):
        claim_run_dir(other, restarted=False)
    shutil.move(tmp_path / "final", out / "final")  # finished: nothing to continue
    with pytest.raises(ConfigError, match="has no checkpoint to resume"):
        claim_run_dir(cfg, restarted=False)


# -- launched -------------------------------------------------------------------------------------------------

def node_commands(out: Path, snapshot_dirs: list[Path], *extra: str) -> list[list[str]]:
    """One launcher's command per entry of `snapshot_dirs` (that node's memory), one rank each; one node: two ranks."""
    common = [sys.executable, "-m", "paratrain", "train", *ARGS, "--out", str(out), *extra]
    if len(snapshot_dirs) == 1:
        return [[*common, "--nproc", "2", "--snapshot-dir", str(snapshot_dirs[0])]]
    rendezvous = ["--nnodes", str(len(snapshot_dirs)), "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                  "--rdzv-id", out.name]
    return [[*common, "--nproc", "1", *rendezvous, "--snapshot-dir", str(d)] for d in snapshot_dirs]


def launch_nodes(out: Path, snapshot_dirs: list[Path], *extra: str,
                 fault: str = "") -> list[subprocess.CompletedProcess]:
    """`node_commands`' launchers, each in its own process (its output read)."""
    commands = node_commands(out, snapshot_dirs, *extra)
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=environment(fault)) for c in commands]
    results = []
    try:
        for command, process in zip(commands, processes):
            stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT)
            results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    finally:
        for process in processes:
            process.kill()
    return results


def launch_nodes_here(out: Path, snapshot_dirs: list[Path], *extra: str, fault: str = "") -> list[int]:
    """`node_commands`' launchers all in this process, their exit codes: the first on this thread, each other on a
    thread of its own (torch's agent installs its signal handlers from the main thread alone; these launchers get
    no signal). Their ranks' output is not read."""
    from paratrain.cli import main

    commands = node_commands(out, snapshot_dirs, *extra)
    codes: dict[int, int] = {}

    def node(n: int) -> None:
        codes[n] = main(commands[n][3:])

    with injected(fault):  # one environment for every node's launcher
        others = [threading.Thread(target=node, args=(n,), daemon=True) for n in range(1, len(commands))]
        for thread in others:
            thread.start()
        try:
            node(0)
        finally:
            for thread in others:
                thread.join(LAUNCH_TIMEOUT)
    assert sorted(codes) == list(range(len(commands))), codes
    return [codes[n] for n in range(len(commands))]


def kill_nodes_here(out: Path, snapshot_dirs: list[Path], *extra: str, fault: str) -> None:
    """`launch_nodes_here` of a run that `fault` ends on every node (--max-restarts 0)."""
    codes = launch_nodes_here(out, snapshot_dirs, *extra, fault=fault)
    assert all(codes), codes


def assert_bit_equal(out: Path, reference: Path, steps: int = STEPS) -> None:
    bit_equal(out, reference, steps)


def job_dir(snapshot_dir: Path) -> Path:
    """The job's subdirectory of a --snapshot-dir (named by the run id)."""
    (found,) = [p for p in snapshot_dir.iterdir() if p.is_dir()]
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run on one node of 2 ranks, snapshotting every step: it warns of no straggler."""
    base = tmp_path_factory.mktemp("reference")
    (result,) = launch_nodes(base / "run", [base / "snapshots"], "--snapshot-every", "1")
    assert result.returncode == 0, result.stderr
    assert "straggler" not in result.stderr and "straggler" not in result.stdout
    assert not any("stragglers" in r for r in read_metrics(base / "run" / "metrics.jsonl"))
    assert not list((base / "snapshots").iterdir()), "a finished run leaves no snapshot in memory"
    return base / "run"


def _damage_disk_checkpoints(out: Path) -> int:
    """Flip a byte in every shard of every disk checkpoint: any read of one fails its verification."""
    shards = list((out / "checkpoints").glob("step-*/rank-*.safetensors"))
    for shard in shards:
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    return len(shards)


def newest_complete(entry: Path) -> int:
    """The newest committed step of a snapshot entry (``rank-R`` or ``copy-R``); 0 when there is none."""
    steps = [int(p.name[5:]) for p in entry.glob("step-*") if (p / "manifest.json").exists()]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def one_node_killed(tmp_path_factory) -> Path:
    """One node of 2 ranks, rank 1 killed in step 7, once for the module: the directory that holds the run and the
    node's memory (`live`) and a copy of it as the kill left it (`killed`)."""
    base = tmp_path_factory.mktemp("one-node")
    kill_nodes_here(base / "live" / "run", [base / "live" / "snapshots"], "--snapshot-every", "1",
                    fault="sigkill@rank1:step7")
    shutil.copytree(base / "live", base / "killed", symlinks=True)
    return base


def _as_killed(base: Path, nodes: list[str]) -> tuple[Path, list[Path]]:
    """A killed run of `base` back in its own paths (`live`) as the kill left it: the run and the nodes' memory."""
    live = base / "live"
    shutil.rmtree(live)
    shutil.copytree(base / "killed", live, symlinks=True)
    return live / "run", [live / node for node in nodes]


def test_a_killed_rank_resumes_from_memory_without_reading_the_disk_bit_equal(reference, one_node_killed):
    out, (snapshots,) = _as_killed(one_node_killed, ["snapshots"])
    assert _damage_disk_checkpoints(out) == 2  # step 4, both ranks' shards
    # Step 6's snapshot was written in the background during step 7: complete, or (the kill came first) step 5's.
    step = min(newest_complete(job_dir(snapshots) / entry_name(OWN, r)) for r in (0, 1))
    assert step in (5, 6)
    (result,) = launch_nodes(out, [snapshots], "--snapshot-every", "1")
    assert result.returncode == 0, result.stderr
    first = next(line for line in result.stdout.splitlines() if line.startswith("paratrain: resumed"))
    assert first.startswith(f"paratrain: resumed from the snapshots in memory at step {step} (every rank from its "
                            f"own; no disk read)") and first.endswith(f": {6 - step} step(s) lost"), first
    assert "checksum mismatch" not in result.stderr  # the damaged disk checkpoint was never read
    assert_bit_equal(out, reference)


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it (a node lost: nothing leaves the rendezvous gracefully)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    tree, todo = [], [process.pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def test_a_node_lost_mid_run_is_replaced_by_a_fresh_launcher_while_the_other_restarts(reference, tmp_path):
    """Two nodes of one rank, live: the second node's launcher and worker SIGKILLed while rank 1 hangs in step 7,
    its memory wiped, a fresh launcher started in its place (its agent's attempt 0, a launch that is no restart)
    while the first node's agent restarts its worker. They meet in a new rendezvous round once the lost node's
    heartbeat expires (--node-timeout 3), rank 1 restores from the copy its buddy held, and the run ends bit-equal
    to an uninterrupted one; its first record after the restore says where each rank's state came from."""
    out, nodes = tmp_path / "run", [tmp_path / "node-a", tmp_path / "node-b"]
    port = free_port()
    command = [sys.executable, "-m", "paratrain", "train", *ARGS, "--out", str(out), "--snapshot-every", "1",
               "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "replaced",
               "--node-timeout", "3", "--max-restarts", "1"]

    def start(node: int, fault: str = "") -> subprocess.Popen:
        return subprocess.Popen([*command, "--snapshot-dir", str(nodes[node])], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=environment(fault))

    first = start(0)
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not _listening(port):  # node 0's launcher hosts the rendezvous store: the lost node must not be its host
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    second = start(1, fault="hang@rank1:step7")  # started second: the higher node rank, rank 1
    replacement = None
    try:
        while not (out / "metrics.jsonl").exists() or not any(r["step"] == 6 for r in read_metrics(out / "metrics.jsonl")):
            assert first.poll() is None and second.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert (job_dir(nodes[1]) / entry_name(OWN, 1)).is_dir()
        _kill_tree(second)
        shutil.rmtree(nodes[1])
        nodes[1].mkdir()
        replacement = start(1)
        results = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in (first, replacement)]
    finally:
        for process in (first, second, replacement):
            if process is not None and process.poll() is None:
                _kill_tree(process)
    assert first.returncode == 0 and replacement.returncode == 0, [stderr for _, stderr in results]
    lines = [line for stdout, _ in results for line in stdout.splitlines() if line.startswith("paratrain: resumed")]
    assert len(lines) == 1 and "(rank(s) 1 from the copy a buddy held, the others from their own; no disk read)" \
        in lines[0], lines
    step = int(lines[0].split(" at step ")[1].split()[0])
    restored = [(r["step"], r["restored_from"]) for r in read_metrics(out / "metrics.jsonl") if "restored_from" in r]
    assert restored == [(1, {"source": "none"}), (step + 1, {"source": "snapshots", "step": step,
                                                             "ranks": ["own", "copy"]})], restored
    assert_bit_equal(out, reference)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def test_both_copies_lost_fall_back_to_the_disk_checkpoint_in_one_line(reference, one_node_killed):
    """On one node of 2 ranks: rank 1's snapshots and the copy rank 0 holds of them lost, the plan falls back to
    the disk as it does for a lost node whose buddy's copy is lost too (the plan reads ranks, not nodes)."""
    out, nodes = _as_killed(one_node_killed, ["snapshots"])
    for lost in (entry_name(OWN, 1), entry_name(COPY, 1)):
        shutil.rmtree(job_dir(nodes[0]) / lost)
    results = launch_nodes(out, nodes, "--snapshot-every", "1")
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    stdout = "".join(r.stdout for r in results)
    fallback = [line for line in stdout.splitlines() if "no snapshot in memory" in line]
    assert fallback == ["paratrain: no snapshot in memory is complete on every rank: rank(s) 1 have none (own "
                        "snapshot and buddy's copy both lost); resuming from the newest disk checkpoint"], stdout
    assert "checkpoints/step-00000004 at step 4" in stdout and "snapshots in memory at step" not in stdout
    assert_bit_equal(out, reference)


def test_a_node_replaced_with_its_memory_wiped_restores_from_the_copy_on_its_named_buddy_bit_equal(tmp_path):
    """Three nodes of one rank, --snapshot-buddy 0:2,1:0,2:1 (the default would pair 0 with 1): each node holds the
    copy of the rank the map names. Rank 0 killed in step 5, its node replaced (its memory wiped) and every node's
    launcher started again: rank 0's snapshot comes from the copy on rank 2's node, the others' from their own, and
    the run ends bit-equal to an uninterrupted one on the same three nodes."""
    out, nodes = tmp_path / "run", [tmp_path / f"node-{n}" for n in "abc"]
    three = ["--snapshot-every", "1", "--snapshot-buddy", "0:2,1:0,2:1", "--global-batch", "6", "--steps", "6"]
    reference = tmp_path / "reference"
    assert launch_nodes_here(reference / "run", [reference / f"node-{n}" for n in "abc"], *three) == [0, 0, 0]
    kill_nodes_here(out, nodes, *three, fault="sigkill@rank0:step5")
    held, node_of = {}, {}  # the rank whose node it is -> the ranks whose copies it holds; -> its node's job directory
    for node in nodes:
        entries = [p.name for p in job_dir(node).iterdir()]
        (own,) = [int(name[5:]) for name in entries if name.startswith(OWN)]
        held[own], node_of[own] = sorted(int(name[5:]) for name in entries if name.startswith(COPY)), job_dir(node)
    assert held == {0: [1], 1: [2], 2: [0]}
    # The newest step the survivors hold for every rank: rank 0's copy on rank 2's node, ranks 1 and 2 their own.
    step = min(newest_complete(node_of[2] / entry_name(COPY, 0)), newest_complete(node_of[1] / entry_name(OWN, 1)),
               newest_complete(node_of[2] / entry_name(OWN, 2)))
    lost = node_of[0].parent
    shutil.rmtree(lost)
    lost.mkdir()
    # The rendezvous numbers the nodes in the order of their launchers' process ids (the killed run's shared one
    # process, where its threads' order decided): started in the order of the ranks they held, each node takes its own.
    results = launch_nodes(out, [node_of[rank].parent for rank in sorted(node_of)], *three)
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    lines = [line for r in results for line in r.stdout.splitlines() if line.startswith("paratrain: resumed")]
    assert len(lines) == 1 and lines[0].startswith(
        f"paratrain: resumed from the snapshots in memory at step {step} (rank(s) 0 from the copy a buddy held"), lines
    assert_bit_equal(out, reference / "run", 6)


def test_a_snapshot_torn_mid_write_is_never_restored(reference, tmp_path):
    out, snapshots = tmp_path / "run", tmp_path / "snapshots"
    kill_nodes_here(out, [snapshots], "--snapshot-every", "1", fault="snap_kill_mid_write@rank1:step7")
    torn = list((job_dir(snapshots) / entry_name(OWN, 1)).glob(".tmp-step-00000007-*"))
    assert torn and (torn[0] / "rank-00000.safetensors").exists() and not (torn[0] / "manifest.json").exists()
    (result,) = launch_nodes(out, [snapshots], "--snapshot-every", "1")
    assert result.returncode == 0, result.stderr
    assert "paratrain: resumed from the snapshots in memory at step 6 (every rank from its own" in result.stdout
    assert_bit_equal(out, reference)


def test_an_injected_straggler_is_named_within_the_straggler_steps(tmp_path):
    out = tmp_path / "run"
    (result,) = launch_nodes(out, [tmp_path / "snapshots"], "--straggler-steps", "3", fault="slow@rank1:step*")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1 and warnings[0].startswith("paratrain: warning: rank 1 on ") and \
        "more than 20% slower for 3 steps in a row" in warnings[0], result.stderr
    records = read_metrics(out / "metrics.jsonl")
    named = [r["step"] for r in records if "stragglers" in r]
    assert named and all(s["rank"] == 1 for r in records for s in r.get("stragglers", []))
    # slow by the records' own times from the first step on; the first step's start-up may hide the 50 ms
    slow = [r["step"] for r in records if r["compute_s_per_rank"][1] > 1.2 * sum(r["compute_s_per_rank"]) / 2]
    began = next(step for step in slow if {step, step + 1, step + 2} <= set(slow))
    assert named[0] == began + 2 <= 4, (named, slow)
    differences = sorted(r["compute_s_per_rank"][1] - r["compute_s_per_rank"][0] for r in records)
    assert differences[len(differences) // 2] > 0.04  # the 50 ms the fault adds, measured by the agreement
