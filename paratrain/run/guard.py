"""Guards around each training step: non-finite steps, preemption, diverged replicas, failed collectives.

    guard = StepGuard(cfg.reliability, model, comm, rank, diagnostics_dir)   # comm: the run's (`Run.comm`)
    with guard.running():                              # SIGTERM handled; the fingerprint ring closed at the end
        for step in ...:
            guard.begin_step(step)
            ... forward, backward ...
            verdict = model.agree(result, stop=guard.stop_requested)   # every rank's flags, one all-reduce
            guard.judge(verdict)                                        # counts a skipped step; stopping?
            ... clip, optimizer step, log ...
            guard.end_step(step)                          # may raise TrainingAborted; checks the replicas
            if guard.stopping: save a checkpoint and leave

Every decision that changes what ranks do next is agreed first: the model's `agree` carries
each rank's non-finite flags and its SIGTERM flag in one all-reduce, so every rank skips the
same steps and stops after the same step, however the signal or the NaN reached it. The guard
holds no hook: the trainer hands it each verdict.

* Non-finite: the step is skipped on every rank (the model drops every gradient: the optimizer
  moves nothing) and counted; ``--nan-policy abort``, or ``--max-bad-steps`` such steps in a
  row, stop the run with "non-finite loss/grad at step N (rank r)", naming the rank whose own
  loss was non-finite (else whose gradients were).
* SIGTERM (preemption; the launcher forwards it): the current step finishes, the trainer saves
  a checkpoint and returns. A watchdog ends the process if that has not happened within
  SIGTERM_GRACE_S, or at once when a peer has already failed (then the step can never finish).
* Replicas: every ``--check-every`` steps a bit-exact hash of the replicated parameters is
  compared across their replicas; a difference stops the run with "replicas diverged at step N".
* A collective that fails or times out becomes a `CollectiveFailure` whose one line says which
  rank was where (`paratrain.run.diagnose`).
* Out of memory (MemoryError, torch.OutOfMemoryError) becomes an `OutOfMemory` saying where and
  what to change. The peers learn it without waiting for the process-group timeout: this rank's
  process exits (gloo's connections close, and the peers' collectives fail at once), the
  launcher stops the other workers, and a peer in its SIGTERM grace period sees this rank's
  failure mark and exits at once.
* Step timeout (``--step-timeout``): each step arms a countdown that a timer server outside the
  process enforces (`paratrain.run.watchdog`), for a rank stuck outside collectives.
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
from paratrain.comm import Comm
from paratrain.config import ReliabilitySection
from paratrain.run.diagnose import CollectiveFailure, FingerprintRing, any_failed, describe, mark_failed
from paratrain.run.watchdog import StepWatchdog
from paratrain.errors import RunFailure
from paratrain.parallel.data.replicas import INT_OF_SIZE, bit_hash

# torchrun waits 30 s (--shutdown-timeout) between SIGTERM and SIGKILL: finish the step and save before.
SIGTERM_GRACE_S = 25.0
# How long a rank whose collective failed waits before it exits: past the launcher's monitor interval (0.2 s),
# so that a peer that died first (killed, out of memory) is the one the launcher names.
PEER_EXIT_GRACE_S = 1.0


class TrainingAborted(RunFailure):
    """The run stopped itself (non-finite steps, diverged replicas); the one-line message says why."""


class OutOfMemory(RunFailure):
    """A rank ran out of memory during a step; the message says where and what to change."""


OOM_ERRORS = (MemoryError, torch.OutOfMemoryError)
OOM_HINT = ("lower --micro-batch or --seq-len, add --activation-checkpointing 1, shard more (--zero 3, --tp, --pp), "
            "or use bf16; `paratrain plan` estimates each layout's memory")


class StepGuard:
    """The step guards of one rank; see the module docstring. `rank` is the global rank; `comm` the run's
    communication layer, the one the model communicates through (its collectives are what the fingerprint
    ring records, and the replica check runs its own on it)."""

    def __init__(self, cfg: ReliabilitySection, model, comm: Comm, rank: int, diagnostics: Path):
        self.cfg, self.rank, self.diagnostics = cfg, rank, Path(diagnostics)
        self.model = model
        self.comm, self.mesh = comm, model.mesh
        self.world = self.mesh.shape.world_size
        self.step = 0
        self.stop_requested = False  # this rank got SIGTERM
        self.stopping = False  # some rank got SIGTERM: every rank stops after this step
        self.bad_total = self.bad_in_row = 0
        self._skipped: tuple[int, ...] = ()  # ranks behind a skipped step (empty: the step was applied)
        self._closed = threading.Event()
        self.ring = FingerprintRing(self.diagnostics, rank)
        self.comm.listeners.append(self.ring)
        self._previous_sigterm = None
        self.watchdog = StepWatchdog(cfg.step_timeout_s, rank)

    # -- the loop's calls ----------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.ring.set_step(step)
        self._skipped = ()
        self.watchdog.arm(step)  # this step, with its checkpoint and evaluation, has --step-timeout seconds

    def judge(self, verdict) -> None:
        """Take the step's verdict (the model's agreement): count a non-finite step, note a stop request."""
        self.stopping = self.stopping or verdict.stop
        self._skipped = verdict.nonfinite_ranks
        self.bad_in_row = self.bad_in_row + 1 if self._skipped else 0
        self.bad_total += bool(self._skipped)

    def end_step(self, step: int) -> None:
        """Stop if a skipped step is one too many; check the replicas when due."""
        if self._skipped:
            where = f"non-finite loss/grad at step {step} ({_ranks(self._skipped)})"
            if self.cfg.nan_policy == "abort":
                raise TrainingAborted(f"{where}; the step was not applied (--nan-policy abort)")
            if self.bad_in_row >= self.cfg.max_bad_steps:
                raise TrainingAborted(f"{where}: {self.bad_in_row} steps in a row skipped "
                                      f"(--max-bad-steps {self.cfg.max_bad_steps})")
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
        except OOM_ERRORS as exc:
            mark_failed(self.diagnostics, self.rank)  # read by the peers' SIGTERM watchdogs
            cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            error = OutOfMemory(f"rank {self.rank} ran out of memory at step {self.step} ({cause}); {OOM_HINT}")
            if self.world > 1:
                print(f"paratrain: {error}", file=sys.stderr, flush=True)
            raise error from exc
        except Exception as exc:
            mark_failed(self.diagnostics, self.rank)
            if self.world == 1 or not _from_a_collective(exc):
                raise
            report = describe(self.diagnostics, self.rank, self.mesh.shape)
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"paratrain: {report}", file=sys.stderr, flush=True)
            # The launcher names the first worker it sees exit. A collective fails here mostly because a peer
            # died or failed first: a moment's wait lets the launcher see that peer's exit before this one's.
            time.sleep(PEER_EXIT_GRACE_S)
            raise CollectiveFailure(f"{report} (error: {cause[:300]})") from exc

    def close(self) -> None:
        """Remove the fingerprint listener and the SIGTERM handler; stop the watchdog."""
        self._closed.set()
        self.watchdog.close()
        if self.ring in self.comm.listeners:
            self.comm.listeners.remove(self.ring)
        self.ring.close()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # -- replicas --------------------------------------------------------------------------
    def _replicated(self) -> list[tuple[str, list[torch.Tensor]]]:
        """(axis, the parameters held now that are equal across it) for dp and cp (whole parameters: DDP,
        ZeRO-1/2), dp_replicate (ZeRO-3's shards under hybrid sharding), tp (those tensor parallelism does
        not split) and pp (the copies of a tied head): each parameter under every axis
        `ParallelModel.replicated_over` names for it at rest."""
        over = {"dp": [], "cp": [], "dp_replicate": [], "tp": [], "pp": []}
        for name, param in self.model.module.named_parameters():
            for axis in self.model.replicated_over(name, at_rest=True):
                over[axis].append(param)
        return list(over.items())

    def perturb(self) -> None:
        """The `perturb` fault: one replicated parameter changed by one unit in the last place, on this rank only."""
        candidates = next((tensors for axis, tensors in self._replicated() if tensors and self.mesh.size(axis) > 1), [])
        if not candidates:
            print(f"paratrain: rank {self.rank}: perturb fault: no replicated parameter here", file=sys.stderr)
            return
        bits = candidates[0].data.view(-1)[:1]
        bits.view(INT_OF_SIZE[bits.element_size()]).add_(1)

    @torch.no_grad()
    def _check_replicas(self, step: int) -> None:
        differs = 0.0
        for axis, tensors in self._replicated():
            n = self.mesh.size(axis)
            if n == 1 or not tensors:
                continue
            mine = bit_hash(tensors).reshape(1).to(self.mesh.device)  # (offloaded parameters hash on the host)
            every = torch.empty(n, dtype=torch.int64, device=self.mesh.device)
            self.comm.all_gather(every, mine, axis)
            differs = max(differs, float(bool((mine != every[0]).item())))
        flags = torch.zeros(self.world, device=self.mesh.device)
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


def _from_a_collective(exc: BaseException) -> bool:
    """Whether `exc` came out of torch.distributed (a backend error, a timeout, a peer gone)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(word in text for word in (
        "gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out", "peer"))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
