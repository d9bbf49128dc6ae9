"""Newer torch APIs, feature-detected; every private torch API paratrain uses, each behind one small function.

paratrain supports torch 2.11 and newer (``MIN_TORCH``; pyproject and the README say the same). Two
kinds of torch API live here and nowhere else:

* APIs that appeared or changed after 2.11: each function asks the installed torch whether it
  has the newer form and falls back to the older one, so the same code runs on every supported
  release (GPU images often ship an older torch than the newest).
* Private APIs (underscored modules and functions): torch may rename or drop them in any release,
  so each has one home here, with a comment saying why paratrain needs it, and a test
  (tests/meta/test_compat.py) that fails the day the installed torch no longer has it.

torch's ``_foreach_*`` operators are not here: they are ATen operators in torch's own namespace
(torch.optim's foreach path), not internals of a Python module.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.utils import _foreach_utils, _python_dispatch, _pytree

MIN_TORCH = (2, 11)

# -- collectives --------------------------------------------------------------------------------------

# torch 2.13 renamed the flat-tensor collectives (reduce_scatter_tensor -> reduce_scatter_single,
# all_gather_into_tensor -> all_gather_single); older releases have only the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def default_store() -> dist.Store:
    """The key-value store the default process group was created on (private `_get_default_store`)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


# -- the elastic launcher -----------------------------------------------------------------------------

# LaunchConfig fields newer than torch 2.11, which an older LaunchConfig does not take: without them the
# agent keeps its own default (shutdown_timeout: 30 s between SIGTERM and SIGKILL in 2.11 as in 2.13).
NEWER_LAUNCH_FIELDS = frozenset({"shutdown_timeout"})


def elastic_launch_config(**fields):
    """torch's elastic `LaunchConfig` with `fields`, leaving out the newer ones this torch's LaunchConfig lacks.

    Any other field it lacks is a TypeError, as LaunchConfig's own: a misspelt field is not dropped.
    """
    from torch.distributed.launcher import api  # looked up at call time: the class of the installed torch

    accepted = {f.name for f in dataclasses.fields(api.LaunchConfig)}
    return api.LaunchConfig(**{k: v for k, v in fields.items() if k in accepted or k not in NEWER_LAUNCH_FIELDS})



def name_rendezvous_events_by_frame() -> None:
    """Name the elastic rendezvous' events from the caller's frame instead of `inspect.stack()`.

    torch's `dynamic_rendezvous.get_method_name` builds the whole stack twice per event (every frame's source
    lines, every loaded module searched for its file: 0.1 to 0.3 s of one core each with torch imported) to name
    an event that reaches no log unless a rendezvous event handler is set. Nine events come before the first
    worker starts, more at every restart: seconds of the launcher's core on the way to each launch. The same
    name, from the frame alone.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    """What `dynamic_rendezvous.get_method_name(depth)` returns: the name of the function `depth` frames up."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # fewer frames than that
        return "no_method_name"

# -- autograd -----------------------------------------------------------------------------------------

def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward now (private `_current_graph_task_id`: -1 outside)."""
    return torch._C._current_graph_task_id() != -1


def backward_pass_id() -> int:
    """An id of the backward pass this thread runs now, -1 outside one (to act once per backward)."""
    return torch._C._current_graph_task_id()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` once the current backward pass has finished (autograd's private engine queue; torch's
    DDP does the same), inside backward only."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def held_alone(tensor: torch.Tensor) -> bool:
    """Whether nothing but the caller references `tensor` and no other tensor shares its storage: what autograd
    checks before accumulating into a gradient in place (private use counts of the tensor and its storage).
    Meant for a gradient inside a custom Function's backward, whose sole count depends on the torch release."""
    return tensor._use_count() == _sole_gradient_use_count() and storage_alone(tensor)


def storage_alone(tensor: torch.Tensor) -> bool:
    """Whether no other tensor shares `tensor`'s storage (no view of it, no alias a cache keeps; private use count
    of the storage)."""
    # The count includes the reference that untyped_storage() itself makes to answer.
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) == 2


