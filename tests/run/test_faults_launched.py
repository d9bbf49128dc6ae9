"""Real faults under the real launcher: `paratrain train --nproc 2` in a subprocess, one injected fault each.

A run whose ranks' output no test reads (an uninterrupted reference, a failure the launcher's one line explains)
is launched from this process instead (`launch_here`): the same launcher and ranks, without an interpreter that
imports torch again.

"Bit-equal" compares, with one uninterrupted run of the same command, the loss of every step
as float.hex and the final weights (final/model.safetensors) with torch.equal.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from paratrain.parallel.model import _FLAGS

# The step's agreement: its flags and at least the trainer's 3 counts, a column per rank (2), then a flag per master.
AGREEMENT = r"all_reduce over world shape \[(\d+)\] float64"
AGREEMENT_ROWS = (len(_FLAGS) + 3) * 2
from safetensors.torch import load_file

from paratrain.checkpoint import verify_checkpoint
from paratrain.distributed import free_port
from paratrain.faults import FAULT_ENV, GATE_ENV
from paratrain.metrics import read_metrics
from paratrain.run.samples import read_samples

TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress"]
STEPS = 12
ARGS = [*TINY, "--steps", str(STEPS), "--checkpoint-every", "4", "--nproc", "2"]
# A bound on one launch that only a hang reaches: the slowest (5 attempts) takes under a minute on 2 loaded
# cores. Tests that check a run did not wait for a long timeout set that timeout beyond this one.
LAUNCH_TIMEOUT = 300
LONG_PG_TIMEOUT = "600"
# The process-group timeout a hung rank is named within: each of steps 1 to 4 and the save of step 4 keeps the two
# ranks well under it apart on a loaded machine; the hung rank sleeps an hour.
HANG_PG_TIMEOUT = 7

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def command(out, *extra) -> list[str]:
    return [sys.executable, "-m", "paratrain", "train", *ARGS, "--out", str(out), *extra]


def environment(fault: str, gate: Path | None = None) -> dict:
    """`gate`: a held checkpoint write (`ckpt_slow_write`) goes on once this file exists."""
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, GATE_ENV)}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env[FAULT_ENV] = fault
    if gate is not None:
        env[GATE_ENV] = str(gate)
    return env


def launch(out, *extra, fault: str = "", gate: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command(out, *extra), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          env=environment(fault, gate))


@contextlib.contextmanager
def injected(fault: str = "", gate: Path | None = None):
    """While the block runs, this process's environment with `fault` injected and `gate` set, as `environment`
    gives a subprocess: for launchers run in this process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(GATE_ENV, raising=False)
        patch.delenv(FAULT_ENV, raising=False)
        if fault:
            patch.setenv(FAULT_ENV, fault)
        if gate is not None:
            patch.setenv(GATE_ENV, str(gate))
        yield


def run_here(argv: list[str], fault: str = "", gate: Path | None = None) -> int:
    """`paratrain ARGV` from this process (`paratrain.cli.main`), `fault` injected (and `gate`, as `environment`):
    its exit code. A launcher's output reaches this process's stdout and stderr (`capfd`); its ranks', forked from
    the fork server, do not."""
    from paratrain.cli import main

    with injected(fault, gate):
        return main(argv)


def launch_here(out, *extra, fault: str = "", gate: Path | None = None) -> int:
    """`launch`'s run from this process (`run_here`): its exit code."""
    return run_here(command(out, *extra)[3:], fault, gate)


