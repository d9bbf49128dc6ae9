"""Refuse to start a run whose planned memory per process exceeds the memory one process has.

The estimate is the planner's (`paratrain.plan.estimate_memory`, what `paratrain plan` prints
for this model and layout): model states, activations of the micro-batches in flight and
communication buffers of the worst pipeline stage. The budget is ``--mem-budget``: a size, or
'auto'. On the CPU 'auto' is this machine's memory (or its cgroup's limit) shared by the local
processes. On CUDA it is what the plan may have of the device beside memory that torch's
allocator never sees: the CUDA context and NCCL's buffers (`cuda_reserve`). It is checked
twice: before any process group exists, against the device's whole memory less both; and once
the mesh exists (`check_free_memory`), against what the fullest GPU of the job has free then
(the context, and anything another process holds, already gone) less NCCL's buffers.

A run over budget would only die later, one rank out of memory in the middle of a step;
refused now, the message gives the breakdown to act on, and ``--no-mem-check`` starts it
anyway (the estimate leaves out the framework's own memory and may err either way).
"""

from __future__ import annotations

import os
from pathlib import Path

from paratrain.config import Config, ConfigError
from paratrain.mesh import WORLD, Mesh, MeshShape
from paratrain.models import ModelConfig
from paratrain.parallel.rules import Checkpointing
from paratrain.plan import Layout, MemoryBreakdown, Workload, estimate_memory
from paratrain.plan.lora import run_options

# cgroup v2, then v1: a container's limit is what the processes really have.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")

MiB = 2**20
# One process's CUDA context: the driver's state, the kernels it loads (lazily since CUDA 11.7) and the
# cuBLAS/cuDNN handles and workspaces torch makes on first use, 0.5-1 GiB on current GPUs. Taken at the top
# of that range: none of it passes through torch's caching allocator, so the plan never counts it.
CUDA_CONTEXT_BYTES = 1024 * MiB
# One NCCL communicator's buffers, allocated when its first collective connects it: per channel and per peer
# it exchanges with, a FIFO of NCCL_BUFFSIZE (4 MiB, the Simple protocol) and LL128's buffer of about the
# same size; a ring has 2 peers and NCCL opens up to 32 channels over NVLink, so 4 MiB × 2 × 2 × 32 =
# 512 MiB. About 10 MiB per channel and peer was measured on 8 × H100 (NVIDIA/nccl#1685); NVLS and
# all-to-all patterns take more, a smaller NCCL_BUFFSIZE or fewer channels less.
NCCL_COMMUNICATOR_BYTES = 512 * MiB


def check_memory_budget(cfg: Config, model_cfg: ModelConfig, dp: int) -> None:
    """ConfigError with the estimate's breakdown when it exceeds --mem-budget (nothing with --no-mem-check)."""
    from paratrain.distributed import detect_env

    env = detect_env()
    launcher = not env.distributed and (cfg.run.nproc > 1 or cfg.run.nnodes > 1)  # it starts the workers
    local_processes = cfg.run.nproc if launcher else env.local_world_size
    p = cfg.parallel
    shape = MeshShape(pp=p.pp, dp=dp, tp=p.tp, dp_shard=p.dp_shard, cp=p.cp, ep=p.ep)
    budget = memory_budget(cfg.run.mem_budget, local_processes, launcher, shape)  # a bad --mem-budget is refused anyway
    if not cfg.run.mem_check:
        return
    memory = planned_memory(cfg, model_cfg, dp)
    check_host_memory(memory, local_processes, cfg.parallel.offload)
    if budget is None:
        return
    size, source = budget
    import torch

    # without a GPU the offloaded state is in the same memory as the rest
    total = memory.total + (0.0 if torch.cuda.is_available() else memory.host)
    if total > size:
        raise over_budget(memory, f"its budget of {format_bytes(size)} ({source})")


def check_host_memory(memory: MemoryBreakdown, local_processes: int, offload: str) -> None:
    """ConfigError (one line) when the offloaded state of this machine's processes exceeds its memory."""
    need = memory.host * local_processes
    have = machine_memory()
    if memory.host and need > have:
        each = f" ({local_processes} local processes × {format_bytes(memory.host)})" if local_processes > 1 else ""
        raise ConfigError(f"--offload {offload}: the host state of the masters, Adam moments and gradient buffers, "
                          f"{format_bytes(need)}{each}, exceeds this machine's {format_bytes(have)} of memory; shard "
                          f"it over more ranks (--zero 1 or more, more machines), or pass --no-mem-check")