@functools.cache
def _sole_gradient_use_count() -> int:
    """The use count of a gradient that nothing else holds, as a custom Function's backward sees it: 1 on
    torch 2.13, 2 on 2.11, whose engine keeps one more reference while the backward runs. Measured once, on a
    fresh product's gradient, so that a shared gradient (one more holder) never counts as alone.

    Measured at the first use, never on import: the first backward of a process starts autograd's device
    threads, which on a CUDA build counts the GPUs through the driver (cuInit), and a process that did that
    cannot fork a worker that uses CUDA ("CUDA error: initialization error"). The worker server imports this
    module and forks every worker."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad._use_count())
            return grad

    with torch.enable_grad():
        x = torch.zeros(2, device="cpu", requires_grad=True)
        (Probe.apply(x * 1.0) * 2.0).sum().backward()
    return seen[0]



# -- grouped GEMM ------------------------------------------------------------------------------------

_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    """Rows offsets[g-1]:offsets[g] of `x` [A, D] times `w[g]` [D, F], one kernel for all groups (private
    `torch._grouped_mm`, the grouped GEMM of torch's own MoE layers); None where this torch lacks it or refuses
    these tensors (its kernels want 16-byte aligned rows and, per device, some dtypes only), and the caller
    loops over the groups instead. Whether a (device, dtype) works is probed once, forward and backward."""
    if not hasattr(torch, "_grouped_mm") or (x.shape[-1] * x.element_size()) % 16 \
            or (w.shape[-1] * w.element_size()) % 16 or x.dtype != w.dtype:
        return None
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_MM_WORKS:
        _GROUPED_MM_WORKS[key] = _grouped_mm_probe(x.device, x.dtype)
    return torch._grouped_mm(x, w, offs=offsets) if _GROUPED_MM_WORKS[key] else None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _grouped_mm_probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward on `device` in `dtype` (one group empty).

    Run apart from what surrounds the first call (private `_disable_current_modes`): that call is inside a
    model's forward, where activation checkpointing's saved-tensor hooks and its selective-recompute mode
    would record the probe's tensors and operators in the forward but not in the recompute (which finds the
    answer cached), and fail on the mismatch or, worse, replay saved outputs at the wrong positions."""
    try:
        with _python_dispatch._disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(_same, _same), \
                torch.enable_grad():
            x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(3, 16, 8, device=device, dtype=dtype).transpose(-2, -1).requires_grad_()
            offsets = torch.tensor([2, 2, 4], device=device, dtype=torch.int32)
            torch._grouped_mm(x, w, offs=offsets).backward(torch.ones(4, 16, device=device, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        return False


# -- dispatch modes and pytrees (torch.utils' private modules, the documented way to write a mode) -------

TorchDispatchMode = _python_dispatch.TorchDispatchMode


class ObservingMode(TorchDispatchMode):
    """A dispatch mode that watches the operators a model runs, compiled blocks included: it stays entered while
    torch.compile'd code runs and sees that code's operators (higher-order ones too, such as a recompute's RNG
    state), and not the compiler's own tracing (`ignore_compile_internals`; a torch without it traces the
    mode's dispatch as any other Python)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def is_wrapper_subclass_type(cls: type) -> bool:
    """Whether `cls` is a traceable tensor wrapper subclass (a DTensor): its dispatch runs the inner tensors'."""
    return _python_dispatch.is_traceable_wrapper_subclass_type(cls)


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors a wrapper subclass (a DTensor) holds, or None for a plain tensor."""
    if not _python_dispatch.is_traceable_wrapper_subclass(tensor):
        return None
    names, _ = tensor.__tensor_flatten__()
    return [getattr(tensor, name) for name in names]


def tree_leaves(tree: Any) -> list:
    """The leaves of a nest of lists, tuples and dicts, as torch's dispatch sees an operator's arguments."""
    return _pytree.tree_leaves(tree)


# -- torch.compile ------------------------------------------------------------------------------------

def compiled_module_namespaces() -> list[dict]:
    """The globals of every Python module torch.compile's inductor has generated and loaded in this process
    (private `torch._inductor.codecache.PyCodeCache`), none when inductor was never imported: TensorMemory
    follows the allocation functions there, since a compiled kernel's output buffer is no operator's."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None:
        return []
    cache = codecache.PyCodeCache
    modules = list(getattr(cache, "modules", [])) + list(getattr(cache, "modules_no_attr", {}).values())
    return list({id(m): vars(m) for m in modules}.values())


# -- optimizers ---------------------------------------------------------------------------------------

def fused_optimizer_devices() -> Iterable[str]:
    """The device types torch has fused optimizer kernels for (the set torch.optim checks `fused=True` against)."""
    return _foreach_utils._get_fused_kernels_supported_devices()


def has_init_group(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` has torch's private `_init_group`: the lazy state initialization of Adam and AdamW
    (moments, step counts) that also gathers the lists their functional kernel takes. The offloaded host step
    calls it so the state it creates is the state `optimizer.step()` would have created."""
    return hasattr(optimizer, "_init_group")


def init_group(optimizer: torch.optim.Optimizer, group: dict, *lists: list) -> bool:
    """`optimizer._init_group(group, *lists)`: fills `lists` (parameters, gradients, moments, ..., step counts)
    for one parameter group, creating missing state as torch's own step does; returns whether any is complex."""
    return optimizer._init_group(group, *lists)


def steps_with_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` reads torch's private `grad_scale` and `found_inf` (the flag fused Adam and
    AdamW set, `_step_supports_amp_scaling`): they then divide each gradient by the scale as they read it."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# -- FP8 matmuls ----------------------------------------------------------------------------------------

def has_scaled_mm() -> bool:
    """Whether this torch has `torch._scaled_mm` (private: the FP8 GEMM torchao's Float8Linear calls too)."""
    return hasattr(torch, "_scaled_mm")


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """`torch._scaled_mm`: a · b of FP8 operands (a row-major, b column-major), each multiplied back by its
    dequantizing scale (per tensor, or per row of a / column of b), the result in `out_dtype`."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


# -- CUDA memory history -------------------------------------------------------------------------------

def record_memory_history(max_entries: int | None) -> None:
    """Start (a number of entries) or stop (None) recording CUDA allocations with their stacks: torch's private
    `torch.cuda.memory._record_memory_history`, the recorder behind PyTorch's memory visualizer."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded allocations as the visualizer's snapshot file (`torch.cuda.memory._dump_snapshot`)."""
    torch.cuda.memory._dump_snapshot(path)


# -- the flight recorder ------------------------------------------------------------------------------

def flight_record_json() -> bytes:
    """This process's flight record now, as JSON (torch's private dump, named `_dump_nccl_trace_json` before
    the flight recorder served other backends than NCCL and `_dump_fr_trace_json` since)."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace_json", None) or c10d._dump_nccl_trace_json
    return dump(True, False)  # with collectives, without only-active filtering


# -- Muon -----------------------------------------------------------------------------------------------

def muon_class():
    """`torch.optim.Muon` (torch 2.9 and newer), or None where the installed torch has none."""
    return getattr(torch.optim, "Muon", None)


def muon_orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                       eps: float) -> torch.Tensor:
    """Newton–Schulz orthogonalization of one whole 2-D update, as `torch.optim.Muon` computes it (private
    `torch.optim._muon._zeropower_via_newtonschulz`): paratrain runs torch's own iteration on the matrices it
    gathers, so that a distributed step equals the one-process one to the bit (bf16 iterations included)."""
    from torch.optim import _muon

    return _muon._zeropower_via_newtonschulz(update, coefficients, steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate `torch.optim.Muon` applies to a matrix of `shape` (private `torch.optim._muon._adjust_lr`)."""
    from torch.optim import _muon

    return _muon._adjust_lr(lr, adjust_lr_fn, shape)
