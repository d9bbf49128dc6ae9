"""Fault injection for the reliability tests: one environment variable names the faults, hooks perform them.

    PARATRAIN_FAULT="sigkill@rank1:step7"                      # attempt 0 only (the default)
    PARATRAIN_FAULT="raise@rank1:step3:attempt*"               # every attempt
    PARATRAIN_FAULT="ckpt_kill_before_commit@rank0:step8:attempt1,nan@rank1:step6"
    PARATRAIN_FAULT="negate_grads@rank1:step*"                 # every step

This module is the only place that reads the variable and knows the faults. The training loop
(`paratrain.train`) calls `maybe_fault` / `fault_requested` at its own points, in the open, and
wraps a step that has faults due in `faulty`: the step itself (`train_step`) holds no fault
hook. The checkpoint storage core knows nothing of faults either and reports the events of a
save to a callback, which `checkpoint_events` builds from the faults of the save's points.

A fault fires when the code reaches a hook ``maybe_fault(kind, rank, step)``
with the same kind, rank and step, and ``TORCHELASTIC_RESTART_COUNT`` (0 when
unset; torchrun increments it at every restart) equals the fault's attempt,
so a restarted job does not hit the same fault again (unless ``attempt*``).

Two sorts of kind:

* actions, performed inside `maybe_fault`: ``sigkill`` (SIGKILL this
  process), ``raise`` (RuntimeError), ``hang`` and ``hang_data`` (sleep
  forever), ``oom`` (MemoryError), and the checkpoint writer's hooks
  ``ckpt_kill_after_shard`` (after this rank's shard file is written, before
  the ranks meet), ``ckpt_kill_before_commit`` (rank 0, after index.json,
  before the manifest that commits), ``kill_in_purge`` (rank 0, while
  deleting old checkpoints), ``ckpt_enospc`` (OSError ENOSPC in the middle
  of writing a shard file) and ``ckpt_slow_write`` (each shard file takes
  `SLOW_WRITE_SECONDS` longer, to keep an async save in flight; with
  ``PARATRAIN_FAULT_GATE=PATH``, it is held until that file exists instead,
  so a test opens the gate once what must happen during the write has
  happened, whatever the machine's load); ``snap_kill_mid_write`` (SIGKILL
  while this rank's memory snapshot of the step is half written, its shard
  file's header there and its data not, `paratrain.checkpoint.snapshot`);
* flags, which `maybe_fault` only reports (it returns True) and the caller
  acts on: ``nan`` (the loss becomes NaN), ``infgrad`` (one gradient element
  becomes inf), ``desync_shape`` (the step's agreement all-reduce gets a
  different shape), ``perturb`` (a replicated parameter moves by one ulp),
  ``negate_grads`` (this rank's gradients change sign before the optimizer
  step: an engine that reduces wrongly, which `paratrain verify` must catch),
  ``slow`` (this rank's forward and backward take `SLOW_STEP_SECONDS` longer:
  a straggler, which the step's agreement names).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from paratrain.errors import ParatrainError
from paratrain.mesh import WORLD

FAULT_ENV = "PARATRAIN_FAULT"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
GATE_ENV = "PARATRAIN_FAULT_GATE"
SLOW_WRITE_SECONDS = 2.0
SLOW_STEP_SECONDS = 0.05
# A gate nobody opens: the held write goes on after this long, so a test that forgot it ends rather than hangs.
GATE_LIMIT_S = 300.0

ACTIONS = frozenset({
    "sigkill", "raise", "hang", "hang_data", "oom",
    "ckpt_kill_after_shard", "ckpt_kill_before_commit", "kill_in_purge", "ckpt_enospc", "ckpt_slow_write",
    "snap_kill_mid_write",
})
FLAGS = frozenset({"nan", "infgrad", "desync_shape", "perturb", "negate_grads", "slow"})
KINDS = ACTIONS | FLAGS
_KILLS = frozenset({"sigkill", "ckpt_kill_after_shard", "ckpt_kill_before_commit", "kill_in_purge",
                    "snap_kill_mid_write"})
_SPEC = re.compile(r"(?P<kind>[a-z_0-9]+)@rank(?P<rank>\d+):step(?P<step>\d+|\*)(?::attempt(?P<attempt>\d+|\*))?")
# The points of a checkpoint save (the storage core's events) and the faults injected at each.
CHECKPOINT_EVENTS = {
    "shard_written": ("ckpt_kill_after_shard",),  # this rank's file is complete, before the ranks meet
    "writing_data": ("ckpt_enospc", "ckpt_slow_write"),  # a shard file's header is written, its data not yet
    "committing": ("ckpt_kill_before_commit",),  # rank 0: index written, manifest (the commit marker) not yet
    "purging": ("kill_in_purge",),  # rank 0: an old checkpoint renamed for deletion, not yet deleted
}
# The same points of a memory snapshot's save (this rank's alone).
SNAPSHOT_EVENTS = {"shard_written": (), "writing_data": ("snap_kill_mid_write",), "committing": (), "purging": ()}


class FaultSpecError(ParatrainError, ValueError):
    """PARATRAIN_FAULT or TORCHELASTIC_RESTART_COUNT cannot be parsed."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: `kind` on `rank` at `step` (None: every step), on restart `attempt` (None: every attempt)."""

    kind: str
    rank: int
    step: int | None
    attempt: int | None = 0


