"""A first fine-tune as a new user runs it, with no flag a newcomer would not know to pass.

A Llama 3.2-style directory (transformers, from a config: GQA, tied embeddings, llama3 rope scaling; no
download) -> `prepare` a JSON Lines corpus -> `train --init-from DIR --nproc 2 --zero 3` with no checkpoint
flag -> SIGTERM to the launcher mid-run -> the model directory moved away -> `--resume RUN` alone continues
bit-exact (the checkpoint carries the model's config: `paratrain.run.carried`) -> a SIGKILL (a rank killed mid-step)
-> `--resume RUN --reset data --data OTHER` continues from the newest checkpoint the default policy wrote, with the
learning rate of the unbroken schedule -> `export` loads in transformers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from paratrain.cli import main
from paratrain.faults import FAULT_ENV
from paratrain.metrics import read_metrics

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multirank

STEPS = 20
SHAPE = ["--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0", "--eval-every", "0",
         "--no-progress"]
TIMEOUT = 300


def _paratrain(*argv, fault: str = "", **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env.update(PYTHONUNBUFFERED="1", **({FAULT_ENV: fault} if fault else {}))
    return subprocess.Popen([sys.executable, "-m", "paratrain", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


def _run(*argv, fault: str = "") -> tuple[int, str, str]:
    process = _paratrain(*argv, fault=fault)
    out, err = process.communicate(timeout=TIMEOUT)
    return process.returncode, out, err


def _corpus(path, words: str) -> None:
    path.write_text("".join(json.dumps({"text": f"{words} {i}. " * 20}) + "\n" for i in range(200)))


def _steps(run) -> int:
    try:
        return len(read_metrics(run / "metrics.jsonl"))
    except (OSError, ValueError):
        return 0


def test_a_first_fine_tune_checkpoints_resumes_and_exports_without_being_told(tmp_path, capfd):
    hf = tmp_path / "llama"
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    for name, words in (("a", "the quick brown fox jumps over the lazy dog"), ("b", "pack my box with five jugs")):
        _corpus(tmp_path / f"{name}.jsonl", words)
        assert main(["prepare", "--data", str(tmp_path / f"{name}.jsonl"), "--out", str(tmp_path / name)]) == 0
    train = ["train", "--init-from", str(hf), "--data", str(tmp_path / "a"), "--nproc", "2", "--zero", "3",
             "--steps", str(STEPS), *SHAPE]

    # The uninterrupted reference launches its ranks from this process (the same launcher, no interpreter to start).
    reference = tmp_path / "reference"
    assert main([*train, "--out", str(reference)]) == 0
    expected = read_metrics(reference / "metrics.jsonl")

    # Preempted mid-run: the launcher's SIGTERM reaches the ranks, which finish the step and save it.
    run = tmp_path / "run"
    process = _paratrain(*train, "--out", str(run))
    deadline = time.monotonic() + TIMEOUT
    while _steps(run) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=TIMEOUT)
    first = out.splitlines()[0]
    assert "LlamaForCausalLM" in first and "checkpoints every 30 min and at the end" in first, first
    assert process.returncode == 128 + signal.SIGTERM, err
    preempted = _steps(run)
    assert 2 <= preempted < STEPS and f"newest checkpoint step-{preempted:08d}" in err, err

    # `--resume RUN` alone: its own model, data, recipe, layout and processes, with the model directory moved
    # away (the checkpoint carries what the run read of it); killed (SIGKILL) three steps on.
    hf = hf.rename(tmp_path / "moved")
    killed_at = preempted + 3
    code, out, err = _run("train", "--resume", str(run), fault=f"sigkill@rank0:step{killed_at}")
    assert code == 1 and "killed by SIGKILL" in err, err
    assert "LlamaForCausalLM" in next(line for line in out.splitlines() if "parameters)" in line), out
    assert f"resumed from {run / 'checkpoints' / f'step-{preempted:08d}'} at step {preempted}" in out, out
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, killed_at))
    assert [float.hex(r["loss"]) for r in records] == [float.hex(r["loss"]) for r in expected[:killed_at - 1]]

    # A new stage on other data from the newest checkpoint the default policy wrote (the SIGTERM's): the schedule
    # goes on as if unbroken. Launched from this process: the line read is the launcher's.
    capfd.readouterr()
    code = main(["train", "--resume", str(run), "--reset", "data", "--data", str(tmp_path / "b")])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert f"newest complete checkpoint is step-{preempted:08d}" in out, out
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in records] == [r["lr"] for r in expected]
    assert max(r["lr"] for r in records) <= 2e-5  # the fine-tuning recipe's peak

    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokens = torch.randint(0, 259, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(theirs(tokens).logits).all()
    weights = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    original = transformers.LlamaForCausalLM.from_pretrained(hf).state_dict()
    assert any(not torch.equal(weights[k], original[k]) for k in weights), "the export holds the trained weights"
