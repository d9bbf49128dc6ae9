"""Activation recomputation: which blocks recompute in backward what they would otherwise keep, and what they keep.

    parallelize(model, mesh, activation_checkpointing="selective")   # or "full", k (every k-th block), "none"

The blocks are those of `paratrain.parallel.blocks.unit_modules(model, "blocks")` (the children of the
model's ModuleLists, ModuleDicts and Sequentials: the reference model's ``layers``, a Hugging Face model's
decoder layers, the layers of a plain Sequential), the same blocks ZeRO-3 shards and `compile.py` compiles.

- full (``"full"``, or an integer k: every k-th block): the block keeps its inputs; backward runs its whole
  forward again.
- selective: every block keeps the outputs of its matmuls and of its attention kernel (`SAVED_OPS`:
  aten.mm, addmm, bmm, the scaled-dot-product-attention kernels) and recomputes everything else: norms,
  rotary embeddings, activation functions, residual adds, casts. Per layer of the reference model that
  keeps the block input, q, k, v, the attention output and its log-sum-exp, and the outputs of wo, w1, w3
  and w2 (`paratrain.plan.memory.layer_activation_bytes` counts exactly these); no matmul runs twice.
  Under tensor parallelism the row layers' (wo, w2) outputs are kept as their partial sums, whole
  b·s·h tensors, and their reduction runs again in the recompute.

Both go through `torch.utils.checkpoint` (non-reentrant); selective through its selective-checkpoint
contexts (`create_selective_checkpoint_contexts` with `CheckpointPolicy.MUST_SAVE` for `SAVED_OPS`,
`PREFER_RECOMPUTE` for the rest). Under context parallelism the recompute runs under the ring the forward
ran under (`eager_context_fn`): its attention is ring attention again, whose K/V travel around the cp
ranks a second time (the full recompute reruns the ring's forward; selective keeps its matmuls' outputs
but still re-sends the K/V blocks, as SAVED_OPS holds no communication).

Where the checkpoint sits: inside the block's forward, below the module's hooks (ZeRO-3's gather and free,
a sequence-parallel input hook), which run once per forward and never in a recompute. The checkpointed
function takes the block's parameters as explicit inputs, so that checkpoint saves them with its inputs
through the saved-tensor hooks in force around it: under ZeRO-3 those pack a gathered parameter as a
reference into its unit's buffer (freed after the forward) and gather the unit again when the recompute
unpacks it (`paratrain.parallel.data.zero3`), with the next unit prefetched as for any backward. The
recompute therefore runs exactly the operators the forward ran, nothing of the engine's, which selective
checkpointing requires (it replays the forward's operators by position). Compiled blocks (`compile.py`)
put the same checkpoint inside the compiled function instead: the recompute is then part of the compiled
backward graph, which reads the parameters the compiled forward saved, through the same hooks.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from paratrain.parallel.blocks import unit_modules
# The modes and their parsing are torch-free and live with the other layout enumerations (the planner reads them).
from paratrain.parallel.rules import Checkpointing, Recompute


def _aten_ops(*names: str) -> frozenset:
    """The default overloads of the named aten operators this torch has (SDPA's kernels vary by release)."""
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


# What selective recomputation keeps: the outputs of matmuls and of attention kernels (every one of a
# kernel's outputs: the attention output and its log-sum-exp, which its backward reads).
SAVED_OPS = _aten_ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
                      "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                      "_efficient_attention_forward")


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep what `SAVED_OPS` computes; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


selective_contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)


def context_fn(setting: Checkpointing):
    """checkpoint's `context_fn`: the selective contexts, or None for full recomputation."""
    return selective_contexts if setting.mode is Recompute.SELECTIVE else None


def eager_context_fn(setting: Checkpointing):
    """checkpoint's `context_fn` for an eager block: `context_fn`'s, with the recompute run under the
    context-parallel ring its forward ran under (`paratrain.parallel.context.sdpa.recompute_context`)."""
    return functools.partial(_recompute_as_forward, context_fn(setting))


