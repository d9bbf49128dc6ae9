"""Tensor-parallel plans: module-name patterns → parallel styles, applied in place to a plain model.

    info = apply_tensor_parallel(model, LLAMA_SP_PLAN, comm, sequence_parallel=True,
                                 init=lambda name, shape: model.param_init(name, shape, seed))
    loss = info.loss_fn(model(tokens), targets)      # vocab-parallel cross-entropy
    loss.backward(); clip_grad_norm_tp_(model, info, 1.0); optimizer.step()

A plan maps glob patterns over dotted module names (`"layers.*.attention.wq"`) to a style.
Replacing styles swap the module for its parallel twin holding only this rank's shard; the
parameter names stay the model's (`layers.0.attention.wq.weight` is now [out/t, in]). The
model's code is untouched: head counts are read from weight shapes, so sharded projections
just compute fewer heads.

Where activations enter and leave the tp regions, without touching the model's forward:

- into attention / feed-forward: a `TPRegion` forward pre-hook on the module (not on its
  layers) enters once: `copy_to_tp`, under SP `gather_sequence`. wq, wk, wv (w1, w3) then
  share one collective per pass, as with Megatron's fused QKV, and under SP the attention
  sees the full sequence it reshapes by. Row layers (wo, w2) leave: all-reduce, under SP
  reduce-scatter along the sequence, so the residual stream and the norms run on s/t positions.
- into the first block (SP only): the reference model sizes its rotary tables from the
  embedding output's sequence length, so the embedding cannot already return sequence
  shards. It returns its unreduced partial sums at full length
  (`VocabEmbedding(defer_sp_reduce=True)`: no communication), and a pre-hook on `layers.0`
  (`SequenceShardInput`) reduce-scatters them: the one reduce-scatter Megatron does in the
  embedding, moved past the point where the model reads the length.
- into the head: the head is a column layer entering on its own (under SP it all-gathers the
  final norm's sequence shards); its logits [b, s, V/t] stay vocabulary-sharded for the loss.

Models called with keyword arguments (Hugging Face's `self_attn(hidden_states=...)`) enter their
regions by the keyword `hidden_states` (`TPRegion(input=...)` for another); Conv1D layers (GPT-2)
split like nn.Linear, in their own [in, out] layout. `HF_LLAMA_PLAN` and `HF_GPT2_PLAN` are ready
plans for the two most used Hugging Face families.

Norms on sequence shards see 1/t of the positions, so their weight grads are partial sums:
`SequenceParallelNorm` marks them; by default a grad hook all-reduces them over tp
(`TensorParallelInfo.sequence_partial` lists them for an engine that would rather fuse that).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.parallel.materialize import to_empty
from paratrain.parallel.tensor import adapters
from paratrain.mesh import Axis
from paratrain.parallel.tensor.info import TensorParallelInfo
from paratrain.parallel.tensor.layers import (
    ColumnParallelLinear, InitFn, RowParallelLinear, TensorParallelError, TensorParallelLayer, VocabParallelEmbedding,
    check_divisible, embedding_scale, enter_tp_region, linear_features, reduce_scatter_sequence,
)
from paratrain.parallel.tensor.primitives import scatter_to_tp


@dataclass
class _Context:
    comm: Comm
    axis: Axis
    sequence_parallel: bool
    regions: list[str] = field(default_factory=list)  # modules whose input enters the tp region once
    sequence_partial: list[str] = field(default_factory=list)
    handles: list = field(default_factory=list)
    vocab_sharded_logits: bool = False

    def in_region(self, name: str) -> bool:
        return any(name.startswith(region + ".") for region in self.regions)


def _expect(name: str, module: nn.Module, kind: type, style) -> None:
    if not isinstance(module, kind):
        raise TensorParallelError(f"{name}: {style} needs an nn.{kind.__name__}, got {type(module).__name__}")


def _linear(name: str, module: nn.Module, style) -> tuple[int, int, bool]:
    features = linear_features(module)
    if features is None:
        raise TensorParallelError(f"{name}: {style} needs an nn.Linear or a Conv1D, got {type(module).__name__}")
    return features


# -- styles -------------------------------------------------------------------------------------
# Each style checks its module before anything changes (`check(name, module, tp, parent)`), says which
# dims of which parameters it splits (`split_dims`, for tied parameters), and applies itself (`apply`).


class _Style:
    def check(self, name, module, tp, parent) -> None:
        pass

    def split_dims(self, module) -> dict[str, int]:
        """Parameter name → the dim this style splits over tp (empty: it replaces nothing)."""
        return {}


@dataclass(frozen=True)
class Colwise(_Style):
    """nn.Linear or Conv1D → ColumnParallelLinear: output features split; output sharded (or gathered)."""

    gather_output: bool = False

    def check(self, name, module, tp, parent):
        _, out_features, _ = _linear(name, module, self)
        check_divisible(name, "out_features", out_features, tp)
        _refuse_fused_projection(name, module, parent, out_features)
        adapters.check_split(name, module, tp, row_parallel=False)

    def split_dims(self, module):
        return {"weight": 1 if linear_features(module)[2] else 0, "bias": 0}

    def apply(self, name, module, ctx):
        layer = adapters.twin(ColumnParallelLinear, module).from_full(
            module, ctx.comm, ctx.axis, gather_output=self.gather_output, sequence_parallel=ctx.sequence_parallel,
            input_entered=ctx.in_region(name))
        ctx.sequence_partial += [f"{name}.{p}" for p in layer.sequence_partial_params()]
        return layer


def _refuse_fused_projection(name: str, module: nn.Module, parent: nn.Module, out_features: int) -> None:
    """A projection whose output its module splits into fixed parts (GPT-2's `c_attn`: q, k, v in one
    Conv1D, cut at `split_size`) cannot be column-split: each rank's contiguous slice would cut across
    the parts, and a per-part split is not one box of the weight (layout-free checkpoints need one)."""
    split = getattr(parent, "split_size", None)
    if isinstance(split, int) and 0 < split < out_features and out_features % split == 0:
        raise TensorParallelError(
            f"{name} is a fused projection: its module splits the {out_features} outputs into "
            f"{out_features // split} parts of {split} (e.g. q, k, v); a column split would cut across them. "
            "Leave it out of the plan (replicated, as HF_GPT2_PLAN does) or use a model with separate projections")


@dataclass(frozen=True)
class Rowwise(_Style):
    """nn.Linear or Conv1D → RowParallelLinear: input features split; output all-reduced (SP: reduce-scattered).

    `split_input`: the input arrives whole on every rank (after a `Colwise(gather_output=True)` whose output the
    module cuts into parts, as Phi-3's fused qkv_proj and gate_up_proj: transformers' "colwise_gather_output" then
    "rowwise_split_input"), and a forward pre-hook keeps this rank's features of it (backward: all-gather)."""

    split_input: bool = False

    def check(self, name, module, tp, parent):
        in_features, _, _ = _linear(name, module, self)
        check_divisible(name, "in_features", in_features, tp)
        adapters.check_split(name, module, tp, row_parallel=True)

    def split_dims(self, module):
        return {"weight": 0 if linear_features(module)[2] else 1}

    def apply(self, name, module, ctx):
        layer = adapters.twin(RowParallelLinear, module).from_full(module, ctx.comm, ctx.axis,
                                                                   sequence_parallel=ctx.sequence_parallel)
        ctx.sequence_partial += [f"{name}.{p}" for p in layer.sequence_partial_params()]
        if self.split_input:
            fn = functools.partial(scatter_to_tp, comm=ctx.comm, axis=ctx.axis, dim=-1)
            ctx.handles.append(_input_hook(layer, fn, "input"))
        return layer


