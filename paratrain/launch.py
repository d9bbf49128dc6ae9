"""Local multi-process launch through PyTorch's elastic launcher (the library behind torchrun).

``paratrain train --nproc N`` calls :func:`launch_local`, which starts N
worker processes with the same environment torchrun would give them (forked from
a server that imported torch once: `paratrain.forkserver`), and a
c10d rendezvous bound to the loopback interface. The c10d store is not
authenticated: it must never listen on a public interface. With ``--nnodes M``
each node's launcher meets the others at ``--rdzv-endpoint`` under
``--rdzv-id``; a rendezvous that does not fill within ``--join-timeout`` ends
with one line, and a node whose launcher sent no heartbeat for ``--node-timeout``
seconds is dropped from it, so that one started in its place can join. With
``--step-timeout``, the launcher runs the timer server that kills a worker which
made no progress (`paratrain.run.watchdog`).
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
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import elastic_launch

from paratrain import forkserver
from paratrain.compat import elastic_launch_config, name_rendezvous_events_by_frame
from paratrain.config import Config
from paratrain.distributed import free_port
from paratrain.errors import RunFailure, one_line_warnings
from paratrain.run.watchdog import StepTimerServer, use_launcher_queue


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
def _worker(config: dict, timer_requests=None) -> None:
    """Entry point of each launched process (module level: it is pickled to the forked worker)."""
    from paratrain.train import train

    if timer_requests is not None:
        use_launcher_queue(timer_requests)
    with one_line_warnings("train"):
        preempted = train(Config.from_dict(config)).preempted
    if preempted:
        sys.exit(PREEMPTED_EXIT)


def launch_local(cfg: Config) -> None:
    """Run `train(cfg)` on cfg.run.nproc local processes; raise LaunchFailed on failure."""
    launch = launch_config(cfg)
    timer = _start_timer_server(cfg.reliability.step_timeout_s, lambda rank: _where_is(cfg, rank))
    try:
        _launch(launch, _worker, cfg.to_dict(), timer.requests if timer else None)
    except ChildFailedError as e:
        raise LaunchFailed(describe_failure(e, lambda rank: _fingerprint_report(cfg, rank))) from None
    except SignalException as e:  # the agent forwarded the signal to the workers and waited for them
        raise Preempted(f"stopped by {signal.Signals(e.sigval).name}; {_newest_checkpoint(cfg)}") from None
    except RendezvousError as e:
        raise LaunchFailed(describe_rendezvous_failure(e, launch, cfg.run.nnodes)) from None
    finally:
        if timer:
            timer.close()


def launch_processes(entry, payload, nproc: int, max_restarts: int = 0) -> None:
    """Run `entry(payload)` on `nproc` processes of this node through torch's elastic agent, as torchrun would.

    `entry` is a module-level function (it is pickled to each worker) and `payload` plain data. The agent's
    ChildFailedError and SignalException reach the caller.
    """
    _launch(_node_config(nproc, max_restarts), entry, payload)


def _launch(launch, entry, *args) -> None:
    # With the rendezvous store shared between agent and workers (torch's default), a restarted
    # worker can read its peer's address left by the previous attempt and connect to a dead
    # process (gloo "Connection refused", or a hang; pytorch/pytorch#135712). Unshared, each
    # attempt gets a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The agent logs each failure as a multi-line traceback of its own
    # internals; the one line from describe_failure says what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    name_rendezvous_events_by_frame()
    forkserver.start()  # running, its preload set, before the agent asks for workers
    elastic_launch(launch, _forked)(entry, forkserver.launcher_state(), *args)


def _forked(entry, state: dict, *args):
    """Each worker's first call: the launcher's environment, directory and import path taken, then `entry(*args)`."""
    forkserver.adopt(state)
    return entry(*args)


def launch_config(cfg: Config):
    """torch's elastic `LaunchConfig`: this node's processes, the rendezvous of the job's nodes, restarts."""
    r = cfg.run
    return _node_config(r.nproc, r.max_restarts, r.nnodes, r.rdzv_id, r.rdzv_endpoint, r.join_timeout_s,
                        r.node_timeout_s)