def parse_faults(text: str) -> tuple[Fault, ...]:
    """The faults of a PARATRAIN_FAULT value (comma-separated specs); FaultSpecError naming a bad one."""
    return _parse(text.strip())


@functools.lru_cache(maxsize=16)
def _parse(text: str) -> tuple[Fault, ...]:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _SPEC.fullmatch(part)
        if match is None:
            raise FaultSpecError(f"{FAULT_ENV}: cannot parse {part!r}; expected "
                                 f"kind@rank<r>:step<k>|step*[:attempt<a>|:attempt*], e.g. sigkill@rank1:step7")
        if match["kind"] not in KINDS:
            raise FaultSpecError(f"{FAULT_ENV}: unknown fault kind {match['kind']!r} in {part!r}; "
                                 f"known: {', '.join(sorted(KINDS))}")
        attempt, step = match["attempt"], match["step"]
        faults.append(Fault(match["kind"], int(match["rank"]), None if step == "*" else int(step),
                            None if attempt == "*" else int(attempt or 0)))
    return tuple(faults)


def current_attempt(environ: Mapping[str, str] | None = None) -> int:
    """The restart attempt torchrun reports (0 for the first run or without torchrun)."""
    value = (os.environ if environ is None else environ).get(RESTART_ENV, "0")
    if not value.strip().isdigit():
        raise FaultSpecError(f"{RESTART_ENV}={value!r} is not a non-negative integer")
    return int(value)


def active_faults(environ: Mapping[str, str] | None = None) -> tuple[Fault, ...]:
    """The faults that apply to this attempt."""
    env = os.environ if environ is None else environ
    faults = parse_faults(env.get(FAULT_ENV, ""))
    if not faults:
        return ()
    attempt = current_attempt(env)
    return tuple(f for f in faults if f.attempt is None or f.attempt == attempt)


def fault_requested(kind: str, rank: int, step: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a fault of `kind` is injected at this rank and step in this attempt."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    return any(f.kind == kind and f.rank == rank and f.step in (None, step) for f in active_faults(environ))


def maybe_fault(kind: str, rank: int, step: int, environ: Mapping[str, str] | None = None) -> bool:
    """The hook: perform the fault if it is injected here (actions), or return whether it is (flags)."""
    if not fault_requested(kind, rank, step, environ):
        return False
    if kind in _KILLS:
        os.kill(os.getpid(), signal.SIGKILL)
        while True:  # SIGKILL to oneself is not always delivered before kill() returns
            time.sleep(1)
    if kind == "raise":
        raise RuntimeError(f"injected fault: raise at rank {rank}, step {step}")
    if kind == "oom":
        raise MemoryError(f"injected fault: out of memory at rank {rank}, step {step}")
    if kind == "ckpt_enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at rank {rank}, step {step})")
    if kind == "ckpt_slow_write":
        _hold_write((os.environ if environ is None else environ).get(GATE_ENV))
    if kind in ("hang", "hang_data"):
        while True:
            time.sleep(3600)
    return True