@dataclass(frozen=True)
class VocabEmbedding(_Style):
    """nn.Embedding → VocabParallelEmbedding: vocabulary rows split.

    `defer_sp_reduce`: under SP, return unreduced partial sums at full sequence length and let a
    `SequenceShardInput` entry reduce-scatter them (for models that read the sequence length
    between the embedding and the first block, as the reference model does for rotary tables).
    """

    defer_sp_reduce: bool = False

    def check(self, name, module, tp, parent):
        _expect(name, module, nn.Embedding, self)
        check_divisible(name, "num_embeddings (vocabulary)", module.num_embeddings, tp)
        try:
            embedding_scale(module)
        except TensorParallelError as e:
            raise TensorParallelError(f"{name}: {e}") from None

    def split_dims(self, module):
        return {"weight": 0}

    def apply(self, name, module, ctx):
        return VocabParallelEmbedding.from_full(module, ctx.comm, ctx.axis, sequence_parallel=ctx.sequence_parallel,
                                                defer_reduce=self.defer_sp_reduce)


@dataclass(frozen=True)
class OutputHead(_Style):
    """The output projection, column-parallel over the vocabulary.

    Logits stay vocab-sharded [.., V/t] for `vocab_parallel_cross_entropy` (the info's
    `loss_fn` then uses it), or with `gather_logits` are all-gathered to [.., V].
    """

    gather_logits: bool = False

    def check(self, name, module, tp, parent):
        _expect(name, module, nn.Linear, self)
        check_divisible(name, "out_features (vocabulary)", module.out_features, tp)
        if adapters.twin(ColumnParallelLinear, module) is not ColumnParallelLinear:
            raise TensorParallelError(f"{name}: the output head with LoRA adapters is not split over tp yet; leave it "
                                      "out of --lora-targets (the default adapts the blocks' linears alone)")

    def split_dims(self, module):
        return {"weight": 0, "bias": 0}

    def apply(self, name, module, ctx):
        ctx.vocab_sharded_logits = not self.gather_logits
        return ColumnParallelLinear.from_full(module, ctx.comm, ctx.axis, gather_output=self.gather_logits,
                                              sequence_parallel=ctx.sequence_parallel,
                                              input_entered=ctx.in_region(name))


