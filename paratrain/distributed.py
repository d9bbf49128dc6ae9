"""Where this process stands: rank, world size, device and backend, read from the launcher.

The same entry point runs as one process, under ``paratrain train --nproc``,
under ``torchrun`` (single or multi-node) and under Slurm's ``srun``: each of
them describes the job in environment variables, and this module reads them.
Device and backend follow the machine: CUDA + NCCL with one GPU per local
rank when CUDA is available, CPU + gloo otherwise.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Mapping

from paratrain.errors import ParatrainError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

# torch is imported where a function needs it, not here: reading the launcher's environment
# (`detect_env`) is torch-free, so `paratrain train --nproc N` can decide to start its worker
# server before the launcher itself spends seconds importing torch (`paratrain.forkserver.start`).


class LaunchError(ParatrainError, RuntimeError):
    """The launcher's environment is incomplete or contradictory."""


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        """The one process that prints, writes metrics and saves single-file artifacts."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank and world size from torchrun's variables, else Slurm's, else one process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return _slurm_env(env)
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)


def _slurm_env(env: Mapping[str, str]) -> DistEnv:
    """One srun task per device: Slurm's task ids become ranks."""
    if "MASTER_ADDR" not in env:
        raise LaunchError(
            "running under srun without MASTER_ADDR; export MASTER_ADDR=$(scontrol show hostnames "
            "$SLURM_JOB_NODELIST | head -n 1) and MASTER_PORT before srun")
    tasks_per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
    return DistEnv(
        rank=int(env["SLURM_PROCID"]),
        world_size=int(env["SLURM_NTASKS"]),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        local_world_size=int(tasks_per_node.split("(")[0]),
    )


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch.cuda.is_available() and device_count() ask NVML with this set, instead of the CUDA driver: a process
# that asked the driver (cuInit) and then forks gives its children "CUDA error: initialization error" at their
# first CUDA call. Set in every process paratrain forks workers from, or that starts their server.
FORK_SAFE_CUDA_CHECK = ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def visible_gpus() -> int:
    """How many GPUs this process could use, asked without initializing CUDA here (see FORK_SAFE_CUDA_CHECK)."""
    import torch

    os.environ.setdefault(*FORK_SAFE_CUDA_CHECK)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device(env: DistEnv) -> torch.device:
    """One CUDA device per local rank when CUDA is present, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def launcher_store(env: DistEnv, timeout_s: float = 600.0) -> dist.Store:
    """The job's key-value store as the launcher's environment describes it (env://: MASTER_ADDR, MASTER_PORT;
    hosted by torchrun's agent, else by rank 0), opened before the process group.

    Through it the ranks agree on what the group's own setup needs (the run directory, where NCCL's
    flight recorder must be told to dump before the group exists); `init_distributed(store=...)`
    then builds the group on this same store, as torch's env:// initialization would.
    """
    import torch.distributed as dist

    os.environ.setdefault("MASTER_PORT", "29500")
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    return store


def init_distributed(timeout_s: float = 600.0, flight_records: str | None = None,
                     store: dist.Store | None = None) -> tuple[DistEnv, torch.device]:
    """Join the process group described by the environment (if there is more than one process).

    Returns this process's DistEnv and the device it computes on. Safe to call
    when a process group already exists (tests, user scripts). On CUDA, NCCL's
    failure handling and flight recorder are set up first (`nccl_diagnostics`), its dumps
    going to `flight_records` + rank. `store`: the group's rendezvous, already opened by
    `launcher_store` (None: torch opens it from the environment).
    """
    import torch
    import torch.distributed as dist

    env = detect_env()
    device = default_device(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        nccl_diagnostics(os.environ, flight_records)
    if device.type == "cpu" and env.local_world_size > 1:
        # Processes sharing one machine's cores would oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    if env.distributed and not dist.is_initialized():
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend=backend_for(device),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            # The prefix keeps the group's keys apart from the store's other users, as torch's env:// path does.
            **({"store": dist.PrefixStore("default_pg", store)} if store is not None else {}),
            # NCCL: bound to this GPU at once (eager communicator creation, no device guessing).
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    return env, device


def nccl_diagnostics(environ, flight_records: str | None) -> None:
    """What NCCL runs need to fail loudly and say where: set unless the user set them already.

    On NCCL `wait()` does not block the host, so a collective that never completes is caught by
    torch's watchdog: `TORCH_NCCL_ASYNC_ERROR_HANDLING=3` aborts the communicators and the
    process on a timeout or error (instead of a hang), and the flight recorder keeps each rank's
    last collectives (kind, group, sizes, state) and dumps them on a timeout
    (`TORCH_NCCL_DUMP_ON_TIMEOUT`) to `flight_records` + rank, where the launcher's failure
    summary reads them (`paratrain.run.diagnose.describe_flight_records`).
    """
    environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if flight_records is not None:
        environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", flight_records)
        environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", flight_records)


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