def _node_config(nproc: int, max_restarts: int, nnodes: int = 1, rdzv_id: str | None = None,
                 endpoint: str | None = None, join_timeout_s: float = 60, node_timeout_s: int = 15):
    return elastic_launch_config(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=rdzv_id or uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": join_timeout_s, **heartbeats(node_timeout_s)},
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="forkserver",  # workers forked from one process that imported torch (paratrain.forkserver)
        # One node: everything on the loopback interface. Several: each node's own address.
        local_addr="127.0.0.1" if nnodes == 1 else None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,  # newer than torch 2.11, whose agent waits 30 s too
    )


def heartbeats(node_timeout_s: int) -> dict[str, int]:
    """The rendezvous' keep-alive settings for --node-timeout: a heartbeat every third of it (whole seconds, torch's
    unit), and the node lost after three missed. A lost node stays a participant of the last round until then: the
    other nodes' restarted agents and a node started in its place wait for it to expire before a new round forms."""
    interval = max(1, node_timeout_s // 3)
    return {"keep_alive_interval": interval, "keep_alive_max_attempt": max(1, round(node_timeout_s / interval))}


def describe_rendezvous_failure(error: RendezvousError, launch, nnodes: int) -> str:
    """One line for a rendezvous that failed: a timeout names the nodes it waited for and what to do."""
    where = f"the rendezvous at {launch.rdzv_endpoint} (--rdzv-id {launch.run_id})"
    if isinstance(error, RendezvousTimeoutError):
        return (f"{where} timed out after {launch.rdzv_configs['join_timeout']:g} s (--join-timeout) before all "
                f"{nnodes} node(s) (--nnodes) joined; start `paratrain train` with the same --nnodes, "
                f"--rdzv-endpoint and --rdzv-id on every node, or lower --nnodes")
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{where} failed: {detail}"


class _TimerServer:
    """The launcher's timer server and the queue its workers send their countdowns over."""

    def __init__(self, timeout_s: float, explain):
        # A queue of the workers' context: it travels to them as an argument of their entry point.
        self.requests = forkserver.context().Queue()
        self.server = StepTimerServer(self.requests, timeout_s, explain=explain)
        self.server.start()

    def close(self) -> None:
        self.server.stop()
        self.requests.close()
        self.requests.join_thread()


def _start_timer_server(timeout_s: float, explain) -> _TimerServer | None:
    return _TimerServer(timeout_s, explain) if timeout_s > 0 else None


def _fingerprint_report(cfg: Config, rank: int) -> str:
    """Where the collectives diverged in the last attempt: by the flight recorder's dumps (NCCL), else by the
    fingerprints of `rank`'s stage; '' when neither says."""
    from paratrain.run.diagnose import FLIGHT_PREFIX, describe_flight_records, divergence
    from paratrain.run.rundir import DIAGNOSTICS_DIR

    attempts = sorted((Path(cfg.run.out) / DIAGNOSTICS_DIR).glob("attempt-*"), key=lambda p: int(p.name[8:]))
    if attempts and list(attempts[-1].glob(f"{FLIGHT_PREFIX}*")):
        report = describe_flight_records(attempts[-1], cfg.run.nproc * cfg.run.nnodes)
        return f"its flight records: {report}" if report else ""
    found = _last_attempt(cfg, rank)
    report = divergence(*found) if found else ""
    return f"its fingerprints: {report}" if report else ""


def _where_is(cfg: Config, rank: int) -> str:
    """Where `rank` is in the current attempt and how its stage's collectives differ, by the fingerprints, or ''."""
    from paratrain.run.diagnose import describe

    found = _last_attempt(cfg, rank)
    return describe(*found) if found else ""


def _last_attempt(cfg: Config, rank: int):
    """(diagnostics directory of the last attempt, rank, mesh shape) when `rank` left fingerprints there, else None."""
    from paratrain.run.rundir import DIAGNOSTICS_DIR
    from paratrain.run.diagnose import ring_path
    from paratrain.mesh import MeshShape

    attempts = sorted((Path(cfg.run.out) / DIAGNOSTICS_DIR).glob("attempt-*"), key=lambda p: int(p.name[8:]))
    if not attempts or not ring_path(attempts[-1], rank).exists():
        return None
    p = cfg.parallel
    shape = MeshShape.for_world(cfg.run.nproc * cfg.run.nnodes, dp=p.dp or None, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                                dp_shard=p.dp_shard or None)
    return attempts[-1], rank, shape


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