@dataclass(frozen=True)
class SequenceParallelNorm(_Style):
    """A norm (any replicated module) whose input is sequence-sharded under SP: its grads need a tp all-reduce."""

    def check(self, name, module, tp, parent):
        if not any(True for _ in module.parameters()):
            raise TensorParallelError(f"{name}: SequenceParallelNorm() marks parameters, but "
                                      f"{type(module).__name__} has none; drop the entry")

    def apply(self, name, module, ctx):
        if ctx.sequence_parallel:
            ctx.sequence_partial += [f"{name}.{p}" for p, _ in module.named_parameters()]


@dataclass(frozen=True)
class PartialGradients(_Style):
    """A replicated module inside a tp region whose grads are partial sums over tp, with or without SP: one that
    acts on each head apart (Qwen3's per-head q/k norms) sees only this rank's heads. Its grads are all-reduced
    over tp, as `SequenceParallelNorm`'s are under SP (transformers' "replicated_with_grad_allreduce")."""

    def check(self, name, module, tp, parent):
        SequenceParallelNorm().check(name, module, tp, parent)

    def apply(self, name, module, ctx):
        ctx.sequence_partial += [f"{name}.{p}" for p, _ in module.named_parameters()]


def _input_hook(module: nn.Module, fn, input_name: str):
    """A forward pre-hook (with kwargs) that applies `fn` to the module's input: its first positional
    argument, or the keyword `input_name` when it is called with keyword arguments only (Hugging Face
    modules call `self_attn(hidden_states=...)`)."""
    def hook(mod, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if input_name in kwargs:
            return args, {**kwargs, input_name: fn(kwargs[input_name])}
        raise TensorParallelError(f"{type(mod).__name__} was called without a positional input or a {input_name!r} "
                                  f"keyword (got {sorted(kwargs)}); name its input in the plan's style, e.g. "
                                  f"TPRegion(input=...)")
    return module.register_forward_pre_hook(hook, with_kwargs=True)


@dataclass(frozen=True)
class SequenceShardInput(_Style):
    """Under SP, a forward pre-hook reduce-scatters the module's input along the sequence.

    Put it on the first block: its input is then the deferred embedding's partial sums
    (see `VocabEmbedding(defer_sp_reduce=True)`). Backward: all-gather of the grad. The input
    is the first positional argument, or the keyword `input`.
    """

    input: str = "hidden_states"

    def apply(self, name, module, ctx):
        if ctx.sequence_parallel:
            fn = functools.partial(reduce_scatter_sequence, comm=ctx.comm, axis=ctx.axis, dim=1)
            ctx.handles.append(_input_hook(module, fn, self.input))


@dataclass(frozen=True)
class TPRegion(_Style):
    """The module's input enters the tp region once, in a forward pre-hook.

    `copy_to_tp` (backward all-reduce), or under SP `gather_sequence` (forward all-gather,
    backward reduce-scatter). Column layers inside then communicate nothing on their input, so
    wq, wk and wv (w1 and w3) share one collective per pass, as Megatron's fused QKV does.
    Entering at the module, not at its layers, also gives the module its full sequence
    length under SP: the reference attention reshapes by the length of its input. The input is
    the first positional argument, or the keyword `input` (Hugging Face: `hidden_states`).
    """

    input: str = "hidden_states"

    def apply(self, name, module, ctx):
        ctx.regions.append(name)
        fn = functools.partial(enter_tp_region, comm=ctx.comm, axis=ctx.axis, sequence_parallel=ctx.sequence_parallel)
        ctx.handles.append(_input_hook(module, fn, self.input))


@dataclass(frozen=True)
class AttentionRegion(TPRegion):
    """A `TPRegion` that first checks whole heads split over tp: query and key/value head counts.

    The head size is the module's `head_dim` attribute; counts come from the projections' shapes.
    """

    q: str = "wq"
    kv: tuple[str, ...] = ("wk", "wv")
    head_dim: str = "head_dim"

    def check(self, name, module, tp, parent):
        size = getattr(module, self.head_dim)
        for proj in (self.q, *self.kv):
            heads = linear_features(getattr(module, proj))[1] // size
            kind = "query" if proj == self.q else "key/value"
            if heads % tp:
                raise TensorParallelError(f"{name}: {heads} {kind} heads ({proj}) are not divisible by tp={tp}; "
                                          f"choose tp dividing the number of {kind} heads")


Style = (Colwise | Rowwise | VocabEmbedding | OutputHead | SequenceParallelNorm | SequenceShardInput | TPRegion
         | AttentionRegion | PartialGradients)


# -- what the rest of the system needs to know ---------------------------------------------------

@runtime_checkable
class PlannedModel(Protocol):
    """A model that names its own plan (the reference `Transformer` does): `parallelize` applies it when the
    caller gives none, so that tensor parallelism knows no model but the one in front of it."""

    def tensor_parallel_plan(self, sequence_parallel: bool) -> Mapping[str, Style]: ...


# -- applying a plan ---------------------------------------------------------------------------

def apply_tensor_parallel(model: nn.Module, plan: Mapping[str, Style], comm: Comm,
                          sequence_parallel: bool = False, init: InitFn | None = None, *, axis: Axis = Axis.TP,
                          device=None, sp_grad_hooks: bool = True, strict: bool = True) -> TensorParallelInfo:
    """Replace the modules `plan` names by their tensor-parallel twins, in place; describe the result.

    The model may be materialized (each layer keeps its slice of the existing weights) or on the
    meta device with `init(name, full_shape)` giving every parameter's full initial value: then
    the whole model is materialized on `device` and each rank keeps its slice, so shards equal
    slices of the single-process initialization. Everything is checked before anything changes:
    a pattern matching no module, a module matched twice, or a size tp does not divide raise
    TensorParallelError. Tied parameters split the same way become one shared shard. With
    `strict=False` a pattern may match nothing (a pipeline stage holds only part of the model).
    """
    mesh = comm.mesh
    tp = mesh.size(axis)
    matches = _match(model, plan, strict)
    for name, module, style in matches:
        style.check(name, module, tp, model.get_submodule(name.rpartition(".")[0]))
    _check_ties(model, matches)
    if sequence_parallel:
        _check_sequence_parallel(model, matches)
    ctx = _Context(comm, axis, sequence_parallel)
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(full) → (full, shard), kept alive
    for name, module, style in matches:
        layer = style.apply(name, module, ctx)
        if layer is not None:
            _keep_frozen(module, layer)
            _share_tied(name, module, layer, replaced)
            _set_submodule(model, name, layer)
    sharded = _sharded_names(model)
    tied = _tied_names(model)
    if init is not None:
        _materialize(model, init, sharded, tied, tp, mesh.coord(axis), device)
    info = TensorParallelInfo(comm, axis, sequence_parallel, sharded, ctx.sequence_partial,
                              ctx.vocab_sharded_logits, tied, ctx.handles)
    if sp_grad_hooks:
        for name in info.sequence_partial:
            hook = functools.partial(_all_reduced, comm, axis)
            info.handles.append(model.get_parameter(name).register_hook(hook))
    return info


def _all_reduced(comm: Comm, axis: Axis, grad: torch.Tensor) -> torch.Tensor:
    # A tensor hook on the leaf runs before accumulation: each backward's contribution is
    # reduced once, so gradient accumulation stays correct.
    out = grad.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, axis)
    return out