def _recompute_as_forward(inner):
    from paratrain.parallel.context.sdpa import recompute_context

    forward, recompute = inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    return forward, _together(recompute, recompute_context())


class _together:
    """Contexts entered as one, as often as needed: a recompute may run twice (ZB-H1's W after its B)."""

    def __init__(self, *contexts):
        self.contexts, self.stacks = contexts, []

    def __enter__(self):
        stack = contextlib.ExitStack()
        for context in self.contexts:
            stack.enter_context(context)
        self.stacks.append(stack)

    def __exit__(self, *exc):
        return self.stacks.pop().__exit__(*exc)


def chosen_blocks(setting: Checkpointing, blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks that recompute."""
    return [] if not setting.enabled else blocks if setting.mode is Recompute.SELECTIVE else blocks[::setting.every]


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model, as ZeRO-3 finds its units (`unit_modules(model, "blocks")`)."""
    return [module for _, module in unit_modules(model, "blocks")]


def checkpoint_blocks(model: nn.Module, every: int | str | Checkpointing = 1) -> int:
    """Make the chosen blocks recompute their activations in backward (eager blocks); return how many.

    `every`: a `Checkpointing`, or what `Checkpointing.parse` reads (an integer k: every k-th block,
    fully). Each chosen block's forward becomes `checkpointed_forward`; its class, its parameter names
    and its hooks stay as they are.
    """
    setting = Checkpointing.parse(every)
    chosen = chosen_blocks(setting, model_blocks(model))
    for block in chosen:
        block.forward = functools.partial(checkpointed_forward, block.forward, parameter_slots(block),
                                          eager_context_fn(setting))
    return len(chosen)


def parameter_slots(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute) of `block` that holds a parameter."""
    return [(module, name) for module in block.modules() for name, p in module._parameters.items() if p is not None]


def checkpointed_forward(forward, slots: list[tuple[nn.Module, str]], context_fn, *args, **kwargs):
    """`forward(*args, **kwargs)` under a non-reentrant checkpoint that takes the block's parameters as inputs.

    Runs at the place of the block's forward, after its forward pre-hooks: the parameter `slots` hold
    what those installed (ZeRO-3: full parameters gathered for this forward), and a linear that ZeRO-3
    gathered as its FP8 cast holds that cast (`Float8Linear.fp8_gathered`). Passed to checkpoint, they are
    saved as its inputs; the recompute puts what it unpacks back where they were while it runs.
    """
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    params = [module._parameters[name] for module, name in slots]
    cast_modules = [m for m in dict.fromkeys(m for m, _ in slots) if getattr(m, "fp8_gathered", None) is not None]
    casts = [t for m in cast_modules for t in m.fp8_gathered]
    options = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(_with_parameters, forward, slots, cast_modules, len(params), *params, *casts, *args,
                      use_reentrant=False, **options, **kwargs)


def _with_parameters(forward, slots, cast_modules, count: int, *tensors_and_args, **kwargs):
    params, args = tensors_and_args[:count], tensors_and_args[count + 2 * len(cast_modules):]
    casts = tensors_and_args[count:count + 2 * len(cast_modules)]
    current = [module._parameters[name] for module, name in slots]
    if all(p is q for p, q in zip(params, current)):  # the forward itself: the slots hold them already
        return forward(*args, **kwargs)
    current_casts = [m.fp8_gathered for m in cast_modules]
    try:
        for (module, name), p in zip(slots, params):
            module._parameters[name] = p
        for i, module in enumerate(cast_modules):
            module.fp8_gathered = (casts[2 * i], casts[2 * i + 1])
        return forward(*args, **kwargs)
    finally:
        for (module, name), p in zip(slots, current):
            module._parameters[name] = p
        for module, cast in zip(cast_modules, current_casts):
            module.fp8_gathered = cast
