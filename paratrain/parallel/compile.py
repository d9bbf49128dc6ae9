"""torch.compile per block, with paratrain's own machinery outside the compiled regions.

    model, optimizer = parallelize(model, mesh, optimizer=..., compile=True)

Each block of the model (`recompute.model_blocks`: what ZeRO-3 makes its units, the children of the
model's ModuleLists, ModuleDicts and Sequentials; a pipeline stage's own blocks, after tensor
parallelism has swapped in its layers) gets a compiled forward: `block.forward` becomes the
torch.compile'd `_run(forward, block, ...)`, not `block.compile()`, so that what hooks onto the block
stays outside the compiled region:

- the module's forward pre- and post-hooks (ZeRO-3's gather before the forward and free after it, a
  sequence-parallel input hook) run around the compiled call, as for an eager block;
- parameters are graph inputs: the gradients the compiled backward returns reach each parameter's
  accumulator outside the graph, where DDP's and ZeRO-1/2's post-accumulate-grad hooks fill their
  buckets, and under ZeRO-3 the gathered parameters the compiled forward saves for backward are
  packed by the engine's saved-tensor hooks (references into the unit's buffer, gathered again in
  backward);
- pipeline transfers happen between blocks, in the runner;
- tensor-parallel collectives inside a block are custom operators while it is traced
  (`paratrain.parallel.tensor.traced`), so the block stays one graph and each collective still goes
  through `Comm`.

Activation checkpointing puts the checkpoint inside the compiled function (`_run_checkpointed`): the
compiler traces it, with selective recomputation's policy, and its min-cut partitioner saves what the
policy keeps; the recompute is part of the compiled backward graph, which no hook enters. (A compiled
region inside an eager checkpoint would be one operator to selective checkpointing: kept or
recomputed whole.)

Shapes are static (`dynamic=False`): a block is compiled once for its input shapes and reused by every
block of its class (one graph for all of them: the module is an input of the graph, not a constant), so
nothing recompiles after the first step. An evaluation without gradients, or a new sequence length,
compiles once more. torch._dynamo keeps `recompile_limit` (8) graphs per function; beyond that a block
runs eagerly.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.comm import Comm
from paratrain.parallel.recompute import Checkpointing, chosen_blocks, context_fn, model_blocks
from paratrain.parallel.tensor import traced


def compile_blocks(model: nn.Module, comm: Comm, checkpointing: Checkpointing = Checkpointing(),
                   backend: str = "inductor") -> list[nn.Module]:
    """Compile the forward of each block of `model` (with `checkpointing`'s recomputation inside) with torch.compile's
    `backend`; return the blocks."""
    traced.register(comm)
    blocks = model_blocks(model)
    recomputed = {id(block) for block in chosen_blocks(checkpointing, blocks)}
    for block in blocks:
        forward, first = _unbound(block)
        if id(block) in recomputed:
            compiled = torch.compile(_run_checkpointed, backend=backend, dynamic=False)
            block.forward = functools.partial(compiled, forward, context_fn(checkpointing), *first)
        else:
            block.forward = functools.partial(torch.compile(_run, backend=backend, dynamic=False), forward, *first)
    return blocks


def _unbound(block: nn.Module):
    """(function, leading arguments) that call the block's forward: its class's function and the block itself,
    so that every block of a class runs one compiled function (the module is a graph input, not a constant)."""
    forward = block.forward
    if getattr(forward, "__self__", None) is block:
        return forward.__func__, (block,)
    return forward, ()


def _run(forward, *args, **kwargs):
    return forward(*args, **kwargs)


def _run_checkpointed(forward, context_fn, *args, **kwargs):
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
