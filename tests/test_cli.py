"""The command line: one-line errors with exit code 2, help, models, prepare, and the elastic launcher."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.config import iter_options
from paratrain.metrics import read_metrics
from paratrain.models import MODEL_CONFIGS

SMALL = ["--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "128",
         "--seq-len", "32", "--global-batch", "8", "--micro-batch", "4", "--eval-batches", "2",
         "--sample-tokens", "8", "--no-progress"]


def paratrain(*argv, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "paratrain", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--steps", "-3"], "--steps must be at least 1"),
    (["--data", "/no/such/corpus"], "/no/such/corpus"),
    (["--global-batch", "10", "--micro-batch", "4"], "--global-batch 10 is not divisible"),
    (["--nproc", "3", "--global-batch", "8", "--micro-batch", "1"], "--global-batch 8 is not divisible"),
    (["--dim", "30"], "dim=30"),
    (["--seq-len", "4096"], "exceeds the model's max_seq_len"),
    (["--stepz", "3"], "unrecognized arguments: --stepz"),
    (["--lr", "fast"], "--lr: expected float"),
    (["--nproc", "2", "--dp", "3"], "pp × dp × tp = 1 × 3 × 1 = 3 but the world has 2 process(es)"),
    (["--nproc", "4", "--tp", "8"], "world size 4 is not divisible by tp × pp = 8 × 1"),
    (["--nproc", "2", "--tp", "2", "--n-kv-heads", "1"], "kv heads 1 not divisible by tp 2"),
    (["--nproc", "2", "--tp", "2", "--ffn-dim", "687"], "ffn 687 not divisible by tp 2"),
    (["--sequence-parallel"], "--sequence-parallel needs tensor parallelism (--tp > 1)"),
    (["--nproc", "2", "--pp", "2", "--zero", "3"], "--zero 3 with --pp 2 is refused"),
    (["--nproc", "2", "--pp", "2", "--schedule", "zigzag"], "--schedule: 'zigzag' is not one of"),
    (["--nproc", "2", "--pp", "2", "--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved"], "--schedule interleaved needs --virtual-stages 2"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--global-batch", "12",
      "--micro-batch", "4"], "needs the micro-batches per step (3) divisible by --pp 2"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--n-layers", "6",
      "--global-batch", "8", "--micro-batch", "4"], "layers 6 not divisible by --pp × --virtual-stages = 2 × 2"),
    (["--nproc", "4", "--pp", "4", "--n-layers", "2"], "layers 2 not divisible by pp 4"),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "63"], "--seq-len 63 is not divisible by --tp 2"),
    (["--zero", "4"], "--zero: 4 is not one of [0, 1, 2, 3]"),
    (["--precision", "fp8"], "--precision: 'fp8' is not one of"),
    (["--keep-latest", "1"], "--keep-latest 1: keep at least 2 checkpoints"),
    (["--resume", "/no/such/step-00000004"], "/no/such/step-00000004 is not a checkpoint directory"),
    (["--resume", "none", "--load-step", "4"], "--load-step picks a checkpoint of the run in --out"),
    (["--nan-policy", "ignore"], "--nan-policy: 'ignore' is not one of"),
    (["--pg-timeout", "0"], "--pg-timeout must be positive seconds"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    code = exit_code(["train", "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing may be written before validation passes"


def exit_code(argv) -> int:
    """main()'s exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_bad_input_from_a_real_process_has_no_traceback():
    result = paratrain("train", "--model", "nope", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("paratrain train: error: unknown model 'nope'; choose one of: "
                                     + ", ".join(MODEL_CONFIGS))


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for _, _, f, flag in iter_options():
        assert flag in text, flag
        assert f.metadata["help"].split()[0] in text


def test_models_json_lists_exact_counts(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r["parameters"] for r in json.loads(capsys.readouterr().out)}
    assert rows["llama2-7b"] == 6_738_415_616
    assert rows == {name: cfg.num_params() for name, cfg in MODEL_CONFIGS.items()}


def test_prepare_then_train_on_it(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(("the quick brown fox jumps over the lazy dog %d\n" % i) * 400)
    assert main(["prepare", "--data", str(corpus), "--out", str(tmp_path / "tokens")]) == 0
    assert (tmp_path / "tokens" / "tokens.bin").is_file()
    assert main(["train", "--data", str(tmp_path / "tokens"), "--steps", "3", "--out", str(tmp_path / "run"),
                 *SMALL]) == 0
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3


@pytest.mark.slow
def test_nproc_2_runs_two_processes_through_the_elastic_launcher(tmp_path):
    out = tmp_path / "run"
    result = paratrain("train", "--nproc", "2", "--steps", "3", "--out", str(out), *SMALL, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert json.loads((out / "config.json").read_text())["run"]["nproc"] == 2


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found += [int(c) for c in children]
    return found


def _worker_pids(launcher_pid: int) -> list[int]:
    """Training processes: descendants of the launcher running paratrain's worker."""
    pids, frontier = [], [launcher_pid]
    while frontier:
        pid = frontier.pop()
        for child in _children(pid):
            frontier.append(child)
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"multiprocessing" in cmd and b"spawn_main" in cmd:
                pids.append(child)
    return pids


@pytest.mark.slow
def test_killing_one_worker_fails_the_run_with_a_clear_message(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--nproc", "2", "--steps", "100000",
                             "--eval-every", "0", "--out", str(out), *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len(read_metrics(out / "metrics.jsonl")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    ours = [line for line in stderr.splitlines() if line.startswith("paratrain train: ")]
    assert ours == ["paratrain train: rank 1 was killed by SIGKILL"], stderr[-3000:]
