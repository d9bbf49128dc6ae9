"""The process paratrain starts its worker processes from: torch imported once, every worker forked from it.

A fresh interpreter per worker (multiprocessing's "spawn", torchrun's default) imports torch and
torch._dynamo again, 3–5 s of CPU per process, at every launch and every elastic restart. The
forkserver imports them once, when it first starts, and forks each worker from that state
(`context`). The server never initializes CUDA (importing torch does not), so each worker
initializes its own, as a spawned one would.

A forked worker inherits the server's state from when the server started, not the launcher's
now: the launcher hands its environment, working directory and `sys.path` over at each launch
(`launcher_state`), and the worker takes them (`adopt`), keeping the variables its launcher set
for it alone since the fork (RANK, LOCAL_RANK, MASTER_PORT, …), as spawn would have given it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys

from paratrain.distributed import FORK_SAFE_CUDA_CHECK

# The server's environment: this module is preloaded there, so a forked worker inherits this snapshot.
_SERVER_ENV = dict(os.environ)
_IMPORTED_IN = os.getpid()

# _dynamo: optimizers and meta-device initialization import it lazily; paratrain.train: what every worker runs.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "paratrain.train"]


# Hugging Face architectures paratrain reads and writes (paratrain.interop.hf): a model factory or a test that
# builds one does so in every worker.
HF_MODELING = ("transformers.models.llama.modeling_llama", "transformers.models.mixtral.modeling_mixtral")


def _loaded_libraries() -> list[str]:
    """What the caller has imported that each worker would import again, for seconds of one core: pytest (test
    modules import it), transformers (about 2 s with a model's classes) with the modeling modules the caller
    has loaded and those of the architectures paratrain lays out. A module the server cannot import is skipped."""
    found = ["pytest"] if "pytest" in sys.modules else []
    if "transformers" in sys.modules:
        loaded = [m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m]
        found += ["transformers", *dict.fromkeys([*HF_MODELING, *loaded])]
    return found


def context(*extra: str) -> multiprocessing.context.BaseContext:
    """The forkserver context; when its server first starts, it preloads torch, the trainer, this module, `extra`
    and the libraries the caller has loaded that workers would import again (`_loaded_libraries`)."""
    ctx = multiprocessing.get_context("forkserver")
    # The server forks every worker: nothing in it may initialize the CUDA driver, and torch's own availability
    # checks (in the preload or in code it runs) do unless they ask NVML. Inherited when the server starts.
    os.environ.setdefault(*FORK_SAFE_CUDA_CHECK)
    # This module: its import in the server takes the snapshot `adopt` compares against. The last: it freezes
    # what the others made.
    preload = [*PRELOAD, __name__, *extra, *_loaded_libraries(), "paratrain.forkserver_preloaded"]
    ctx.set_forkserver_preload(preload)
    return ctx


def start(*extra: str) -> multiprocessing.context.BaseContext:
    """`context(*extra)` with its server running now, started with one intra-op thread per worker.

    Torch-free: a launcher that calls it before importing torch itself (`paratrain train --nproc N`)
    has the server's preload run on one core while its own imports run on another, about 3 s sooner
    to the first step. A second call finds the server running and does nothing.
    """
    # Read by the OpenMP runtime once, when torch loads it: in the server, before its preload imports torch.
    # Workers sharing the machine's cores would oversubscribe them (init_distributed sets their threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = context(*extra)
    multiprocessing.forkserver.ensure_running()
    return ctx


def running() -> bool:
    """Whether this process started a worker server that is still its to use (`start`)."""
    return multiprocessing.forkserver._forkserver._forkserver_pid is not None


def stop() -> None:
    """End the worker server this process started, at once, even while its preload still runs: a launch refused
    before any worker started leaves no server behind (nor the seconds of one core its preload would still take,
    with the server's memory). A no-op when none is running."""
    if running():
        server = multiprocessing.forkserver._forkserver
        os.kill(server._forkserver_pid, signal.SIGKILL)  # before any worker: nothing of its own to end
        server._stop()  # reaps it, closes the pipe that kept it alive, removes its socket


def launcher_state() -> dict:
    """What a spawned worker would have inherited from the launcher now: environment, directory, import path."""
    return {"environ": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}


def adopt(state: dict) -> None:
    """In a forked worker: take the launcher's `state`, over it the variables set for this worker since the fork."""
    if os.getpid() == _IMPORTED_IN:
        # Not inherited from a server that preloaded this module (another caller started it first): what was
        # set for this worker alone is unknown, so every variable it has stays and the launcher's are added.
        own = dict(os.environ)
    else:
        own = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**state["environ"], **own})
    os.chdir(state["cwd"])
    sys.path[:] = state["path"]
