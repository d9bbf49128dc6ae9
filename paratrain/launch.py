"""Local multi-process launch through PyTorch's elastic launcher (the library behind torchrun).

``paratrain train --nproc N`` calls :func:`launch_local`, which starts N
worker processes with the same environment torchrun would give them, and a
c10d rendezvous bound to the loopback interface. The c10d store is not
authenticated: it must never listen on a public interface.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from paratrain.config import Config
from paratrain.distributed import free_port
from paratrain.errors import RunFailure


# Exit code of a run stopped by SIGTERM after its checkpoint (the shell's 128 + signal number).
PREEMPTED_EXIT = 128 + signal.SIGTERM
# Seconds the launcher gives workers between its SIGTERM and SIGKILL: they finish the step and save
# (paratrain.run.guard.SIGTERM_GRACE_S is a little less).
SHUTDOWN_TIMEOUT_S = 30


class LaunchFailed(RunFailure):
    """A worker process failed; the message names the first rank that did and why."""


class Preempted(RunFailure):
    """The launcher was told to stop (SIGTERM): the workers checkpointed and stopped; relaunch to resume."""

    exit_code = PREEMPTED_EXIT


@record
def _worker(config: dict) -> None:
    """Entry point of each launched process (module level, so it can be spawned)."""
    from paratrain.train import train

    if train(Config.from_dict(config)).preempted:
        sys.exit(PREEMPTED_EXIT)


def launch_local(cfg: Config) -> None:
    """Run `train(cfg)` on cfg.run.nproc local processes; raise LaunchFailed on failure."""
    try:
        launch_processes(_worker, cfg.to_dict(), cfg.run.nproc, cfg.run.max_restarts)
    except ChildFailedError as e:
        raise LaunchFailed(describe_failure(e, lambda rank: _fingerprint_report(cfg, rank))) from None
    except SignalException as e:  # the agent forwarded the signal to the workers and waited for them
        raise Preempted(f"stopped by {signal.Signals(e.sigval).name}; {_newest_checkpoint(cfg)}") from None


def launch_processes(entry, payload, nproc: int, max_restarts: int = 0) -> None:
    """Run `entry(payload)` on `nproc` local processes through torch's elastic agent, as torchrun would.

    `entry` is a module-level function (it is spawned) and `payload` plain data. The agent's
    ChildFailedError and SignalException reach the caller.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # With the rendezvous store shared between agent and workers (torch's default), a restarted
    # worker can read its peer's address left by the previous attempt and connect to a dead
    # process (gloo "Connection refused", or a hang; pytorch/pytorch#135712). Unshared, each
    # attempt gets a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": 60},
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr="127.0.0.1",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    # The agent logs each failure as a multi-line traceback of its own
    # internals; the one line from describe_failure says what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    elastic_launch(launch, entry)(payload)


def _fingerprint_report(cfg: Config, rank: int) -> str:
    """Where the collectives of `rank`'s stage diverged in the last attempt, by the fingerprints, or ''."""
    from paratrain.run.rundir import DIAGNOSTICS_DIR
    from paratrain.run.diagnose import FLIGHT_PREFIX, describe_flight_records, divergence, ring_path
    from paratrain.mesh import MeshShape

    attempts = sorted((Path(cfg.run.out) / DIAGNOSTICS_DIR).glob("attempt-*"), key=lambda p: int(p.name[8:]))
    if attempts and list(attempts[-1].glob(f"{FLIGHT_PREFIX}*")):  # NCCL: the flight recorder's dumps
        report = describe_flight_records(attempts[-1], cfg.run.nproc)
        return f"its flight records: {report}" if report else ""
    if not attempts or not ring_path(attempts[-1], rank).exists():
        return ""
    p = cfg.parallel
    shape = MeshShape.for_world(cfg.run.nproc, dp=p.dp or None, tp=p.tp, pp=p.pp)
    report = divergence(attempts[-1], rank, shape)
    return f"its fingerprints: {report}" if report else ""


def _newest_checkpoint(cfg: Config) -> str:
    from paratrain.checkpoint import list_checkpoints
    from paratrain.run.rundir import CHECKPOINT_DIR

    found = list_checkpoints(Path(cfg.run.out) / CHECKPOINT_DIR)
    return (f"newest checkpoint {found[-1].name}: relaunch the same command to resume" if found
            else "no checkpoint was saved")


def describe_failure(error: ChildFailedError, fallback=None) -> str:
    """One line: which rank failed first, how, and the error it reported.

    A rank killed by a signal reports nothing: then the first error a peer reported, else
    `fallback(rank)` (the ranks' collective fingerprints) says what is known.
    """
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    detail = _message(failure)
    others = sorted(r for r in error.failures if r != rank)
    also = f" (ranks {others} stopped too)" if others else ""
    if not detail:  # killed by a signal (e.g. gloo's abort on a size mismatch): a peer may have said why
        detail = next((f"rank {r}: {_message(f)}" for r, f in sorted(error.failures.items()) if _message(f)), "")
    if not detail and fallback is not None:
        detail = fallback(rank)
    return f"rank {rank} {how}{': ' + detail if detail else ''}{also}"


def _message(failure) -> str:
    """The first line of the error a failed worker reported, or '' (a worker killed by a signal reports none).

    A worker's own error file gives {"message": {"message": text, ...}} or {"message": text}; a
    signal gives a plain string that repeats what the exit description already says.
    """
    detail = failure.message if isinstance(failure.message, dict) else ""
    while isinstance(detail, dict):
        detail = detail.get("message", "")
    return str(detail).strip().splitlines()[0] if str(detail).strip() else ""
