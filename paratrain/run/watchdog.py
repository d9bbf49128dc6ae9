"""The step watchdog (``--step-timeout``): a rank that makes no progress is killed from outside, and the job restarts.

A rank stuck outside any collective (a data read that never returns, a deadlock in user code)
is not ended by the process-group timeout: its peers time out only when they wait for it in
a collective, and a job whose every rank is stuck waits forever. torch's elastic timer ends
it: at the start of every step the rank arms a countdown (`TimerClient.acquire`, the request
that `torch.distributed.elastic.timer.expires` sends), and a timer server outside the rank's
interpreter kills it with SIGKILL when the countdown runs out, even when it is wedged in native
code holding the GIL. The launcher then sees a failed worker and restarts the group
(``--max-restarts``), which resumes from the newest checkpoint.

The server depends on how the job was launched:

* ``paratrain train --nproc N``: a `StepTimerServer` (torch's `LocalTimerServer`) in the
  launcher's process; each worker gets its request queue as an argument (`use_launcher_queue`);
* torchrun with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``: the agent's `FileTimerServer`, found
  through ``TORCHELASTIC_TIMER_FILE`` (torch's file server then ends the agent too, leaving the
  restart to the job's scheduler);
* neither (one process, srun): a `StepTimerServer` thread in the process itself, which can end
  the process but not restart it, and only while the GIL is free.
"""

from __future__ import annotations

import os
import queue
import re
import stat
import sys
import time
from typing import Callable

from torch.distributed.elastic.timer import FileTimerClient, LocalTimerClient, LocalTimerServer

TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
POLL_S = 0.5  # how often the server looks for expired countdowns

# The request queue of the launcher's server, handed to the worker's entry point. Module state,
# like torch's own `timer.configure`, so that `train(cfg)` keeps the config as its one argument.
_launcher_queue = None


def use_launcher_queue(requests) -> None:
    """In a worker started by `paratrain.launch`: send countdowns to the launcher's server over `requests`."""
    global _launcher_queue
    _launcher_queue = requests


class StepTimerServer(LocalTimerServer):
    """torch's `LocalTimerServer`, which also says on stderr which rank it kills and why.

    (The launcher silences torch's elastic logs, where the server reports its kills.)
    """

    def __init__(self, requests, timeout_s: float, in_process: bool = False,
                 explain: Callable[[int], str] | None = None):
        super().__init__(requests, max_interval=POLL_S, daemon=True)
        self.timeout_s, self.in_process = timeout_s, in_process
        self.explain = explain  # explain(rank): where the rank is, from the collective fingerprints
        self._expired: dict[int, list[str]] = {}

    def get_expired_timers(self, deadline: float):
        expired = super().get_expired_timers(deadline)
        self._expired = {pid: [r.scope_id for r in requests] for pid, requests in expired.items()}
        return expired

    def _reap_worker(self, worker_id: int) -> bool:
        # TimerServer's hook for ending a worker whose countdown expired (worker_id is its pid).
        scopes = self._expired.get(worker_id, [])
        action = (f"ending this process ({worker_id})" if self.in_process else
                  f"killing its process ({worker_id}); the launcher restarts the job if --max-restarts allows")
        print(f"paratrain: {', '.join(scopes) or 'a rank'} made no progress for {self.timeout_s:g} s "
              f"(--step-timeout): {action}{self._detail(scopes)}", file=sys.stderr, flush=True)
        return super()._reap_worker(worker_id)

    def _detail(self, scopes: list[str]) -> str:
        if not (self.explain and scopes):
            return ""
        # A failed explanation must not spare the worker: torch counts a raising _reap_worker as reaped.
        try:
            return f" [{self.explain(_rank_of(scopes[0]))}]"
        except Exception:  # noqa: BLE001
            return ""


class StepWatchdog:
    """One rank's countdown: `arm(step)` at the start of every step, `close()` when the loop ends."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank
        self._server = None
        self._client = self._connect() if timeout_s > 0 else None
        self._scope: str | None = None

    def _connect(self):
        if _launcher_queue is not None:
            return LocalTimerClient(_launcher_queue)
        path = os.environ.get(TIMER_FILE_ENV)
        if path and _is_fifo(path):  # torchrun's agent runs a FileTimerServer at this pipe
            return FileTimerClient(path)
        requests = queue.Queue()  # no launcher's server: one in this process
        self._server = StepTimerServer(requests, self.timeout_s, in_process=True)
        self._server.start()
        return LocalTimerClient(requests)

    def arm(self, step: int) -> None:
        """Start this step's countdown (replacing the previous step's)."""
        if self._client is None:
            return
        self.disarm()
        self._scope = _scope(self.rank, step)
        self._client.acquire(self._scope, time.time() + self.timeout_s)

    def disarm(self) -> None:
        if self._client is not None and self._scope is not None:
            self._client.release(self._scope)
            self._scope = None

    def close(self) -> None:
        self.disarm()
        if self._server is not None:
            self._server.stop()
            self._server = None


def _scope(rank: int, step: int) -> str:
    """A countdown's name: what the server's message says of the rank it kills."""
    return f"rank {rank} at step {step}"


def _rank_of(scope: str) -> int:
    return int(re.match(r"rank (\d+)", scope)[1])


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False
