"""Run a function on several local gloo ranks on CPU: calibration measures on them, tests and benchmarks run on them.

`run_on_ranks(fn, world_size, *args)` starts `world_size` processes, joins them
in one gloo process group, calls `fn(rank, world_size, *args)` on each and
returns the per-rank return values in rank order. The first rank to fail is
re-raised in the caller as `RankFailure` with that rank's traceback; a run
that does not finish in time raises `RankTimeout` with the stacks of the ranks
still running. Every rank is dead and joined when the call returns or raises.

Ranks are forked from a forkserver that has already imported torch: a launch
then costs about 0.1 s instead of the ~3 s of a fresh interpreter per rank,
and, unlike a plain fork of the caller, children never inherit the caller's
intra-op thread pool.

Tests reach it as `paratrain.testing.run_on_ranks`, beside the counters they run a step under.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from paratrain import forkserver
from paratrain.distributed import free_port

__all__ = ["RankError", "RankFailure", "RankTimeout", "run_on_ranks"]

# Seconds a rank gets to exit after SIGTERM before it is sent SIGKILL.
_TERM_GRACE = 1.0
# Seconds to keep listening after the first failure, for the death that caused it.
_SETTLE = 0.25
# Seconds a hung rank gets to write its stack after SIGUSR1.
_STACK_GRACE = 0.3
# gloo's own timeout is capped so a stuck collective fails inside the rank
# (with torch's message) before the harness has to kill it.
_MAX_PG_TIMEOUT = 60.0
_PR_SET_PDEATHSIG = 1
_MISSING = object()


class RankError(RuntimeError):
    """Base class of the errors `run_on_ranks` raises for a failed run."""


class RankFailure(RankError):
    """A rank raised, or exited before reporting a result.

    Attributes: `rank` (the first rank to fail), `exitcode` (the process exit
    code when the rank died without reporting, negative for a signal; None
    when it raised), `other_ranks` (ranks that also failed before the rest
    were stopped).
    """

    def __init__(self, message: str, rank: int, exitcode: int | None, other_ranks: list[int]):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.other_ranks = other_ranks


class RankTimeout(RankError):
    """The run did not finish in time. Attributes: `ranks` (those still running), `timeout`."""

    def __init__(self, message: str, ranks: list[int], timeout: float):
        super().__init__(message)
        self.ranks = ranks
        self.timeout = timeout


@dataclass
class _Failure:
    at: float  # time.monotonic(), shared by all processes on Linux
    headline: str
    detail: str
    exitcode: int | None = None


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    value: Any = _MISSING
    failure: _Failure | None = None
    exited: bool = False
    stopped: bool = False

    @property
    def reported(self) -> bool:
        return self.value is not _MISSING or self.failure is not None


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list:
    """Run fn(rank, world_size, *args) on world_size processes joined in a gloo group; return the per-rank return values.

    `fn` must be picklable by reference (defined at module level in an
    importable module); `args` and the return values travel with plain
    `pickle`, so tensors arrive as copies. Each rank runs with one thread,
    the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) and `env` set, and the default process group
    initialised. `timeout` bounds the run in seconds, counted once every
    rank has been started (so excluding the one-off forkserver start-up).

    Raises `RankFailure` for the first rank to raise or die, `RankTimeout`
    when a rank has not finished after `timeout`.
    """
    _check_arguments(fn, world_size, timeout, env)
    payload = _pickle_call(fn, args)
    context = _context()
    ranks: list[_Rank] = []
    with tempfile.TemporaryDirectory(prefix="paratrain-ranks-") as run_dir:
        try:
            _start_ranks(context, ranks, world_size, timeout, env or {}, payload, run_dir)
            _collect(ranks, timeout, run_dir)
        finally:
            _stop_ranks(ranks)
    return [r.value for r in ranks]


def _check_arguments(fn, world_size, timeout, env) -> None:
    if not callable(fn):
        raise ValueError(f"fn must be a callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"env must map str to str, got {key!r}: {value!r}")


def _pickle_call(fn, args) -> bytes:
    # Pickled once in the caller so an unpicklable fn fails before any process
    # starts, with a hint instead of a child-side AttributeError.
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise ValueError(
            f"fn and args must be picklable (fn defined at module level, not a lambda "
            f"or nested function): {type(exc).__name__}: {exc}"
        ) from exc


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloaded with torch and this module (`paratrain.forkserver`)."""
    return forkserver.context(__name__)


