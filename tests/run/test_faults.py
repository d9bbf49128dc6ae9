"""Fault injection: parsing PARATRAIN_FAULT, attempt gating, and the faults that need no process to test.

The kills are exercised for real by the checkpoint tests (a rank killed after
writing its shard).
"""

import errno
import json
import os
import signal
import threading
import time

import pytest

import torch

from paratrain.faults import (
    FAULT_ENV, GATE_ENV, RESTART_ENV, Fault, FaultSpecError, active_faults, fault_requested, faulty, maybe_fault,
    parse_faults,
)
from paratrain.run.watchdog import TIMER_FILE_ENV, StepWatchdog


def test_parse_several_specs_with_attempts():
    assert parse_faults("sigkill@rank1:step7, nan@rank0:step6:attempt2,raise@rank1:step3:attempt*") == (
        Fault("sigkill", 1, 7, 0), Fault("nan", 0, 6, 2), Fault("raise", 1, 3, None))
    assert parse_faults("") == ()


@pytest.mark.parametrize("text, message", [
    ("sigkill@rank1", r"cannot parse 'sigkill@rank1'; expected kind@rank<r>:step<k>"),
    ("sigkill@rank1:step7:attempt", "cannot parse"),
    ("sigkil@rank1:step7", r"unknown fault kind 'sigkil' in 'sigkil@rank1:step7'; known: "),
    ("nan@rank-1:step2", "cannot parse"),
])
def test_bad_specs_are_value_errors_naming_the_spec(text, message):
    with pytest.raises(FaultSpecError, match=message) as info:
        parse_faults(text)
    assert isinstance(info.value, ValueError)


def test_a_fault_fires_only_on_its_rank_step_and_attempt():
    env = {FAULT_ENV: "nan@rank1:step6,infgrad@rank0:step2:attempt1,perturb@rank0:step5:attempt*"}
    assert fault_requested("nan", 1, 6, env)
    assert not fault_requested("nan", 0, 6, env) and not fault_requested("nan", 1, 5, env)
    assert not fault_requested("infgrad", 0, 2, env)
    assert fault_requested("infgrad", 0, 2, {**env, RESTART_ENV: "1"})
    assert not fault_requested("nan", 1, 6, {**env, RESTART_ENV: "1"})
    assert all(fault_requested("perturb", 0, 5, {**env, RESTART_ENV: str(a)}) for a in range(3))
    assert [f.kind for f in active_faults({**env, RESTART_ENV: "1"})] == ["infgrad", "perturb"]
    assert maybe_fault("nan", 1, 6, env) is True  # flags are returned for the caller to act on
    assert maybe_fault("nan", 1, 7, env) is False
    with pytest.raises(FaultSpecError, match=f"{RESTART_ENV}='x' is not a non-negative integer"):
        fault_requested("nan", 1, 6, {**env, RESTART_ENV: "x"})
    with pytest.raises(ValueError, match="unknown fault kind 'nope'"):
        fault_requested("nope", 0, 0, env)


def test_actions_raise_what_they_simulate():
    env = {FAULT_ENV: "raise@rank1:step3,oom@rank0:step4,ckpt_enospc@rank2:step8"}
    with pytest.raises(RuntimeError, match="injected fault: raise at rank 1, step 3"):
        maybe_fault("raise", 1, 3, env)
    with pytest.raises(MemoryError):
        maybe_fault("oom", 0, 4, env)
    with pytest.raises(OSError) as info:
        maybe_fault("ckpt_enospc", 2, 8, env)
    assert info.value.errno == errno.ENOSPC


def test_a_held_checkpoint_write_goes_on_once_its_gate_opens(tmp_path):
    """With PARATRAIN_FAULT_GATE, ckpt_slow_write holds the write until the test says, not for a fixed time."""
    gate = tmp_path / "gate"
    env = {FAULT_ENV: "ckpt_slow_write@rank0:step2", GATE_ENV: str(gate)}
    written = threading.Event()
    writer = threading.Thread(target=lambda: (maybe_fault("ckpt_slow_write", 0, 2, env), written.set()))
    writer.start()
    assert not written.wait(3), "the write went on with its gate shut"  # longer than the 2 s of no gate
    gate.touch()
    assert written.wait(60)
    writer.join()


