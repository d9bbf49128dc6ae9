"""Giving a meta-built model storage without losing what it already is: its computed buffers and its ties."""

from __future__ import annotations

import torch
from torch import nn


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
