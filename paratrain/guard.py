"""Guards around each training step: non-finite steps, preemption, diverged replicas, failed collectives, faults.

    guard = StepGuard(cfg.reliability, model, optimizer, rank, diagnostics_dir)
    with guard.running():                              # SIGTERM handled; hooks removed at the end
        for step in ...:
            guard.begin_step(step)
            ... forward, backward, optimizer.step() ...   # the guard's pre-step hook runs in there
            guard.end_step(step)                          # may raise TrainingAborted
            if guard.stopping: save a checkpoint and leave

Every decision that changes what ranks do next is agreed first. The
optimizer pre-step hook (after the engine has finished the gradients, before
any parameter moves) all-reduces one small vector over the model axes: per
rank, whether its loss or gradients are non-finite and whether it received
SIGTERM. So every rank skips the same steps and stops after the same step,
however the signal or the NaN reached it.

* Non-finite: the step is skipped on every rank (no master grad: the
  optimizer moves nothing) and counted; ``--nan-policy abort``, or
  ``--max-bad-steps`` such steps in a row, stop the run with "non-finite
  loss/grad at step N (rank r)", naming the rank whose own loss was
  non-finite (else whose gradients were).
* SIGTERM (preemption; the launcher forwards it): the current step finishes,
  the trainer saves a checkpoint and returns. A watchdog ends the process
  if that has not happened within SIGTERM_GRACE_S, or at once when a peer
  has already failed (then the step can never finish).
* Replicas: every ``--check-every`` steps a bit-exact hash of the replicated
  parameters is compared across their replicas; a difference stops the run
  with "replicas diverged at step N".
* A collective that fails or times out becomes a `CollectiveFailure` whose
  one line says which rank was where (`paratrain.diagnose`).
* The fault hooks of `paratrain.faults` (PARATRAIN_FAULT) sit here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.training import engine_model
from paratrain.config import ReliabilitySection
from paratrain.diagnose import CollectiveFailure, FingerprintRing, any_failed, describe, mark_failed
from paratrain.faults import fault_requested, maybe_fault

# torchrun waits 30 s (--shutdown-timeout) between SIGTERM and SIGKILL: finish the step and save before.
SIGTERM_GRACE_S = 25.0
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TrainingAborted(RuntimeError):
    """The run stopped itself (non-finite steps, diverged replicas); the one-line message says why."""


class StepGuard:
    """The step guards of one rank; see the module docstring. `rank` is the global rank."""

    def __init__(self, cfg: ReliabilitySection, model, optimizer, rank: int, diagnostics: Path):
        self.cfg, self.rank, self.diagnostics = cfg, rank, Path(diagnostics)
        self.inner = engine_model(model)
        self.comm, self.mesh = self.inner.comm, self.inner.comm.mesh
        self.world = self.mesh.shape.world_size
        self.step = 0
        self.stop_requested = False  # this rank got SIGTERM
        self.stopping = False  # some rank got SIGTERM: every rank stops after this step
        self.bad_total = self.bad_in_row = 0
        self._skipped: list[int] = []  # ranks behind a skipped step (empty: the step was applied)
        self._output_nonfinite: torch.Tensor | None = None  # on the device: no sync per micro-batch
        self._closed = threading.Event()
        self.ring = FingerprintRing(self.diagnostics, rank)
        self.comm.listeners.append(self.ring)
        self._handles = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                         self.inner.module.register_forward_hook(self._after_forward)]
        self._previous_sigterm = None

    # -- the loop's calls ----------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.ring.set_step(step)
        self._output_nonfinite = None
        self._skipped = []
        maybe_fault("hang_data", self.rank, step)  # a rank stuck before its step's first collective

    def end_step(self, step: int) -> None:
        """Stop if a skipped step (counted by the hook) is one too many; inject `perturb`; check the replicas."""
        if self._skipped:
            where = f"non-finite loss/grad at step {step} ({_ranks(self._skipped)})"
            if self.cfg.nan_policy == "abort":
                raise TrainingAborted(f"{where}; the step was not applied (--nan-policy abort)")
            if self.bad_in_row >= self.cfg.max_bad_steps:
                raise TrainingAborted(f"{where}: {self.bad_in_row} steps in a row skipped "
                                      f"(--max-bad-steps {self.cfg.max_bad_steps})")
        if fault_requested("perturb", self.rank, step):
            self._perturb()
        if self.cfg.check_every and step % self.cfg.check_every == 0:
            self._check_replicas(step)

    @property
    def skipped(self) -> bool:
        """Whether the last step was skipped (non-finite on some rank)."""
        return bool(self._skipped)

    def state_dict(self) -> dict:
        return {"bad_total": self.bad_total, "bad_in_row": self.bad_in_row}

    def load_state_dict(self, state: dict) -> None:
        self.bad_total, self.bad_in_row = int(state["bad_total"]), int(state["bad_in_row"])

    @contextlib.contextmanager
    def running(self):
        """The training loop's context: SIGTERM handled, `diagnosing`, then `close` however the loop ends."""
        if threading.current_thread() is threading.main_thread():  # Python runs handlers there only
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            with self.diagnosing():
                yield
        finally:
            self.close()

    @contextlib.contextmanager
    def diagnosing(self):
        """Mark this rank failed on any error; a failed collective becomes a CollectiveFailure saying who is where."""
        try:
            yield
        except (TrainingAborted, CheckpointError) as exc:  # these say themselves what went wrong
            mark_failed(self.diagnostics, self.rank)
            if self.world > 1:  # a launcher that restarts the job would show no trace of it
                print(f"paratrain: rank {self.rank}: {exc}", file=sys.stderr, flush=True)
            raise
        except KeyboardInterrupt:
            mark_failed(self.diagnostics, self.rank)
            raise
        except Exception as exc:
            mark_failed(self.diagnostics, self.rank)
            if self.world == 1 or not _from_a_collective(exc):
                raise
            report = describe(self.diagnostics, self.rank, self.mesh.shape)
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"paratrain: {report}", file=sys.stderr, flush=True)
            raise CollectiveFailure(f"{report} (error: {cause[:300]})") from exc

    def close(self) -> None:
        """Remove the hooks and the SIGTERM handler; stop the watchdog."""
        self._closed.set()
        for handle in self._handles:
            handle.remove()
        if self.ring in self.comm.listeners:
            self.comm.listeners.remove(self.ring)
        self.ring.close()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # -- hooks ---------------------------------------------------------------------------
    def _after_forward(self, module, args, output):
        if not module.training or not torch.is_tensor(output):
            return None
        if fault_requested("nan", self.rank, self.step):
            output = output * float("nan")
        # One sum, not an elementwise test: a logits-sized boolean tensor would cost memory.
        bad = ~torch.isfinite(output.detach().sum())
        self._output_nonfinite = bad if self._output_nonfinite is None else self._output_nonfinite | bad
        return output

    @torch.no_grad()
    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        for kind in ("sigkill", "raise", "oom", "hang"):
            maybe_fault(kind, self.rank, self.step)  # mid-step: the peers wait in the all-reduce below
        grads = [m.grad for m in self.inner.engine.masters() if m.grad is not None]
        if grads and fault_requested("infgrad", self.rank, self.step):
            grads[0].view(-1)[:1] = float("inf")  # this rank's copy only
        flags = self._agree(_local_flag(self._output_nonfinite, grads, self._device()))
        self.stopping = self.stopping or bool(flags[1].any())
        origin = flags[0] == 2
        self._skipped = (origin if origin.any() else flags[0] > 0).nonzero().flatten().tolist()
        self.bad_in_row = self.bad_in_row + 1 if self._skipped else 0
        self.bad_total += bool(self._skipped)
        if self._skipped:
            for master in self.inner.engine.masters():
                master.grad = None  # every rank skips: AdamW leaves a parameter without grad alone

    def _agree(self, nonfinite: torch.Tensor) -> torch.Tensor:
        """[2, world] on the CPU: every rank's non-finite flag and SIGTERM flag, summed over the model axes."""
        width = self.world + int(fault_requested("desync_shape", self.rank, self.step))
        flags = torch.zeros(2, width, device=self._device())
        flags[0, self.rank], flags[1, self.rank] = nonfinite, float(self.stop_requested)
        return self.comm.all_reduce_mesh(flags).cpu()  # each rank's entry is summed in exactly once

    def _device(self) -> torch.device:
        return self.inner.engine.masters()[0].device

    # -- replicas --------------------------------------------------------------------------
    def _replicated(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameters equal across dp replicas, parameters equal across tp ranks) as held now."""
        named = list(self.inner.module.named_parameters())
        sharded = set(self.inner.tp_info.sharded) if self.inner.tp_info is not None else set()
        over_tp = [p for n, p in named if n not in sharded]
        over_dp = [p for _, p in named] if not hasattr(self.inner.engine, "full_state_dict") else []  # not ZeRO-3
        return over_dp, over_tp

    def _perturb(self) -> None:
        """The `perturb` fault: one replicated parameter changed by one unit in the last place, on this rank only."""
        over_dp, over_tp = self._replicated()
        candidates = over_dp if self.mesh.size("dp") > 1 else over_tp if self.mesh.size("tp") > 1 else []
        if not candidates:
            print(f"paratrain: rank {self.rank}: perturb fault: no replicated parameter here", file=sys.stderr)
            return
        bits = candidates[0].data.view(-1)[:1]
        bits.view(_INT_OF_SIZE[bits.element_size()]).add_(1)

    @torch.no_grad()
    def _check_replicas(self, step: int) -> None:
        over_dp, over_tp = self._replicated()
        differs = 0.0
        for axis, tensors in (("dp", over_dp), ("tp", over_tp)):
            n = self.mesh.size(axis)
            if n == 1 or not tensors:
                continue
            mine = _bit_hash(tensors).reshape(1)
            every = torch.empty(n, dtype=torch.int64, device=mine.device)
            self.comm.all_gather(every, mine, axis)
            differs = max(differs, float(bool((mine != every[0]).item())))
        flags = torch.zeros(self.world, device=self._device())
        flags[self.rank] = differs
        self.comm.all_reduce_mesh(flags)
        if flags.any():
            odd = flags.nonzero().flatten().tolist()
            raise TrainingAborted(f"replicas diverged at step {step}: {_ranks(odd)} hold(s) parameters that differ "
                                  f"bit-wise from the first replica of their group")

    # -- SIGTERM -----------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame) -> None:
        if self.stop_requested:  # a second SIGTERM: stop now
            os._exit(128 + signum)
        self.stop_requested = True
        print(f"paratrain: rank {self.rank} got SIGTERM at step {self.step}: finishing the step, then saving a "
              f"checkpoint", file=sys.stderr, flush=True)
        threading.Thread(target=self._watchdog, name="paratrain-sigterm-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        deadline = time.monotonic() + SIGTERM_GRACE_S
        while time.monotonic() < deadline:
            if self._closed.wait(0.2):
                return
            if any_failed(self.diagnostics):  # a peer failed: this step can never finish
                os._exit(128 + signal.SIGTERM)
        print(f"paratrain: rank {self.rank}: no checkpoint within {SIGTERM_GRACE_S:.0f} s of SIGTERM; exiting",
              file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)


def _local_flag(output_nonfinite: torch.Tensor | None, grads: list[torch.Tensor], device) -> torch.Tensor:
    """2: this rank's own loss was non-finite; 1: only its (already reduced) gradients are; 0: finite.

    Computed on the device, without a host sync per tensor.
    """
    bad_grads = torch.zeros((), dtype=torch.bool, device=device)
    for g in grads:
        bad_grads |= ~torch.isfinite(g).all()
    own = output_nonfinite if output_nonfinite is not None else torch.zeros((), dtype=torch.bool, device=device)
    return torch.where(own, 2.0, bad_grads.float())


def _bit_hash(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 64-bit hash of the exact bits of `tensors`: any single changed element changes it."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for i, t in enumerate(tensors):
        bits = t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()]).to(torch.int64)
        total = total * 1_000_003 + bits.sum() + (i + 1)  # wraps modulo 2^64
    return total


def _from_a_collective(exc: BaseException) -> bool:
    """Whether `exc` came out of torch.distributed (a backend error, a timeout, a peer gone)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(word in text for word in (
        "gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out", "peer"))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
