"""Real faults under the real launcher: `paratrain train --nproc 2` in a subprocess, one injected fault each.

"Bit-equal" compares, with one uninterrupted run of the same command, the loss of every step
as float.hex and the final weights (final/model.safetensors) with torch.equal.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain.faults import FAULT_ENV
from paratrain.metrics import read_metrics

TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress"]
STEPS = 12
ARGS = [*TINY, "--steps", str(STEPS), "--checkpoint-every", "4", "--nproc", "2"]

pytestmark = pytest.mark.slow


def command(out, *extra) -> list[str]:
    return [sys.executable, "-m", "paratrain", "train", *ARGS, "--out", str(out), *extra]


def environment(fault: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env[FAULT_ENV] = fault
    return env


def launch(out, *extra, fault: str = "", timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(command(out, *extra), capture_output=True, text=True, timeout=timeout,
                          env=environment(fault))


def assert_bit_equal(out: Path, reference: Path) -> None:
    records, expected = read_metrics(out / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [float.hex(r["loss"]) for r in records] == [float.hex(r["loss"]) for r in expected]
    mine, theirs = load_file(out / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = launch(out)
    assert result.returncode == 0, result.stderr
    return out


def test_kill_9_of_one_rank_mid_step_restarts_and_resumes_bit_equal(reference, tmp_path):
    out = tmp_path / "run"
    result = launch(out, "--max-restarts", "1", fault="sigkill@rank1:step7")
    assert result.returncode == 0, result.stderr
    assert "rank 1 never issued call" in result.stderr  # rank 0's diagnostic, from rank 1's fingerprint
    assert "checkpoints/step-00000004 at step 4 (2 metrics record(s) after it dropped)" in result.stdout
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
    out = tmp_path / "run"
    # Rank 0's save of step 4 takes 2 s more: the signal arrives while the run is there.
    process = subprocess.Popen(command(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=environment("ckpt_slow_write@rank0:step4"))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and _steps_logged(out) < 4:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
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


def test_a_rank_hung_in_a_step_ends_the_run_within_the_timeout_naming_it(tmp_path):
    start = time.monotonic()
    result = launch(tmp_path / "run", "--pg-timeout", "10", fault="hang@rank1:step5")
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    line = summary(result)
    assert line.startswith("paratrain train: rank 0 exited with code 1: CollectiveFailure: rank 0 failed at step 5, "
                           "its last collective #"), line
    # rank 0 waits in the step's agreement (one all-reduce over the whole mesh), which rank 1 never reached
    assert "all_reduce over world shape [6, 2] float64 (step 5): rank 1 never issued call" in line
    assert "it is at step 5, hung or dead outside a collective (error: " in line and "Timed out" in line
    assert elapsed < 10 + 25, f"{elapsed:.1f} s: the timeout plus start-up, no more"


def test_a_collective_of_another_shape_on_one_rank_is_named(tmp_path):
    result = launch(tmp_path / "run", "--pg-timeout", "10", fault="desync_shape@rank1:step4")
    assert result.returncode == 1
    # gloo aborts the rank that receives more than it expects; the other explains.
    assert re.search(r"collectives diverged at call #(\d+): rank\(s\) \[0\] #\1 all_reduce over world shape \[6, 2\] "
                     r"float64 \(step 4\) vs rank\(s\) \[1\] #\1 all_reduce over world shape \[64, 2\] float64 \(step 4\)",
                     result.stderr), result.stderr
    last = summary(result)  # from rank 1's error, or when it was stopped first, from the fingerprint files
    assert last.startswith("paratrain train: rank 0 was killed by SIGABRT: ") and "collectives diverged" in last, last


def summary(result: subprocess.CompletedProcess) -> str:
    """The launcher's one-line account of the failure."""
    return next(line for line in result.stderr.splitlines() if line.startswith("paratrain train: "))


def test_a_fault_on_every_attempt_ends_after_the_allowed_restarts(tmp_path):
    """--max-restarts 2 and a rank that fails on every attempt: exactly 3 attempts, exit 1, our message."""
    out = tmp_path / "run"
    result = launch(out, "--max-restarts", "2", fault="raise@rank1:step3:attempt*")
    assert result.returncode == 1, result.stderr
    assert sorted(p.name for p in (out / "diagnostics").iterdir()) == ["attempt-0", "attempt-1", "attempt-2"]
    ours = [line for line in result.stderr.splitlines() if line.startswith("paratrain train: ")]
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