# The faults that happen inside one training step, the ones `faulty` injects.
STEP_FAULTS = ("slow", "nan", "sigkill", "raise", "oom", "hang", "infgrad", "negate_grads", "desync_shape")


def faulty(step_fn: Callable, comm, rank: int, step: int) -> Callable:
    """`step_fn(model, ...)` (`paratrain.train.train_step`) with this rank's faults of `step` injected, from outside.

    `step_fn` itself when none is due (every step of a run without PARATRAIN_FAULT). Else the
    step drives `_FaultyModel(model)`, which performs them where they belong: `nan` in the loss,
    the actions (`sigkill`, `raise`, `oom`, `hang`) and the gradient faults (`infgrad`,
    `negate_grads`) once the gradients are final, then `desync_shape` (a larger collective than
    the peers' agreement, on `comm`, the run's communication layer that the model uses): all
    before the step's agreement, where the peers wait.
    """
    if not any(fault_requested(kind, rank, step) for kind in STEP_FAULTS):
        return step_fn

    def step_with_faults(model, *args, **kwargs):
        return step_fn(_FaultyModel(model, comm, rank, step), *args, **kwargs)

    return step_with_faults


class _FaultyModel:
    """A parallel model whose step performs the faults injected at (rank, step); everything else is the model's."""

    def __init__(self, model, comm, rank: int, step: int):
        self._model, self._comm, self._rank, self._step = model, comm, rank, step

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def _due(self, kind: str) -> bool:
        return fault_requested(kind, self._rank, self._step)

    def train_step(self, micro_batches, normalizer, loss_fn=None):
        """The `slow` fault (this rank computes `SLOW_STEP_SECONDS` longer) and the `nan` fault (this rank's loss, and
        so its gradients, become NaN)."""
        if self._due("slow"):
            time.sleep(SLOW_STEP_SECONDS)
        loss_fn = loss_fn or self._model.loss_fn
        if self._due("nan"):
            loss_fn = functools.partial(_nan_loss, loss_fn)
        return self._model.train_step(micro_batches, normalizer, loss_fn)

    def finish_gradients(self) -> None:
        """The model's, then the mid-step faults: the peers wait in the agreement that follows."""
        self._model.finish_gradients()
        for kind in ("sigkill", "raise", "oom", "hang"):
            maybe_fault(kind, self._rank, self._step)
        self._gradient_faults()
        if self._due("desync_shape"):
            mesh = self._model.mesh
            self._comm.all_reduce(torch.zeros(64, mesh.size(WORLD), dtype=torch.float64, device=mesh.device), WORLD)

    def _gradient_faults(self) -> None:
        """The `infgrad` and `negate_grads` faults, on this rank's reduced gradients (`grads`: the device's, which the
        agreement reads; with the optimizer offloaded, its host masters get theirs only in the optimizer step)."""
        grads = self._model.grads()
        if grads and self._due("infgrad"):
            grads[0].view(-1)[:1] = float("inf")  # this rank's copy only
        if self._due("negate_grads"):
            # Adam is invariant to a constant gradient scale, so a sign flip is the simplest
            # perturbation it cannot absorb: a wrongly reducing engine, which verify must catch.
            torch._foreach_neg_(grads)


def _nan_loss(loss_fn, output, labels):
    return loss_fn(output, labels) * float("nan")


def _hold_write(gate: str | None) -> None:
    """ckpt_slow_write: SLOW_WRITE_SECONDS, or until the file `gate` exists (at most GATE_LIMIT_S)."""
    if not gate:
        time.sleep(SLOW_WRITE_SECONDS)
        return
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


def checkpoint_events(rank: int, points: Mapping[str, tuple[str, ...]] = CHECKPOINT_EVENTS):
    """The callback a checkpoint save reports its events to: `event(name, step)` performs the faults
    injected at that point of the save on this rank (see CHECKPOINT_EVENTS; a snapshot's: SNAPSHOT_EVENTS),
    read when it happens."""

    def event(name: str, step: int) -> None:
        for kind in points[name]:
            maybe_fault(kind, rank, step)

    return event
