"""A parallel model's whole parameters, whatever its layout: their whole shapes, and each one made whole in turn
(gathered over tp, ep and ZeRO-3's dp, broadcast over pp), for checkpoints, export and tests.

`ParallelModel.full_shapes` and `ParallelModel.full_parameters` answer with these.
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch

from paratrain.parallel.expert.sharding import whole_expert


def full_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every parameter's whole shape, by name, in the order `full_parameters` yields them (no communication)."""
    if model.pipeline is not None:
        return {name: tuple(shape) for name, shape in model.pipeline.split.param_shapes.items()}
    shapes = {name: tuple(shape) for name, _, shape in model.engine.master_rows()}
    if model.tp_info is not None:
        shapes = {name: model.tp_info.global_shape(name, shape)[0] for name, shape in shapes.items()}
    if model.expert_info is not None:
        shapes = {name: model.expert_info.global_shape(name, shape)[0] for name, shape in shapes.items()}
    return shapes


def full_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the whole model, whole, one at a time, on every rank (collective: every rank
    iterates to the end, in the same order).

    Only the tensor yielded last exists whole beyond this rank's own shards (ZeRO-3 gathers it over
    dp, tensor parallelism over tp, its pipeline stage broadcasts it over pp): write each out and drop
    it, and the whole model is never on one rank.
    """
    if model.offload is not None:  # (the host step done, the parameters up to date)
        model.offload.settle(bring=True)
    whole = (lambda name, value: value) if model.tp_info is None else model.tp_info.gather
    if model.expert_info is not None:  # expert tensors are whole over tp: gathered over ep only
        whole = functools.partial(whole_expert, model.expert_info, whole)
    if model.pipeline is None:
        for name, value in model.engine.full_parameters():
            yield name, whole(name, value)
    else:  # ZeRO-3 never runs under pp: this stage's parameters are its own tensors, not copies
        yield from model.pipeline.stage_parameters(dict(model.engine.full_parameters()), whole)


def frozen_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Every frozen parameter (`requires_grad=False`: a LoRA base) of this rank's part of the model, whole, in its
    stored dtype, by the module's names, in the module's order (collective under ZeRO-3, which gathers each in
    turn over the data ranks, and under tensor parallelism, which gathers a split one over tp: an NF4 base split by
    input columns arrives as its rows [out, in / 64, 33], the same bytes as one process's [blocks, 33])."""
    whole = (lambda name, value: value) if model.tp_info is None else model.tp_info.gather
    if model.engine.params_sharded and model.pipeline is None:
        named = model.engine.frozen_parameters()
    else:
        named = ((name, param.detach()) for name, param in model.module.named_parameters() if not param.requires_grad)
    for name, value in named:
        yield name, whole(name, value)
