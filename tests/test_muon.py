"""Muon on every layout against torch.optim.Muon (the blocks' matrices) + torch.optim.AdamW (the rest) in one process."""

from __future__ import annotations

import functools

import pytest
import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import DataParallel, PipelineParallel, TensorParallel, parallelize
from paratrain.parallel.muon import MuonRecipe
from paratrain.testing import run_on_ranks
from parallel_cases import TINY, batches, loss_sum, make_model, parallel_run

STEPS = 4
MUON = {"lr": 0.02, "weight_decay": 0.1}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def recipe() -> MuonRecipe:
    return MuonRecipe(muon=dict(MUON), adamw=dict(ADAMW))


def reference_optimizers(model, blocks=("layers.",)):
    """torch's own: Muon over the blocks' matrices, AdamW over the rest (vectors without weight decay)."""
    named = list(model.named_parameters())
    matrix = lambda n, p: n.startswith(blocks) and p.dim() == 2  # noqa: E731
    muon = torch.optim.Muon([p for n, p in named if matrix(n, p)], **MUON)
    adamw = torch.optim.AdamW([{"params": [p for n, p in named if not matrix(n, p) and p.dim() >= 2]},
                               {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}], **ADAMW)
    return muon, adamw


def reference_run(model, data, clip=1.0, blocks=("layers.",)):
    muon, adamw = reference_optimizers(model, blocks)
    losses = []
    for x, y in data:
        tokens = (y != -100).sum()
        loss = loss_sum(model, x, y) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        adamw.step()
        muon.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _dense_run(rank, world, shape: dict, zero: int, tensor=None, pipeline=None, model_fn=make_model, steps=None):
    mesh = build_mesh(MeshShape(**shape))
    model, optimizer = parallelize(model_fn(), mesh, optimizer=recipe(), tensor=tensor, pipeline=pipeline,
                                   data=DataParallel(zero=zero, grad_reduction="sum"))
    comm = model.comm
    losses = parallel_run(model, optimizer, batches(steps=steps or STEPS), mesh.coord("dp"), mesh.size("dp"),
                          lambda t: comm.all_reduce(t, "dp"))
    return losses, {k: v.float() for k, v in model.full_state_dict().items()}, optimizer.ns_flops, comm.bytes_by_axis()
