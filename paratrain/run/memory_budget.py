"""Refuse to start a run whose planned memory per process exceeds the memory one process has.

The estimate is the planner's (`paratrain.plan.estimate_memory`, what `paratrain plan` prints
for this model and layout): model states, activations of the micro-batches in flight and
communication buffers of the worst pipeline stage. The budget is ``--mem-budget``: a size, or
'auto', the device's memory on CUDA and, on the CPU, this machine's memory (or its cgroup's
limit) shared by the local processes. A run over budget would only die later, one rank out of
memory in the middle of a step; refused now, the message gives the breakdown to act on, and
``--no-mem-check`` starts it anyway (the estimate leaves out the framework's own memory and
may err either way).
"""

from __future__ import annotations

import os
from pathlib import Path

from paratrain.config import Config, ConfigError
from paratrain.models import ModelConfig
from paratrain.plan import Layout, MemoryBreakdown, Recompute, Workload, estimate_memory

# cgroup v2, then v1: a container's limit is what the processes really have.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def check_memory_budget(cfg: Config, model_cfg: ModelConfig, dp: int) -> None:
    """ConfigError with the estimate's breakdown when it exceeds --mem-budget (nothing with --no-mem-check)."""
    from paratrain.distributed import detect_env

    env = detect_env()
    launcher = not env.distributed and (cfg.run.nproc > 1 or cfg.run.nnodes > 1)  # it starts the workers
    local_processes = cfg.run.nproc if launcher else env.local_world_size
    budget = memory_budget(cfg.run.mem_budget, local_processes, launcher)  # a bad --mem-budget is refused anyway
    if not cfg.run.mem_check or budget is None:
        return
    size, source = budget
    memory = planned_memory(cfg, model_cfg, dp)
    if memory.total > size:
        raise ConfigError(f"the planner's memory estimate for one process, {describe(memory)}, exceeds its budget of "
                          f"{format_bytes(size)} ({source}); choose a layout that fits (`paratrain plan`: more "
                          f"--zero, --tp or --pp, a smaller --micro-batch, --activation-checkpointing 1), raise "
                          f"--mem-budget, or pass --no-mem-check")


def planned_memory(cfg: Config, model_cfg: ModelConfig, dp: int) -> MemoryBreakdown:
    """`estimate_memory` for the run's model, batch and layout."""
    p, t = cfg.parallel, cfg.train
    workload = Workload.for_model(model_cfg, seq_len=cfg.data.seq_len, global_batch=t.global_batch,
                                  precision=p.precision, reduce_dtype=p.reduce_dtype)
    # Checkpointing every block is the planner's full recomputation; every k-th block (k > 1)
    # keeps most activations, so it is counted as none (an over-estimate, never an under-estimate).
    recompute = Recompute.FULL if p.activation_checkpointing == 1 else Recompute.NONE
    layout = Layout(dp=dp, tp=p.tp, pp=p.pp, zero=p.zero, micro_batch=t.micro_batch,
                    virtual_stages=p.virtual_stages, sequence_parallel=p.sequence_parallel, recompute=recompute,
                    schedule=p.schedule, dp_shard=p.dp_shard)
    return estimate_memory(workload, layout)


def memory_budget(text: str, local_processes: int, launcher: bool = False) -> tuple[float, str] | None:
    """(bytes one process may use, where that number comes from); None when it is not known in this process."""
    from paratrain.commands.plan import parse_bytes

    if text != "auto":
        return parse_bytes(text, "--mem-budget"), "--mem-budget"
    import torch

    if torch.cuda.is_available():
        if launcher:  # it would initialize CUDA in a process that runs no step: each worker checks its own device
            return None
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()  # as `default_device` picks it
        return float(torch.cuda.get_device_properties(device).total_memory), f"--mem-budget auto: cuda:{device}"
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