def _start_ranks(context, ranks, world_size, timeout, env, payload, run_dir) -> None:
    """Start one process per rank, appending each to `ranks` as soon as it exists."""
    init_method = f"file://{os.path.join(run_dir, 'store')}"
    rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env}
    pg_timeout = min(timeout, _MAX_PG_TIMEOUT)
    for rank in range(world_size):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_rank_main,
            args=(rank, world_size, init_method, pg_timeout, rank_env, payload, writer, run_dir),
            name=f"paratrain-rank{rank}",
            daemon=True,
        )
        try:
            process.start()
        finally:
            # The parent must drop its copy of the write end, or a dead rank's
            # pipe would never read as closed.
            writer.close()
        ranks.append(_Rank(rank, process, reader))


def _collect(ranks: list[_Rank], timeout: float, run_dir: str) -> None:
    """Wait until every rank reported and exited; raise on the first failure or at the deadline."""
    deadline = time.monotonic() + timeout
    settle_until = None
    handles = {}
    for r in ranks:
        handles[r.conn] = r
        handles[r.process.sentinel] = r
    while handles:
        limit = deadline if settle_until is None else settle_until
        ready = multiprocessing.connection.wait(list(handles), max(limit - time.monotonic(), 0))
        if not ready:
            if settle_until is not None:
                break
            raise _timeout_error(ranks, timeout, run_dir)
        for handle in ready:
            _handle_ready(handles, handle)
        if settle_until is None and any(r.failure for r in ranks):
            # A peer's "connection closed" error can arrive before the death
            # that caused it is seen; wait briefly so the cause is on record.
            settle_until = min(time.monotonic() + _SETTLE, deadline)
    if any(r.failure for r in ranks):
        raise _failure_error(ranks)


def _handle_ready(handles: dict, handle) -> None:
    r = handles.pop(handle, None)
    if r is None:
        return
    if handle is r.conn:
        _receive(r)
        return
    if r.conn in handles and r.conn.poll():
        _receive(handles.pop(r.conn))
    _note_exit(r)


def _receive(r: _Rank) -> None:
    """Read the one message a rank sends: ("ok", value) or ("error", at, headline, detail)."""
    try:
        message = pickle.loads(r.conn.recv_bytes())
    except (EOFError, OSError):
        return  # closed without a message: the exit handler reports it
    except Exception as exc:
        r.failure = _Failure(time.monotonic(), f"its result could not be unpickled: {exc!r}", "")
        return
    if message[0] == "ok":
        r.value = message[1]
    else:
        r.failure = _Failure(*message[1:])


def _note_exit(r: _Rank) -> None:
    r.exited = True
    if r.reported:
        return
    r.process.join(0)
    code = r.process.exitcode
    r.failure = _Failure(time.monotonic(), f"{_describe_exit(code)} before reporting a result", "", code)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {name} ({-code})"
    return f"exited with code {code}"


def _failure_error(ranks: list[_Rank]) -> RankFailure:
    """Stop every rank, then describe the earliest failure; later ones are listed by rank."""
    _stop_ranks(ranks)
    # A rank that died without a word goes first: the errors its peers raise
    # when their connections to it break are consequences, and a death is only
    # seen some time after it happened. Reported errors follow in time order.
    # A peer's broken connection is a consequence too, even when its report is the earlier one (a rank
    # whose collective timed out closes its connections before its own error is reported).
    failed = sorted((r for r in ranks if r.failure),
                    key=lambda r: (r.failure.exitcode is None, _is_consequence(r.failure.headline), r.failure.at))
    first, others = failed[0], [r.rank for r in failed[1:]]
    message = f"rank {first.rank} failed: {first.failure.headline}"
    if others:
        message += f"\n(also failed, later: {_rank_list(others)})"
    if first.failure.detail:
        message += f"\n--- traceback of rank {first.rank} ---\n{first.failure.detail}"
    return RankFailure(message, first.rank, first.failure.exitcode, others)


def _is_consequence(headline: str) -> bool:
    return "Connection closed by peer" in headline or "Connection reset by peer" in headline