def check_free_memory(cfg: Config, model_cfg: ModelConfig, mesh: Mesh) -> None:
    """Once the mesh exists, on CUDA with --mem-budget auto: ConfigError when the plan exceeds the free memory of
    the job's fullest GPU less the NCCL buffers still to come (collective: every rank refuses alike).

    The free bytes are `torch.cuda.mem_get_info`'s, read after the CUDA context was made (reading them
    makes it), so they leave out the context and whatever other processes hold on the device.
    NCCL connects a communicator's buffers at its first collective, so they are still to come; the
    few already connected (the setup's barriers) are counted twice, on the safe side.
    """
    if not (cfg.run.mem_check and cfg.run.mem_budget == "auto" and mesh.device.type == "cuda"):
        return
    import torch
    import torch.distributed as dist

    free = torch.zeros(mesh.size(WORLD), dtype=torch.float64)
    free[mesh.rank] = float(torch.cuda.mem_get_info(mesh.device)[0])
    if mesh.size(WORLD) > 1:  # every rank's free bytes on every rank: one all-reduce of a sum
        group = mesh.group(WORLD)
        on = mesh.device if dist.get_backend(group) == "nccl" else torch.device("cpu")  # gloo reduces host tensors
        free = free.to(on)
        dist.all_reduce(free, group=group)
        free = free.cpu()
    rank = int(free.argmin())
    reserve, what = cuda_reserve(mesh.shape, context=False)
    memory = planned_memory(cfg, model_cfg, mesh.size("dp"))
    usable = max(0.0, float(free[rank]) - reserve)
    if memory.total > usable:
        raise over_budget(memory, f"the {format_bytes(usable)} that rank {rank} can use "
                                  f"({format_bytes(float(free[rank]))} free on its GPU less {what})")


def over_budget(memory: MemoryBreakdown, budget: str) -> ConfigError:
    """The one-line refusal: the estimate, the budget it exceeds, and what to change."""
    return ConfigError(f"the planner's memory estimate for one process, {describe(memory)}, exceeds {budget}; "
                       f"choose a layout that fits (`paratrain plan`: more --zero, --tp or --pp, a smaller "
                       f"--micro-batch, --activation-checkpointing 1), raise --mem-budget, or pass --no-mem-check")


def cuda_reserve(shape: MeshShape, context: bool = True) -> tuple[float, str]:
    """(bytes, what they are) of a CUDA process's memory outside the plan: its context (`context`) and the buffers
    of the NCCL communicators of its process groups."""
    comms = shape.num_communicators()
    parts = [f"{format_bytes(CUDA_CONTEXT_BYTES)} for the CUDA context"] if context else []
    parts.append(f"{comms} NCCL communicator(s) × {format_bytes(NCCL_COMMUNICATOR_BYTES)}")
    return (CUDA_CONTEXT_BYTES if context else 0) + comms * NCCL_COMMUNICATOR_BYTES, " and ".join(parts)


def planned_memory(cfg: Config, model_cfg: ModelConfig, dp: int) -> MemoryBreakdown:
    """`estimate_memory` for the run's model, batch and layout (with --cp, each rank's s/cp tokens and its ring)."""
    p, t = cfg.parallel, cfg.train
    workload = Workload.for_model(model_cfg, seq_len=cfg.data.seq_len, global_batch=t.global_batch,
                                  precision=p.precision, reduce_dtype=p.reduce_dtype, loss_chunk=p.loss_chunk,
                                  **run_options(model_cfg, cfg.lora.rank, cfg.lora.base_dtype, cfg.lora.targets))
    recompute = Checkpointing.parse(p.activation_checkpointing).planned
    layout = Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, zero=p.zero, micro_batch=t.micro_batch,
                    virtual_stages=p.virtual_stages, sequence_parallel=p.sequence_parallel, recompute=recompute,
                    schedule=p.schedule, dp_shard=p.dp_shard, compile=p.compile,
                    ep=p.ep, offload=p.offload or None)
    return estimate_memory(workload, layout)


def memory_budget(text: str, local_processes: int, launcher: bool = False,
                  shape: MeshShape = MeshShape()) -> tuple[float, str] | None:
    """(bytes one process may use, where that number comes from); None when it is not known in this process.

    `shape`: the job's mesh, whose process groups each hold an NCCL communicator on CUDA.
    """
    from paratrain.plan.sizes import parse_bytes

    if text != "auto":
        return parse_bytes(text, "--mem-budget"), "--mem-budget"
    import torch

    if torch.cuda.is_available():
        if launcher:  # it would initialize CUDA in a process that runs no step: each worker checks its own device
            return None
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()  # as `default_device` picks it
        total = float(torch.cuda.get_device_properties(device).total_memory)
        reserve, what = cuda_reserve(shape)
        return max(0.0, total - reserve), f"--mem-budget auto: cuda:{device}'s {format_bytes(total)} less {what}"
    total = machine_memory()
    share = f" / {local_processes} local processes" if local_processes > 1 else ""
    return total / local_processes, f"--mem-budget auto: this machine's {format_bytes(total)}{share}"


def machine_memory() -> float:
    """Physical memory, or the cgroup's limit when it is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return float(total)


def describe(memory: MemoryBreakdown) -> str:
    """'1.2 GB (params 0.2 GB, grads ..., pipeline stage 0)': the total and its breakdown, one line."""
    parts = [("params", memory.params), ("grads", memory.grads),
             ("optimizer state", memory.optimizer_state), ("activations", memory.activations),
             ("communication buffers", memory.comm_buffers)]
    detail = ", ".join(f"{name} {format_bytes(value)}" for name, value in parts)
    if memory.master_weights:  # mixed precision: the fp32 master copy is part of the optimizer state
        detail += (f"; optimizer state = fp32 master {format_bytes(memory.master_weights)} + Adam moments "
                   f"{format_bytes(memory.adam_moments)}")
    return f"{format_bytes(memory.total)} ({detail}; pipeline stage {memory.stage})"


def format_bytes(value: float) -> str:
    """Bytes in decimal units, as `paratrain plan` prints them (GB = 10⁹ bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"