def check_nf4_bases(model: nn.Module, plan: Mapping[str, Style], tp: int, names: list[str]) -> None:
    """TensorParallelError (one line) for a linear of `names` (LoRA's targets, before they are converted) whose
    weight, stored in NF4, the plan's `Colwise` or `Rowwise` cannot split over tp on whole blocks
    (`adapters.check_nf4_split`): the check `apply_tensor_parallel` makes, before any process starts."""
    for name, module, style in _match(model, plan, strict=False):
        if name in names and isinstance(style, (Colwise, Rowwise)):
            adapters.check_nf4_split(name, tuple(module.weight.shape), tp, isinstance(style, Rowwise))


def _match(model: nn.Module, plan: Mapping[str, Style], strict: bool = True) -> list[tuple[str, nn.Module, Style]]:
    """(name, module, style) in model order; every pattern must match, no module twice."""
    modules = [(n, m) for n, m in model.named_modules() if n]
    owner: dict[str, str] = {}
    for pattern in plan:
        hits = [n for n, _ in modules if fnmatch.fnmatchcase(n, pattern)]
        if not hits and strict:
            examples = ", ".join(n for n, _ in modules[:4])
            raise TensorParallelError(f"plan pattern {pattern!r} matches no module of {type(model).__name__} "
                                      f"(names look like: {examples}); fix or drop the pattern")
        for n in hits:
            if n in owner:
                raise TensorParallelError(f"module {n!r} matches plan patterns {owner[n]!r} and {pattern!r}; "
                                          "make the patterns disjoint")
            owner[n] = pattern
    return [(n, m, plan[owner[n]]) for n, m in modules if n in owner]


