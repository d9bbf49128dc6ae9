"""The planner: memory, FLOPs, communication and step time of a layout, and the search over layouts.

    from paratrain.plan import Layout, Workload, estimate, get_hardware, search
    work = Workload.for_model(get_model_config("llama2-70b"), seq_len=4096, global_batch=1024)
    best = search(work, world_size=64, hardware=get_hardware("h100-80gb")).best

Pure arithmetic: no processes, no torch.distributed. `paratrain plan` is its command line.
"""

from paratrain.plan.collectives import Collective, comm_bytes_per_rank, ring_bytes
from paratrain.plan.compute import StepFlops, StepTime, step_flops, step_time
from paratrain.plan.hardware import (
    COLLECTIVE_KINDS,
    DEFAULT_PROFILE,
    HARDWARE_PRESETS,
    GemmCurve,
    Hardware,
    KernelStack,
    LinkCost,
    get_hardware,
    load_profile,
    save_profile,
)
from paratrain.plan.memory import (
    GB,
    Layout,
    LayoutError,
    MemoryBreakdown,
    PipelineBoundary,
    PlanError,
    Recompute,
    Workload,
    estimate_memory,
    in_flight_microbatches,
)
from paratrain.plan.activations import layer_activation_bytes
from paratrain.plan.model_states import ModelStates, gpt_num_params, model_state_bytes, stage_param_count
from paratrain.parallel.pipeline.schedules import ScheduleName
from paratrain.plan.search import (
    Estimate,
    SearchResult,
    SearchSpace,
    Violation,
    estimate,
    layout_violations,
    search,
    validate_layout,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "DEFAULT_PROFILE",
    "GB",
    "HARDWARE_PRESETS",
    "Collective",
    "Estimate",
    "GemmCurve",
    "Hardware",
    "KernelStack",
    "LinkCost",
    "Layout",
    "LayoutError",
    "MemoryBreakdown",
    "ModelStates",
    "PipelineBoundary",
    "PlanError",
    "Recompute",
    "ScheduleName",
    "SearchResult",
    "SearchSpace",
    "StepFlops",
    "StepTime",
    "Violation",
    "Workload",
    "comm_bytes_per_rank",
    "estimate",
    "estimate_memory",
    "get_hardware",
    "gpt_num_params",
    "in_flight_microbatches",
    "layer_activation_bytes",
    "layout_violations",
    "load_profile",
    "model_state_bytes",
    "ring_bytes",
    "save_profile",
    "search",
    "stage_param_count",
    "step_flops",
    "step_time",
    "validate_layout",
]
