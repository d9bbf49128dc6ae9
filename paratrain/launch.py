"""Local multi-process launch through PyTorch's elastic launcher (the library behind torchrun).

``paratrain train --nproc N`` calls :func:`launch_local`, which starts N
worker processes with the same environment torchrun would give them, and a
c10d rendezvous bound to the loopback interface. The c10d store is not
authenticated: it must never listen on a public interface.
"""

from __future__ import annotations

import logging
import os
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from paratrain.config import Config
from paratrain.distributed import free_port


class LaunchFailed(RuntimeError):
    """A worker process failed; the message names the first rank that did and why."""


@record
def _worker(config: dict) -> None:
    """Entry point of each launched process (module level, so it can be spawned)."""
    from paratrain.train import train

    train(Config.from_dict(config))


def launch_local(cfg: Config, entry=None) -> None:
    """Run `train(cfg)` on cfg.run.nproc local processes; raise LaunchFailed on failure.

    `entry` replaces the per-process entry point (a module-level function taking the config
    as a dict, which must call `train`); `paratrain verify` uses it to inject faults.
    """
    run_id = uuid.uuid4().hex[:8]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.run.nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": 60},
        max_restarts=cfg.run.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    # The agent logs each failure as a multi-line traceback of its own
    # internals; the one line from describe_failure says what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        elastic_launch(launch, entry or _worker)(cfg.to_dict())
    except ChildFailedError as e:
        raise LaunchFailed(describe_failure(e)) from None


def describe_failure(error: ChildFailedError) -> str:
    """One line: which rank failed first, how, and the error it reported."""
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    # A worker's own error file gives {"message": {"message": text, ...}} or {"message": text}; a
    # signal gives a plain string that repeats what `how` already says.
    detail = failure.message if isinstance(failure.message, dict) else ""
    while isinstance(detail, dict):
        detail = detail.get("message", "")
    detail = str(detail).strip().splitlines()[0] if str(detail).strip() else ""
    others = sorted(r for r in error.failures if r != rank)
    also = f" (ranks {others} stopped too)" if others else ""
    return f"rank {rank} {how}{': ' + detail if detail else ''}{also}"