def _drain(ranks: list[_Rank]) -> None:
    """Read messages that arrived before the ranks were stopped."""
    for r in ranks:
        if not r.reported and not r.stopped and r.conn.poll():
            _receive(r)


def _timeout_error(ranks: list[_Rank], timeout: float, run_dir: str) -> RankTimeout:
    """Collect the Python stacks of the unfinished ranks, stop all, and describe the hang."""
    stuck = [r for r in ranks if not (r.reported and r.exited)]
    for r in stuck:
        _signal_rank(r, signal.SIGUSR1, group=False)
    time.sleep(_STACK_GRACE)
    _stop_ranks(ranks)
    message = f"{_rank_list([r.rank for r in stuck])} did not finish within the {timeout:g} s timeout"
    for r in stuck:
        message += f"\n--- stack of rank {r.rank} at the timeout ---\n{_read_stack(run_dir, r.rank)}"
    return RankTimeout(message, [r.rank for r in stuck], timeout)


def _read_stack(run_dir: str, rank: int) -> str:
    try:
        with open(os.path.join(run_dir, f"rank{rank}.stack")) as f:
            return f.read().strip() or "(no stack written)"
    except OSError:
        return "(no stack written)"


def _rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _stop_ranks(ranks: list[_Rank]) -> None:
    """Terminate, then kill, every rank and its process group; join and release all. Idempotent."""
    live = [r for r in ranks if not r.stopped]
    for r in live:
        _signal_rank(r, signal.SIGTERM)
    deadline = time.monotonic() + _TERM_GRACE
    for r in live:
        r.process.join(max(deadline - time.monotonic(), 0))
    for r in live:
        # SIGKILL the group even when the rank exited: it reaps helpers the
        # rank started (data-loader workers, subprocesses).
        _signal_rank(r, signal.SIGKILL)
        r.process.join()
    _drain(ranks)
    for r in live:
        r.process.close()
        r.conn.close()
        r.stopped = True


def _signal_rank(r: _Rank, sig: int, group: bool = True) -> None:
    """Send `sig` to a rank's process group (each rank leads its own), else to the rank itself."""
    if group:
        try:
            os.killpg(r.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # group already empty, or the rank had not created it yet
    # Only while exitcode is None is the pid surely still this rank's (the
    # same guard as Process.terminate).
    if r.process.exitcode is None:
        try:
            os.kill(r.process.pid, sig)
        except ProcessLookupError:
            pass


def _rank_main(rank, world_size, init_method, pg_timeout, env, payload, conn, run_dir) -> None:
    """Entry point of one rank: set up, run fn, send back one message."""
    try:
        _isolate_process(rank, run_dir)
        _set_rank_env(rank, world_size, env)
        torch.set_num_threads(1)
        fn, args = pickle.loads(payload)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, init_method=init_method,
            timeout=timedelta(seconds=pg_timeout),
        )
        # gloo lets a rank leave init before its peers have finished connecting;
        # a rank that then returned and exited at once would fail their init.
        dist.barrier()
        value = fn(rank, world_size, *args)
        if dist.is_initialized():  # fn may have torn the group down itself
            dist.destroy_process_group()
        message = pickle.dumps(("ok", value))
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        headline = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
        conn.send_bytes(pickle.dumps(("error", time.monotonic(), headline, detail)))
        # The caller kills this process: flush what fn printed, or it is lost.
        sys.stdout.flush()
        sys.stderr.flush()
        # Stay alive, group intact, until the caller kills every rank: exiting
        # now would make peers blocked in a collective with this rank fail too,
        # burying the cause under "connection closed" errors.
        time.sleep(pg_timeout)
        return
    conn.send_bytes(message)
    conn.close()


def _isolate_process(rank: int, run_dir: str) -> None:
    """Make the rank killable as a group, dump its stack on SIGUSR1, and die with the forkserver."""
    os.setpgid(0, 0)
    # Kept open for the life of the process; faulthandler writes to its fd.
    stack_file = open(os.path.join(run_dir, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    if sys.platform == "linux":
        # The forkserver exits when the calling process does; without this a
        # hung rank would outlive a caller that was itself killed.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _set_rank_env(rank: int, world_size: int, env: dict[str, str]) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(env)