def assert_bit_equal(out: Path, reference: Path, steps: int = STEPS) -> None:
    """Every step of run `out` recorded once, with the loss of the uninterrupted `reference` to the bit, and the same
    final weights (a launched test of other runs passes their length)."""
    records, expected = read_metrics(out / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [float.hex(r["loss"]) for r in records] == [float.hex(r["loss"]) for r in expected]
    mine, theirs = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    assert launch_here(out) == 0
    return out


def test_kill_9_of_one_rank_mid_step_restarts_and_resumes_bit_equal(reference, tmp_path):
    out = tmp_path / "run"
    result = launch(out, "--max-restarts", "1", fault="sigkill@rank1:step7")
    assert result.returncode == 0, result.stderr
    assert "rank 1 never issued call" in result.stderr  # rank 0's diagnostic, from rank 1's fingerprint
    resumed = r"checkpoints/step-00000004 at step 4 \(saved .* by dp=2 .* on 2 process\(es\)\) \(2 metrics record\(s\)"
    assert re.search(resumed + r" after it dropped\)", result.stdout), result.stdout
    assert_bit_equal(out, reference)


def test_crashes_while_writing_a_checkpoint_leave_the_previous_one_in_use(reference, tmp_path):
    """Attempt 0: rank 1 dies after writing its shard of step 8; attempt 1: rank 0 dies before the commit marker."""
    out = tmp_path / "run"
    fault = "ckpt_kill_after_shard@rank1:step8,ckpt_kill_before_commit@rank0:step8:attempt1"
    result = launch(out, "--max-restarts", "2", fault=fault)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("checkpoints/step-00000004 at step 4") == 2
    assert result.stderr.count("incomplete checkpoint, no commit marker; quarantined") == 2
    assert "saving step-00000008 interrupted: lost contact with another rank" in result.stderr
    assert len([p for p in (out / "checkpoints").iterdir() if p.name.startswith(".incomplete-")]) == 2
    assert_bit_equal(out, reference)


def test_sigterm_to_the_launcher_saves_a_checkpoint_and_a_relaunch_resumes_bit_equal(reference, tmp_path):
    out, gate = tmp_path / "run", tmp_path / "gate"
    # Rank 0's save of step 4 is held until the gate opens, which happens once rank 0 has the signal:
    # step 5 is then the step under way, whatever the load.
    with open(tmp_path / "stdout", "w") as stdout:
        process = subprocess.Popen(command(out), stdout=stdout, stderr=subprocess.PIPE, text=True,
                                   env=environment("ckpt_slow_write@rank0:step4", gate))
    lines, signalled = [], threading.Event()

    def read_stderr():
        for line in process.stderr:
            lines.append(line)
            if line.startswith("paratrain: rank 0 got SIGTERM at step 4"):
                signalled.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while _steps_logged(out) < 4:  # then rank 0 is in its save of step 4, held
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert signalled.wait(LAUNCH_TIMEOUT), "".join(lines)
        gate.touch()
        process.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        process.kill()
        reader.join()
    err = "".join(lines)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM; newest checkpoint step-00000005: relaunch the same command to resume" in err
    assert _steps_logged(out) == 5, "the step under way when the signal came was finished, then saved"
    result = launch(out)
    assert result.returncode == 0, result.stderr
    assert "checkpoints/step-00000005 at step 5" in result.stdout
    assert_bit_equal(out, reference)


def _steps_logged(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_a_rank_hung_in_a_step_ends_the_run_within_the_timeout_naming_it(tmp_path, capfd):
    out = tmp_path / "run"
    code = launch_here(out, "--pg-timeout", str(HANG_PG_TIMEOUT), fault="hang@rank1:step5")
    ended = time.time()
    assert code == 1
    line = summary(capfd.readouterr().err)
    assert line.startswith("paratrain train: rank 0 exited with code 1: CollectiveFailure: rank 0 failed at step 5, "
                           "its last collective #"), line
    # rank 0 waits in the step's agreement (one all-reduce over the whole mesh), which rank 1 never reached
    waited = re.search(AGREEMENT + r" \(step 5\): rank 1 never issued call", line)
    assert waited and int(waited.group(1)) > AGREEMENT_ROWS, line
    assert "it is at step 5, hung or dead outside a collective (error: " in line and "Timed out" in line
    # Timed from rank 0's record of step 4 (then it saves step 4 and waits in step 5's agreement), not from
    # the launch, whose start-up is what a loaded machine slows: the timeout, then a stop of a second or two.
    waited = ended - (out / "metrics.jsonl").stat().st_mtime
    assert HANG_PG_TIMEOUT <= waited < HANG_PG_TIMEOUT + 20, \
        f"{waited:.1f} s from step 4's record to the end: the timeout and the stop, no more"


def test_a_collective_of_another_shape_on_one_rank_is_named(tmp_path, capfd):
    """Launched from this process: what is read is the launcher's line."""
    code = launch_here(tmp_path / "run", "--pg-timeout", "10", fault="desync_shape@rank1:step4")
    stderr = capfd.readouterr().err
    assert code == 1, stderr
    # gloo aborts the rank that receives more than it expects; the other explains.
    assert re.search(r"collectives diverged at call #(\d+): rank\(s\) \[0\] #\1 " + AGREEMENT
                     + r" \(step 4\) vs rank\(s\) \[1\] #\1 all_reduce over world shape \[64, 2\] float64 \(step 4\)",
                     stderr), stderr
    last = summary(stderr)  # from rank 1's error, or when it was stopped first, from the fingerprint files
    assert last.startswith("paratrain train: rank 0 was killed by SIGABRT: ") and "collectives diverged" in last, last


def summary(stderr: str) -> str:
    """The launcher's one-line account of the failure, from its standard error."""
    return next(line for line in stderr.splitlines() if line.startswith("paratrain train: "))


def test_a_fault_on_every_attempt_ends_after_the_allowed_restarts(tmp_path, capfd):
    """--max-restarts 2 and a rank that fails on every attempt: exactly 3 attempts, exit 1, our message (the
    launcher's, in this process)."""
    out = tmp_path / "run"
    code = launch_here(out, "--max-restarts", "2", fault="raise@rank1:step3:attempt*")
    stderr = capfd.readouterr().err
    assert code == 1, stderr
    assert sorted(p.name for p in (out / "diagnostics").iterdir()) == ["attempt-0", "attempt-1", "attempt-2"]
    ours = [line for line in stderr.splitlines() if line.startswith("paratrain train: ")]
    assert len(ours) == 1 and "rank 1" in ours[0] and "injected fault: raise at rank 1, step 3" in ours[0], ours
    assert not list((out / "checkpoints").glob("step-*")), "no checkpoint before step 4"


def test_a_kill_while_purging_old_checkpoints_keeps_the_newest_and_resumes_bit_equal(reference, tmp_path):
    """Retention purges only after a commit: killed in the purge after step 6, the run resumes from step 6."""
    out = tmp_path / "run"
    result = launch(out, "--checkpoint-every", "2", "--keep-latest", "2", "--max-restarts", "1",
                    fault="kill_in_purge@rank0:step6")
    assert result.returncode == 0, result.stderr
    assert "checkpoints/step-00000006 at step 6" in result.stdout
    assert_bit_equal(out, reference)
    steps = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert steps == ["step-00000010", "step-00000012"]  # retention went on after the restart


# -- rows 4, 13, 16 and 24 of the fault plan ---------------------------------------------------------

def test_a_kill_while_an_async_save_is_in_flight_leaves_latest_and_retention_alone(reference, tmp_path, capfd):
    """Rank 0's shard of step 8 is held; rank 0 is killed in step 9, that save still in flight (launched from this
    process: only the launcher's line is read); the relaunch, whose ranks' output is read, in a subprocess."""
    out, args = tmp_path / "run", ("--checkpoint-async", "--checkpoint-every", "2", "--keep-latest", "2")
    # The gate never opens: rank 0's save of step 8 is held until the kill in step 9.
    code = launch_here(out, *args, fault="ckpt_slow_write@rank0:step8,sigkill@rank0:step9", gate=tmp_path / "shut")
    stderr = capfd.readouterr().err
    assert code == 1, stderr
    assert summary(stderr).startswith("paratrain train: rank 0 was killed by SIGKILL"), stderr
    root = out / "checkpoints"
    assert list(root.glob(".tmp-step-00000008-*")), "the save of step 8 was in flight when its process died"
    # Committed, step 8 would be `latest` and retention would have purged step 4.
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]
    assert (root / "latest").read_text().strip() == "step-00000006"
    verify_checkpoint(root / "step-00000006")
    result = launch(out, *args)
    assert result.returncode == 0, result.stderr
    assert "incomplete checkpoint, no commit marker; quarantined" in result.stderr
    assert "checkpoints/step-00000006 at step 6" in result.stdout
    assert_bit_equal(out, reference)


def small_corpus(directory: Path) -> Path:
    """481 bytes of text: with the byte tokenizer, 14 training sequences of 32 tokens (+ 33 held-out tokens).

    12 steps of 4 sequences read stream positions 0..47: epochs end at 14 (inside step 4), 28 (the
    end of step 7) and 42 (inside step 11).
    """
    path = directory / "corpus.txt"
    path.write_text(("the quick brown fox jumps over the lazy dog; " * 11)[:481])
    return path


def global_batches(out: Path) -> tuple[list[list[int]], list[int]]:
    """(each step's global batch of sample ids, rank 0's before rank 1's; the launch attempt that read each step)."""
    ranks = [read_samples(out, rank) for rank in (0, 1)]
    assert [[r["step"] for r in records] for records in ranks] == [list(range(1, STEPS + 1))] * 2
    assert [r["attempt"] for r in ranks[0]] == [r["attempt"] for r in ranks[1]]
    return [a["sample_ids"] + b["sample_ids"] for a, b in zip(*ranks)], [r["attempt"] for r in ranks[0]]


def test_killed_and_resumed_runs_read_exactly_the_samples_of_an_uninterrupted_run(tmp_path):
    """Four kills in one launch (steps 3, 6, 9 mid-epoch, 11 across an epoch boundary), resumed each time."""
    args = ("--data", str(small_corpus(tmp_path)), "--checkpoint-every", "2", "--log-samples")
    reference_out, out = tmp_path / "reference", tmp_path / "run"
    assert launch_here(reference_out, *args) == 0
    kills = "sigkill@rank1:step3,sigkill@rank0:step6:attempt1,sigkill@rank1:step9:attempt2,sigkill@rank0:step11:attempt3"
    result = launch(out, *args, "--max-restarts", "4", fault=kills)
    assert result.returncode == 0, result.stderr
    assert "14 training sequences" in result.stdout
    for step in (2, 4, 8, 10):
        assert f"checkpoints/step-{step:08d} at step {step}" in result.stdout
    batches, attempts = global_batches(out)
    expected, _ = global_batches(reference_out)
    assert attempts == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4], "each step read by the attempt that resumed before it"
    assert batches == expected
    stream = [i for batch in batches for i in batch]
    for start in range(0, len(stream), 14):  # every epoch of 14 samples: each one once, none skipped
        epoch = stream[start:start + 14]
        assert len(set(epoch)) == len(epoch), f"a sample read twice in epoch {start // 14}"
        if len(epoch) == 14:
            assert sorted(epoch) == list(range(14)), f"a sample skipped in epoch {start // 14}"
    assert_bit_equal(out, reference_out)