def _check_ties(model: nn.Module, matches) -> None:
    """A parameter shared by several modules must be split by all of them, along the same dim."""
    splits = {f"{name}.{pname}": style.split_dims(module).get(pname)  # every parameter a replacing style splits
              for name, module, style in matches if style.split_dims(module)
              for pname, _ in module.named_parameters(recurse=False)}
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        planned = [n for n in names if n in splits]
        if not planned or len(names) == 1:
            continue
        missing = [n for n in names if n not in splits]
        if missing:
            raise TensorParallelError(f"{missing[0]} is tied to {planned[0]}, which the plan shards, but its module "
                                      "is not in the plan; add it with a style that splits it the same way")
        if len({splits[n] for n in names}) > 1:
            raise TensorParallelError(f"{names[1]} is tied to {names[0]} but their styles split different dims "
                                      f"({splits[names[1]]} and {splits[names[0]]}); split tied parameters alike")


def _keep_frozen(old: nn.Module, layer: TensorParallelLayer) -> None:
    """A parameter the model holds frozen (`requires_grad=False`: a LoRA run's base, embeddings and head) stays
    frozen in its shard."""
    for pname, shard in layer.named_parameters(recurse=False):
        shard.requires_grad_(getattr(old, pname).requires_grad)


def _share_tied(name: str, old: nn.Module, layer: TensorParallelLayer, replaced: dict) -> None:
    """Make a replaced parameter tied to an already-replaced one share its shard (dims checked before)."""
    for pname, shard in list(layer.named_parameters(recurse=False)):
        full = getattr(old, pname)
        if id(full) in replaced:
            other = replaced[id(full)][1]
            assert other.shape == shard.shape, (name, pname)
            setattr(layer, pname, other)
        else:
            replaced[id(full)] = (full, shard)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _sharded_names(model: nn.Module) -> dict[str, int]:
    sharded = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TensorParallelLayer):
            for pname, dim in module.shard_dims.items():
                if getattr(module, pname) is not None:
                    sharded[f"{prefix}.{pname}" if prefix else pname] = dim
    return sharded


def _tied_names(model: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


@torch.no_grad()
def _materialize(model, init: InitFn, sharded: dict[str, int], tied: dict[str, str], tp: int, rank: int,
                 device) -> None:
    """to_empty on `device`, restore ties, fill every parameter with its slice of `init`."""
    to_empty(model, device or "cpu")
    for alias, canonical in tied.items():
        _set_param(model, alias, model.get_parameter(canonical))
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if name in sharded:
            shape[sharded[name]] *= tp
        full = init(name, tuple(shape))
        param.copy_(full.chunk(tp, sharded[name])[rank] if name in sharded else full)


def _set_param(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, param)


def _check_sequence_parallel(model: nn.Module, matches) -> None:
    """Under SP every parameter must be sharded or known to get partial grads; boundaries must pair up."""
    styles = [style for _, _, style in matches]
    deferred = any(isinstance(s, VocabEmbedding) and s.defer_sp_reduce for s in styles)
    if deferred != any(isinstance(s, SequenceShardInput) for s in styles):
        raise TensorParallelError("a VocabEmbedding(defer_sp_reduce=True) and a SequenceShardInput() go together "
                                  "(the second reduces what the first defers); the plan has only one")
    covering = (Colwise, Rowwise, VocabEmbedding, OutputHead, SequenceParallelNorm, PartialGradients)
    covered = {f"{name}.{p}" for name, module, style in matches if isinstance(style, covering)
               for p, _ in module.named_parameters()}
    for name, _ in model.named_parameters():
        if name not in covered:
            raise TensorParallelError(f"sequence_parallel=True but {name} is neither sharded nor marked "
                                      "SequenceParallelNorm(); its grad would be a partial sum (use LLAMA_SP_PLAN)")