def test_the_environment_is_read_when_no_mapping_is_given(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "nan@rank0:step1")
    monkeypatch.delenv(RESTART_ENV, raising=False)
    assert fault_requested("nan", 0, 1)
    monkeypatch.setenv(RESTART_ENV, "1")
    assert not fault_requested("nan", 0, 1)


class _Model:
    """Just what a step calls on a model, for the fault wrapper to act on."""

    mesh = "the model's mesh"

    def __init__(self):
        self.master = torch.nn.Parameter(torch.ones(3))
        self.master.grad = torch.ones(3)

    def loss_fn(self, output, labels):
        return (output - labels).sum()

    def train_step(self, micro_batches, normalizer, loss_fn=None):
        return (loss_fn or self.loss_fn)(torch.ones(2), torch.zeros(2)) / normalizer

    def finish_gradients(self):
        pass

    def masters(self):
        return [self.master]

    def grads(self):
        return [self.master.grad]


def _step(model):
    loss = model.train_step([], 2.0)
    model.finish_gradients()
    return loss, model.master.grad.tolist(), model.mesh


def test_a_step_is_wrapped_only_when_one_of_its_faults_is_due(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "nan@rank1:step3,perturb@rank0:step2")
    monkeypatch.delenv(RESTART_ENV, raising=False)
    assert faulty(_step, None, 0, 3) is _step  # the nan is rank 1's
    assert faulty(_step, None, 0, 2) is _step  # perturb is the loop's fault, not the step's
    assert faulty(_step, None, 1, 3) is not _step
    assert _step(_Model()) == (1.0, [1.0, 1.0, 1.0], "the model's mesh")


@pytest.mark.parametrize("spec, loss, grad", [
    ("nan@rank1:step3", float("nan"), [1.0, 1.0, 1.0]),
    ("infgrad@rank1:step3", 1.0, [float("inf"), 1.0, 1.0]),
    ("negate_grads@rank1:step*", 1.0, [-1.0, -1.0, -1.0]),
])
def test_the_wrapped_step_performs_the_fault_on_its_model(monkeypatch, spec, loss, grad):
    monkeypatch.setenv(FAULT_ENV, spec)
    monkeypatch.delenv(RESTART_ENV, raising=False)
    got_loss, got_grad, mesh = faulty(_step, None, 1, 3)(_Model())
    assert str(got_loss.item()) == str(loss)  # nan too
    assert got_grad == grad and mesh == "the model's mesh"


def test_the_step_watchdog_arms_torchruns_file_timer_when_the_agent_runs_one(tmp_path, monkeypatch):
    """Under torchrun with TORCHELASTIC_ENABLE_FILE_TIMER=1 the agent reads countdowns from a pipe."""
    fifo = tmp_path / "watchdog_timer"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the agent's end, as its FileTimerServer opens it
    monkeypatch.setenv(TIMER_FILE_ENV, str(fifo))
    try:
        watchdog = StepWatchdog(30.0, rank=1)
        before = time.time()
        watchdog.arm(3)
        watchdog.arm(4)
        watchdog.close()
        requests = [json.loads(line) for line in os.read(reader, 1 << 16).decode().splitlines()]
    finally:
        os.close(reader)
    assert [(r["scope_id"], r["pid"], r["signal"]) for r in requests] == [
        ("rank 1 at step 3", os.getpid(), signal.SIGKILL), ("rank 1 at step 3", os.getpid(), 0),
        ("rank 1 at step 4", os.getpid(), signal.SIGKILL), ("rank 1 at step 4", os.getpid(), 0)]
    armed, released = requests[2]["expiration_time"], requests[3]["expiration_time"]
    assert before + 30 <= armed <= time.time() + 30 and released < 0  # a release is a negative expiration