def test_a_rank_hung_outside_collectives_is_killed_by_the_step_watchdog_and_the_job_resumes(reference, tmp_path):
    """hang_data: rank 0 sleeps before its step's first collective; --step-timeout ends it long before --pg-timeout."""
    out = tmp_path / "run"
    # A process-group timeout beyond the launch's: a run that waited for it would not end in time.
    result = launch(out, "--step-timeout", "4", "--pg-timeout", LONG_PG_TIMEOUT, "--max-restarts", "1",
                    fault="hang_data@rank0:step5")
    assert result.returncode == 0, result.stderr
    assert re.search(r"paratrain: rank 0 at step 5 made no progress for 4 s \(--step-timeout\): killing its "
                     r"process \(\d+\); the launcher restarts the job if --max-restarts allows \[.*rank 0 never "
                     r"issued call #\d+ .* hung or dead outside a collective\]", result.stderr), result.stderr
    assert "checkpoints/step-00000004 at step 4" in result.stdout
    assert_bit_equal(out, reference)


def test_without_a_launcher_the_step_watchdog_ends_the_hung_process_itself(tmp_path):
    """One process, no launcher: the timer server is a thread of the process, which it kills."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "paratrain", "train", *TINY, "--steps", "6", "--step-timeout", "2",
                             "--out", str(out)], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                            env=environment("hang_data@rank0:step3"))
    ended = time.time()
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert re.fullmatch(r"paratrain: rank 0 at step 3 made no progress for 2 s \(--step-timeout\): ending this "
                        r"process \(\d+\)", result.stderr.strip()), result.stderr
    assert len(read_metrics(out / "metrics.jsonl")) == 2
    # From step 2's record (step 3's countdown starts after it) to the kill: the 2 s, the server's 0.5 s poll,
    # and room for the load; not from the start, which a loaded machine slows.
    waited = ended - (out / "metrics.jsonl").stat().st_mtime
    assert 2 <= waited < 2 + 20, f"{waited:.1f} s from step 2's record to the kill"


def test_out_of_memory_on_one_rank_ends_every_rank_promptly_with_a_hint(tmp_path, capfd):
    """A MemoryError on rank 1 mid-step, rank 0 waiting for it in the step's agreement (a 600 s timeout)."""
    # The process-group timeout is beyond the launch's: a rank that waited for it would not end in time.
    start = time.monotonic()
    assert launch_here(tmp_path / "run", "--pg-timeout", LONG_PG_TIMEOUT, fault="oom@rank1:step4") == 1
    assert time.monotonic() - start < LAUNCH_TIMEOUT
    line = summary(capfd.readouterr().err)
    assert line.startswith("paratrain train: rank 1 exited with code 1: OutOfMemory: rank 1 ran out of memory at "
                           "step 4 (injected fault: out of memory at rank 1, step 4); lower --micro-batch"), line
    assert line.endswith("`paratrain plan` estimates each layout's memory"), line
    # Rank 0 left its collective at once (gloo saw rank 1's connections close) or on the launcher's
    # SIGTERM, seeing rank 1's failure mark: either way without waiting for the timeout.
    assert (tmp_path / "run" / "diagnostics" / "attempt-0" / "failed-rank-1").exists()


def test_a_rendezvous_that_never_fills_ends_with_one_line(tmp_path, capfd):
    """--nnodes 2 and a single launcher, in this process: the c10d rendezvous gives up after --join-timeout."""
    endpoint = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    code = run_here(["train", *TINY, "--steps", "2", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                     "--rdzv-id", "lonely", "--join-timeout", "3", "--out", str(tmp_path / "run")])
    elapsed = time.monotonic() - start
    stderr = capfd.readouterr().err
    assert code == 1
    assert stderr.strip() == (
        f"paratrain train: the rendezvous at {endpoint} (--rdzv-id lonely) timed out after 3 s (--join-timeout) "
        f"before all 2 node(s) (--nnodes) joined; start `paratrain train` with the same --nnodes, --rdzv-endpoint "
        f"and --rdzv-id on every node, or lower --nnodes"), stderr
    # At least the join timeout; and not torch's default 600 s.
    assert 3 <= elapsed < LAUNCH_TIMEOUT, f"{elapsed:.1f} s"
    assert not (tmp_path / "run").exists(), "no worker ever started"
