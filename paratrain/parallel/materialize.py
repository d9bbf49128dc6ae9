"""Giving a meta-built model storage and values: `Initializer` (each parameter's value on this rank, through what
`parallelize` changed), and `to_empty` (storage without losing what the model already is: its computed buffers
and its ties)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn


class Initializer:
    """The value of each parameter a rank materializes, one object through every step of `parallelize`.

    `base(name, full_shape)` -> the full fp32 value of a parameter of the model as the user built it (the caller's
    `init`, else the model's own `param_init`, seed 0, once the model is on the meta device: `default_to`). A
    step that changes what a rank holds adds its view (`through`): `view(inner, name, shape)` -> the value of
    the parameter as that step left it, asking `inner` (the steps before it) for what it maps to. LoRA's adapters
    (`paratrain.parallel.lora.LoRAValues`), this rank's block of experts (`ExpertInfo.local_init`) and its
    tensor-parallel slice (`TensorParallelInfo.local_init`) are the views, in that order. `value(name, shape)`
    reads through them all. Without a base (a model given materialized) there is nothing to read: `given`.
    """

    def __init__(self, base: Callable | None = None):
        self.base = base
        self.views: list[Callable] = []

    @property
    def given(self) -> bool:
        return self.base is not None

    def default_to(self, model: nn.Module, default: Callable[[nn.Module], Callable]) -> None:
        """Without a base, `default(model)` for a model on the meta device (whose values must come from somewhere)."""
        if self.base is None and any(p.is_meta for p in model.parameters()):
            self.base = default(model)

    def through(self, view: Callable) -> None:
        """Read the values through `view` from now on (a step that changed the parameters; nothing without a base)."""
        if self.given:
            self.views.append(view)

    def value(self, name: str, shape) -> torch.Tensor:
        """The fp32 value of parameter `name`, of the `shape` this rank holds."""
        return self._read(len(self.views), name, shape)

    __call__ = value  # the `init(name, shape)` the engines and the materialization take

    def _read(self, depth: int, name: str, shape) -> torch.Tensor:
        if depth == 0:
            return self.base(name, shape)
        return self.views[depth - 1](functools.partial(self._read, depth - 1), name, shape)


@torch.no_grad()
def to_empty(model: nn.Module, device) -> None:
    """`model.to_empty(device=device)`, except that buffers already materialized keep their values (moved to
    `device`) and parameters shared by several modules stay shared.

    A model built on the meta device may compute its constant buffers on the host first (a transformers model's
    rotary frequencies, `paratrain.models.hf`) and tie its head to its embedding table: `nn.Module.to_empty` would
    leave the first uninitialized and give each name of a tied parameter its own storage.
    """
    kept = {name: b for name, b in model.named_buffers() if not b.is_meta}
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied[name] = first.setdefault(id(param), name)
    model.to_empty(device=device)
    for name, value in kept.items():
        owner, attr = _owner(model, name)
        owner._buffers[attr] = value.to(device)
    for alias, canonical in tied.items():
        if alias != canonical:
            owner, attr = _owner(model, alias)
            setattr(owner, attr, model.get_parameter(canonical))


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr
