"""Splitting a model into pipeline stages: which layers each stage holds, and this rank's part.

With `pp` ranks and `v` virtual stages per rank the model is cut into S = pp·v stages of
consecutive layers, balanced by parameter count (or by given per-layer costs, or at given
boundaries); stage s lives on rank s % pp (Megatron's interleaving). A rank keeps only its
stages: the model is pruned (on the meta device, before anything is allocated) to the layers,
and on the first and last stage the embedding and the head, that it owns. Parameter names stay
those of the whole model (`layers.5.attention.wq.weight` on the stage that holds block 5), so a
tensor-parallel plan, the data-parallel engine and checkpoints see ordinary names. Each stage
runs through a "shell": a light module sharing the rank's blocks that computes only that stage.

Two kinds of model split: an `nn.Sequential` (by its children), and a `LayeredModel`, one that keeps
its blocks in a ModuleDict and names it and the modules before and after them, each by its path in the
model (the reference `Transformer` is one; transformers' models laid out by `paratrain.interop.hf_stages`,
whose paths are `model.layers`, `model.embed_tokens`, … as their parameter names are). Nothing here knows a
model class: the split reads only that structure.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis

LAYERED, SEQUENTIAL = "layered", "sequential"  # the two kinds of model a pipeline splits


class PipelineError(ParatrainError, ValueError):
    """A model or layout the pipeline cannot split; the message names the rule and the fix."""


@runtime_checkable
class LayeredModel(Protocol):
    """A model split by its own layers: `pipeline_layers`, the path of a ModuleDict of the blocks "0".."n-1" run in
    order between the modules at the paths `pipeline_first` (the first stage keeps them: the embedding) and
    `pipeline_last` (the last stage keeps them: final norm, head); a path is dotted as a parameter name
    (`layers`, or `model.layers` in a module `model`). A stage without them holds None there, so its forward must
    take or return hidden states where they are missing (the reference `Transformer.forward` does)."""

    pipeline_layers: str
    pipeline_first: tuple[str, ...]
    pipeline_last: tuple[str, ...]


def _layers(model: nn.Module) -> nn.ModuleDict:
    return model.get_submodule(model.pipeline_layers)


def _at(model: nn.Module, path: str) -> nn.Module | None:
    parent, _, name = path.rpartition(".")
    return getattr(model.get_submodule(parent) if parent else model, name)


def _set(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def balanced_boundaries(costs: list[float], num_stages: int, first_extra: float = 0.0,
                        last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous layer ranges [a, b), one per stage, minimizing the largest stage cost.

    `first_extra` / `last_extra` are the costs the first / last stage carry besides layers
    (embedding; norm and head). Every stage gets at least one layer.
    """
    n = len(costs)
    if num_stages > n:
        raise PipelineError(f"{num_stages} pipeline stages (pp × virtual stages) but only {n} layers; "
                            f"use at most {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @functools.lru_cache(maxsize=None)
    def best(stage: int, start: int) -> tuple[float, tuple[int, ...]]:
        """(largest cost, cut points) of stages stage.. over layers start..n."""
        remaining = num_stages - stage
        if remaining == 1:
            return prefix[n] - prefix[start] + last_extra + (first_extra if stage == 0 else 0.0), ()
        options = []
        for end in range(start + 1, n - remaining + 2):
            cost = prefix[end] - prefix[start] + (first_extra if stage == 0 else 0.0)
            rest, cuts = best(stage + 1, end)
            options.append((max(cost, rest), (end, *cuts)))
        return min(options)

    cuts = (0, *best(0, 0)[1], n)
    return [(cuts[i], cuts[i + 1]) for i in range(num_stages)]


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


@dataclass
class StageSplit:
    """Which layers each global stage holds, and this rank's pruned module with one shell per stage.

    `module` holds every parameter of this rank's stages under their whole-model names; a
    shell is a lightweight module sharing `module`'s submodules that computes one stage.
    """

    kind: str  # LAYERED or SEQUENTIAL
    ranges: list[tuple[int, int]]
    stages: tuple[int, ...]  # this rank's global stages, in chunk order
    module: nn.Module
    param_owner: dict[str, int]  # every trainable parameter name of the whole model → the stage holding it
    param_shapes: dict[str, torch.Size]
    # A parameter that stages on every pipeline rank use (a head tied to the embedding: Megatron's "embedding
    # group"): its name on this rank → its name in the whole model. Each rank holds a copy, initialized and loaded
    # alike under the whole model's name; their gradients are summed over pp before the norm and the step
    # (`ParallelModel.finish_gradients`), the norm and a checkpoint count the copy of pp rank 0 alone.
    shared: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    def shell(self, stage: int) -> nn.Module:
        """A module computing global stage `stage` (build after any module replacement, e.g. a TP plan)."""
        first, last = stage == 0, stage == self.num_stages - 1
        keys = [str(i) for i in range(*self.ranges[stage])]
        if self.kind == SEQUENTIAL:
            return nn.Sequential(OrderedDict((k, self.module._modules[k]) for k in keys))
        model = self.module
        kept = {model.pipeline_layers: nn.ModuleDict({k: _layers(model)[k] for k in keys})}
        kept.update({path: _at(model, path) if first else None for path in model.pipeline_first})
        kept.update({path: _at(model, path) if last else None for path in model.pipeline_last})
        return _shell_of(model, kept)


def _shell_of(module: nn.Module, kept: dict[str, nn.Module | None]) -> nn.Module:
    """A light copy of `module` sharing its submodules, but the ones at the paths of `kept` (relative to `module`)
    replaced by kept's (a module on the way to one is itself a light copy): what one stage computes with."""
    shell = type(module).__new__(type(module))
    nn.Module.__init__(shell)
    for key, value in vars(module).items():  # what its forward reads besides modules (the reference model's config)
        if not key.startswith("_") and key != "training":
            shell.__dict__[key] = value  # as the module holds it: a module kept there is no child
    for name, child in module._modules.items():
        below = {path[len(name) + 1:]: m for path, m in kept.items() if path.startswith(name + ".")}
        shell._modules[name] = kept[name] if name in kept else _shell_of(child, below) if below else child
    return shell


def split_for_pipeline(model: nn.Module, pp: int, rank: int, virtual_stages: int = 1,
                       boundaries: list[int] | None = None, layer_costs: list[float] | None = None) -> StageSplit:
    """Prune `model` (in place; meta or materialized) to the stages that pipeline rank `rank` holds.

    Stages are balanced by parameter count unless `layer_costs` (e.g. measured per-layer times)
    or explicit `boundaries` (the first layer of each stage after the first) are given.
    """
    kind = _model_kind(model)
    layers = list(_layers(model).values()) if kind == LAYERED else list(model)
    num_stages = pp * virtual_stages
    ranges = _stage_ranges(model, kind, layers, num_stages, boundaries, layer_costs)
    # the parameters that train (a frozen one, as LoRA's base, is no master, checkpoint or export tensor)
    names = {name: p for name, p in model.named_parameters() if p.requires_grad}
    owner = {name: _owning_stage(name, model, kind, ranges) for name in names}
    stages = tuple(s for s in range(num_stages) if s % pp == rank)
    shared = _shared_across_ranks(model, kind, ranges, pp, stages)
    keep = {str(i) for s in stages for i in range(*ranges[s])}
    if kind == LAYERED:
        for key in [k for k in _layers(model) if k not in keep]:
            del _layers(model)[key]
        for path in model.pipeline_first if 0 not in stages else ():
            _set(model, path, None)
        for path in model.pipeline_last if num_stages - 1 not in stages else ():
            _set(model, path, None)
    else:
        for key in [k for k in model._modules if k not in keep]:
            del model._modules[key]
    return StageSplit(kind, ranges, stages, model, owner, {n: p.shape for n, p in names.items()}, shared)


def sequence_parallel_boundaries(split: StageSplit, comm, axis: Axis = Axis.TP) -> list:
    """Under sequence parallelism, make every stage boundary carry the whole sequence.

    Inside a stage the residual stream is split along the sequence over tp. The last block of a
    stage before the last all-gathers its output (backward: keeps this rank's chunk of the
    gradient), and the first block of a stage after the first takes its chunk of the whole
    sequence it received (backward: all-gathers the gradient). A stage's input then has the
    model's full length, which the reference model sizes its rotary tables from; the point-to-
    point bytes are those of plain pipelining. Returns the hook handles.
    """
    from paratrain.parallel.tensor.primitives import gather_from_tp, scatter_to_tp

    if split.kind != LAYERED:
        raise PipelineError("sequence parallelism with pipeline stages needs a model with a ModuleDict of layers "
                            "(paratrain.parallel.pipeline.stages.LayeredModel: paratrain's Transformer is one)")
    handles = []
    for stage in split.stages:
        first, last = split.ranges[stage][0], split.ranges[stage][1] - 1
        if stage > 0:
            hook = functools.partial(_first_input_to_shard, comm, axis, scatter_to_tp)
            handles.append(_layers(split.module)[str(first)].register_forward_pre_hook(hook))
        if stage < split.num_stages - 1:
            hook = functools.partial(_output_to_whole, comm, axis, gather_from_tp)
            handles.append(_layers(split.module)[str(last)].register_forward_hook(hook))
    return handles


def _first_input_to_shard(comm, axis, scatter, module, args):
    return (scatter(args[0], comm, axis, dim=1), *args[1:])


def _output_to_whole(comm, axis, gather, module, args, output):
    return gather(output, comm, axis, dim=1)


def _model_kind(model: nn.Module) -> str:
    if isinstance(model, LayeredModel):
        return LAYERED
    if isinstance(model, nn.Sequential):
        if [str(i) for i in range(len(model))] != list(model._modules):
            raise PipelineError("pipeline parallelism needs an nn.Sequential with its default child names 0..n-1")
        return SEQUENTIAL
    raise PipelineError(f"pipeline parallelism splits paratrain's Transformer (a LayeredModel) or an nn.Sequential, "
                        f"not {type(model).__name__}; express the model as an nn.Sequential of its layers")


def _stage_ranges(model, kind, layers, num_stages, boundaries, layer_costs) -> list[tuple[int, int]]:
    n = len(layers)
    if boundaries is not None:
        cuts = [0, *boundaries, n]
        if len(cuts) != num_stages + 1 or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise PipelineError(f"stage boundaries {list(boundaries)} must be {num_stages - 1} increasing layer "
                                f"indices strictly inside 0..{n}")
        return [(cuts[i], cuts[i + 1]) for i in range(num_stages)]
    if layer_costs is not None and len(layer_costs) != n:
        raise PipelineError(f"{len(layer_costs)} layer costs given for {n} layers")
    costs = layer_costs or [_numel(layer) for layer in layers]
    first = last = 0.0
    if kind == LAYERED and layer_costs is None:
        first = sum(_numel(_at(model, path)) for path in model.pipeline_first)
        last = sum(_numel(_at(model, path)) for path in model.pipeline_last)
    return balanced_boundaries(costs, num_stages, first, last)


def _owning_stage(name: str, model: nn.Module, kind: str, ranges: list[tuple[int, int]]) -> int:
    """The stage holding parameter `name`: its layer's; outside the layers of a LayeredModel, the first stage
    for its `pipeline_first` modules and the last for the others."""
    if kind == LAYERED:
        layers = model.pipeline_layers + "."
        if not name.startswith(layers):
            return 0 if any(name.startswith(path + ".") for path in model.pipeline_first) else len(ranges) - 1
        index = int(name[len(layers):].split(".")[0])
    else:
        index = int(name.split(".")[0])
    return next(s for s, (a, b) in enumerate(ranges) if a <= index < b)


def _shared_across_ranks(model: nn.Module, kind: str, ranges: list[tuple[int, int]], pp: int,
                         stages: tuple[int, ...]) -> dict[str, str]:
    """{name on this rank: name in the whole model} of each trainable parameter that stages on several pipeline
    ranks use (`StageSplit.shared`). Stages of one rank share the one parameter: nothing to sum. The copies' sum
    rides the pp axis, so every pipeline rank must hold one (pp = 2 for a tied head): other cases are refused."""
    uses: dict[int, list[tuple[str, int]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            uses.setdefault(id(param), []).append((name, _owning_stage(name, model, kind, ranges)))
    shared = {}
    for named in uses.values():
        ranks = {stage % pp for _, stage in named}
        if len(ranks) == 1:
            continue
        (whole, stage), (other, other_stage) = named[0], next(u for u in named if u[1] % pp != named[0][1] % pp)
        if len(ranks) != pp:
            raise PipelineError(f"{other} is the same parameter as {whole} but they fall on pipeline stages "
                                f"{other_stage} and {stage}, on {len(ranks)} of the {pp} pipeline ranks; its "
                                f"gradient is summed over the pp axis, which needs a copy on every pipeline rank: "
                                f"use --pp 2 (or pp=1), or untie them (e.g. --tie-embeddings false)")
        local = next(name for name, stage in named if stage in stages)
        shared[local] = whole
    return shared
