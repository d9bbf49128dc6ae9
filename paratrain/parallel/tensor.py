"""Tensor parallelism (Megatron-style) with sequence parallelism: primitives, layers, parallel loss.

The `tp` ranks of one group hold different slices of the same weight matrices
and compute one layer together. Rank r of t keeps chunk r of an even split:

===========================  =============================  ==========================================
layer                        rank r holds                   communication (b·s·h = activation size)
===========================  =============================  ==========================================
ColumnParallelLinear         rows r of W [out, in] (+ bias)  fwd: —          bwd: all-reduce of dX
  under sequence parallel                                    fwd: all-gather X along s   bwd: reduce-scatter dX
RowParallelLinear            columns r of W [out, in]        fwd: all-reduce of Y        bwd: —
  under sequence parallel                                    fwd: reduce-scatter Y along s   bwd: all-gather dY
VocabParallelEmbedding       rows r of the table [V, h]      fwd: all-reduce (SP: reduce-scatter along s)
vocab_parallel_cross_entropy logits [.., V/t] of its rows    fwd: 2 all-reduces of b·s (max; sum-exp+target)
===========================  =============================  ==========================================

A Megatron MLP or attention block is a column layer followed by a row layer,
so one block costs one all-reduce of b·s·h forward and one backward; a
transformer layer has two blocks: 2 + 2 all-reduces per step. Sequence
parallelism replaces each all-reduce by a reduce-scatter plus an all-gather
(the same bytes) and keeps the activations between blocks (norms, residual
stream) split along the sequence, 1/t of them per rank.

Every collective goes through `Comm` and runs on an explicit `(comm, axis)`.
Communication is wrapped in autograd functions named by what they do in both
passes (`copy_to_tp`: forward identity, backward all-reduce), so a layer's
forward reads as its math. Activations are [batch, seq, ...] (the reference
model's layout); the sequence dim is moved to the front for the flat dim-0
collectives and back.

Applying layers to a whole model is `paratrain.parallel.tp_plan`'s job.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.comm import Comm
from paratrain.compat import held_alone
from paratrain.errors import ParatrainError
from paratrain.parallel.norm import sum_of_squares

if TYPE_CHECKING:
    from paratrain.parallel.tp_plan import TensorParallelInfo

# init(name, full_shape) -> the full fp32 initial value of parameter `name`.
InitFn = Callable[[str, tuple[int, ...]], torch.Tensor]


class TensorParallelError(ParatrainError, ValueError):
    """A size or plan that tensor parallelism cannot split; the message names it and the rule."""


def check_divisible(where: str, what: str, size: int, tp: int) -> None:
    """Raise TensorParallelError unless `size` splits evenly over `tp` ranks."""
    if size % tp:
        raise TensorParallelError(f"{where}: {what}={size} is not divisible by tp={tp}; "
                                  f"choose tp dividing {size}")


# -- tensor helpers (flat dim-0 collectives along any dim) -----------------------------------

def _split(x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
    n, r = comm.mesh.size(axis), comm.mesh.coord(axis)
    check_divisible("split", f"size of dim {dim}", x.shape[dim], n)
    return x.chunk(n, dim)[r].contiguous()


def _all_gather(x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`. Gathered as they are, stacked on a new leading dim (rank r's
    block is its `x`, in place), then that dim moved beside `dim`: one copy, none when `dim` is 0."""
    n, dim = comm.mesh.size(axis), dim % x.dim()
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n, *x.shape))
    comm.all_gather(out.flatten(0, 1), x, axis)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
    """Sum over the ranks of `x`, this rank's 1/n of it along `dim`. `dim` split in n blocks moved to the
    front (one copy, none when `dim` is 0), so each rank's block is a chunk of dim 0; its block arrives in the
    layout of `x`, so nothing is copied after."""
    n, dim = comm.mesh.size(axis), dim % x.dim()
    if n == 1:
        return x
    check_divisible("reduce-scatter", f"size of dim {dim} (sequence length)", x.shape[dim], n)
    front = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = front.new_empty(front.shape[1:])
    comm.reduce_scatter(out, front.flatten(0, 1), axis)
    return out


def _all_reduce(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    # A fresh contiguous buffer: autograd may hold `x`, and a gradient can be a stride-0 expand.
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, axis)
    return out


def _all_reduce_grad(grad: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """A gradient summed over `axis`: in place when this backward holds it alone, else in a copy.

    Autograd can hand one gradient tensor to several branches (an add passes its gradient to both
    of its inputs as it is); summing it in place would change it for the others too. Alone means
    what autograd checks before accumulating into a gradient in place: nothing else references
    the tensor and no other tensor shares its storage (not a view or an expand, not saved for
    another backward). What enters a region is most often its layers' matmuls' fresh output: no copy.
    """
    if grad.is_contiguous() and held_alone(grad):
        comm.all_reduce(grad, axis)
        return grad
    return _all_reduce(grad, comm, axis)


# -- differentiable primitives, named by both passes --------------------------------------------

class _TwoPasses(torch.autograd.Function):
    """Apply `forward` to the input and `backward` to its gradient: every primitive below is one pair."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn = backward
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad), None, None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.detach()  # same storage; not a view, so the output does not keep the input alive


def copy_to_tp(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """Forward identity, backward all-reduce over `axis`: a replicated input enters a tp region."""
    return _TwoPasses.apply(x, _identity, partial(_all_reduce_grad, comm=comm, axis=axis))


class _ReduceInPlace(torch.autograd.Function):
    """Forward all-reduce of a partial output where it lies, backward identity."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        if not x.is_contiguous() or (x.is_leaf and x.requires_grad):  # no place to sum in: a copy
            return _all_reduce(x, comm, axis)
        ctx.mark_dirty(x)
        comm.all_reduce(x, axis)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def reduce_from_tp(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """Forward all-reduce over `axis`, backward identity: partial outputs leave a tp region summed.

    `x` is summed in place (no copy): it must be a partial output made for this sum, as a parallel
    layer's matmul or embedding output is, that nothing else reads. (A gradient entering a region
    is summed in place only when nothing else holds it: `_all_reduce_grad`.)
    """
    return _ReduceInPlace.apply(x, comm, axis)


def gather_from_tp(x: torch.Tensor, comm: Comm, axis: str, dim: int = -1) -> torch.Tensor:
    """Forward all-gather along `dim`, backward split (keep this rank's chunk): assemble a sharded output."""
    dim %= x.dim()
    return _TwoPasses.apply(x, partial(_all_gather, dim=dim, comm=comm, axis=axis),
                            partial(_split, dim=dim, comm=comm, axis=axis))


def scatter_to_tp(x: torch.Tensor, comm: Comm, axis: str, dim: int = -1) -> torch.Tensor:
    """Forward split along `dim` (keep this rank's chunk), backward all-gather."""
    dim %= x.dim()
    return _TwoPasses.apply(x, partial(_split, dim=dim, comm=comm, axis=axis),
                            partial(_all_gather, dim=dim, comm=comm, axis=axis))


def gather_sequence(x: torch.Tensor, comm: Comm, axis: str, dim: int = 1) -> torch.Tensor:
    """Forward all-gather of sequence shards, backward reduce-scatter (each rank's grad is partial)."""
    dim %= x.dim()
    return _TwoPasses.apply(x, partial(_all_gather, dim=dim, comm=comm, axis=axis),
                            partial(_reduce_scatter, dim=dim, comm=comm, axis=axis))


def reduce_scatter_sequence(x: torch.Tensor, comm: Comm, axis: str, dim: int = 1) -> torch.Tensor:
    """Forward reduce-scatter of partial outputs along the sequence, backward all-gather of the grad."""
    dim %= x.dim()
    return _TwoPasses.apply(x, partial(_reduce_scatter, dim=dim, comm=comm, axis=axis),
                            partial(_all_gather, dim=dim, comm=comm, axis=axis))


def enter_tp_region(x: torch.Tensor, comm: Comm, axis: str, sequence_parallel: bool) -> torch.Tensor:
    """Bring an activation into a tp region: `copy_to_tp`, or under SP `gather_sequence` (dim 1)."""
    if sequence_parallel:
        return gather_sequence(x, comm, axis, dim=1)
    return copy_to_tp(x, comm, axis)


# -- parallel layers ----------------------------------------------------------------------------

class TensorParallelLayer(nn.Module):
    """What every parallel layer shares: its group, which parameters are split, slicing, init.

    A layer built by its constructor holds zeros (on `device`, e.g. meta): fill it with
    `init_from(init)`, or build it with `from_full(module)` from an existing full module.
    """

    shard_dims: dict[str, int]  # parameter name → the dim split over tp (absent: replicated)

    def _bind(self, comm: Comm, axis: str, sequence_parallel: bool) -> None:
        self.comm, self.axis, self.sequence_parallel = comm, axis, sequence_parallel
        self.tp, self.tp_rank = comm.mesh.size(axis), comm.mesh.coord(axis)

    def full_shape(self, name: str) -> tuple[int, ...]:
        shape = list(getattr(self, name).shape)
        if name in self.shard_dims:
            shape[self.shard_dims[name]] *= self.tp
        return tuple(shape)

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the full value of parameter `name`."""
        return full.chunk(self.tp, self.shard_dims[name])[self.tp_rank] if name in self.shard_dims else full

    def sequence_partial_params(self) -> list[str]:
        """Replicated parameters whose grads are partial sums over tp under sequence parallelism."""
        return []

    @torch.no_grad()
    def init_from(self, init: InitFn, prefix: str = "", device=None) -> None:
        """Fill each parameter with its slice of `init(prefix + name, full_shape)` (materializing meta ones)."""
        for name, param in list(self.named_parameters(recurse=False)):
            value = self.local_slice(name, init(prefix + name, self.full_shape(name)))
            if param.is_meta:
                param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device))
                setattr(self, name, param)
            param.copy_(value)

    @torch.no_grad()
    def _load_full(self, module: nn.Module) -> None:
        for name, param in self.named_parameters(recurse=False):
            param.copy_(self.local_slice(name, getattr(module, name)))


def linear_features(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in_features, out_features, transposed) of an `nn.Linear` or of a Conv1D (Hugging Face's GPT-2
    layer: y = x W + b with W stored [in, out], the transpose of nn.Linear's); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return module.nx, module.nf, True
    return None


class _ParallelLinear(TensorParallelLayer):
    """What the column and row layers share: each can be built as the shard of an existing `nn.Linear`
    or Conv1D, keeping that layer's weight layout (`transposed`: [in, out]) so parameter names, shapes
    and checkpoints are those of the model without tensor parallelism."""

    transposed: bool = False

    @classmethod
    def from_full(cls, linear: nn.Module, comm: Comm, axis: str = "tp", **options):
        """This rank's shard of an existing `nn.Linear` or Conv1D (its weight rows or columns, see the class)."""
        features = linear_features(linear)
        if features is None:
            raise TensorParallelError(f"{cls.__name__} shards an nn.Linear or a Conv1D, not {type(linear).__name__}")
        in_features, out_features, transposed = features
        layer = cls(in_features, out_features, linear.bias is not None, comm, axis, transposed=transposed,
                    device=linear.weight.device, dtype=linear.weight.dtype, **options)
        layer._load_full(linear)
        return layer

    def _make_weight(self, rows: int, cols: int, device, dtype) -> nn.Parameter:
        """The [out, in] weight ([in, out] when transposed) of this rank's shard."""
        shape = (cols, rows) if self.transposed else (rows, cols)
        return nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight.t() if self.transposed else self.weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """Y = X Wᵀ + b with W [out, in] split by output features: rank r holds rows r·out/t … of W and b.

    Each rank computes its out/t columns of Y from the whole X.
    Forward: X is replicated → `copy_to_tp` (no communication); under SP, X arrives as
    sequence shards [b, s/t, in] → `gather_sequence` all-gathers it (b·s·in elements).
    Y stays sharded [.., out/t], or with `gather_output` is all-gathered along features.
    Backward: dX is a partial sum over ranks (each rank used only its rows of W) → all-reduce
    (under SP: reduce-scatter back to sequence shards); dW, db are local and complete.
    With `input_entered` the caller has already done that entry (`enter_tp_region`, once for
    several layers reading the same X, as wq/wk/wv do): the layer communicates nothing on X.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm, axis: str = "tp", *,
                 gather_output: bool = False, sequence_parallel: bool = False, input_entered: bool = False,
                 transposed: bool = False, device=None, dtype=None):
        super().__init__()
        self._bind(comm, axis, sequence_parallel)
        check_divisible("ColumnParallelLinear", "out_features", out_features, self.tp)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.input_entered, self.transposed = gather_output, input_entered, transposed
        self.shard_dims = {"weight": 1 if transposed else 0, "bias": 0}
        local = out_features // self.tp
        self.weight = self._make_weight(local, in_features, device, dtype)
        self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_entered:
            x = enter_tp_region(x, self.comm, self.axis, self.sequence_parallel)
        y = self._matmul(x, self.bias)
        return gather_from_tp(y, self.comm, self.axis, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (/{self.tp}), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, "
                f"input_entered={self.input_entered}")


class RowParallelLinear(_ParallelLinear):
    """Y = X Wᵀ + b with W [out, in] split by input features: rank r holds columns r·in/t … of W.

    Takes X sharded along features [.., in/t] (a column layer's output) and computes a partial
    Y = X_r W_rᵀ. Forward: all-reduce the partials (b·s·out elements); under SP, reduce-scatter
    them along the sequence instead, so Y leaves as sequence shards [b, s/t, out]. The bias is
    replicated and added once, after the reduction.
    Backward: dY is replicated (under SP: all-gathered from the sequence shards), dX_r = dY W_r
    and dW_r are local. Under SP db is a partial sum over the sequence shards (all-reduce it
    over tp with the norms' grads; see `sequence_partial_params`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm, axis: str = "tp", *,
                 sequence_parallel: bool = False, transposed: bool = False, device=None, dtype=None):
        super().__init__()
        self._bind(comm, axis, sequence_parallel)
        check_divisible("RowParallelLinear", "in_features", in_features, self.tp)
        self.in_features, self.out_features, self.transposed = in_features, out_features, transposed
        self.shard_dims = {"weight": 0 if transposed else 1}
        self.weight = self._make_weight(out_features, in_features // self.tp, device, dtype)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def sequence_partial_params(self) -> list[str]:
        return ["bias"] if self.sequence_parallel and self.bias is not None else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial_y = self._matmul(x)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial_y, self.comm, self.axis, dim=1)
        else:
            y = reduce_from_tp(partial_y, self.comm, self.axis)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (/{self.tp}), out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(TensorParallelLayer):
    """Embedding table [V, h] split by vocabulary rows: rank r holds ids [r·V/t, (r+1)·V/t).

    Forward: each rank looks up the ids it holds and writes zeros for the others, so the full
    embedding is the sum over ranks: all-reduce (b·s·h elements); under SP, reduce-scatter along
    the sequence so the output is sequence-sharded [b, s/t, h]. With `defer_reduce` the layer
    returns the unreduced partial sums (full sequence, no communication): whoever reads them
    must reduce them (tp_plan's `SequenceShardInput` reduce-scatters them at the first block);
    without SP it is ignored.
    Backward: the grad of the sum is replicated (under SP: all-gathered); each rank's table grad
    touches only its rows, complete and local.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Comm, axis: str = "tp", *,
                 sequence_parallel: bool = False, defer_reduce: bool = False, device=None, dtype=None):
        super().__init__()
        self._bind(comm, axis, sequence_parallel)
        check_divisible("VocabParallelEmbedding", "num_embeddings (vocabulary)", num_embeddings, self.tp)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.defer_reduce = defer_reduce
        self.shard_dims = {"weight": 0}
        self.rows = num_embeddings // self.tp
        self.weight = nn.Parameter(torch.zeros(self.rows, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_full(cls, embedding: nn.Embedding, comm: Comm, axis: str = "tp", **options) -> VocabParallelEmbedding:
        """The shard of an existing `nn.Embedding` (its rows for this rank)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise TensorParallelError("VocabParallelEmbedding: padding_idx, max_norm and sparse are not "
                                      "supported; use a plain nn.Embedding")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm, axis,
                    device=embedding.weight.device, dtype=embedding.weight.dtype, **options)
        layer._load_full(embedding)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.tp_rank * self.rows
        elsewhere = (ids < start) | (ids >= start + self.rows)
        partial_y = F.embedding((ids - start).masked_fill(elsewhere, 0), self.weight)
        partial_y = partial_y.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.defer_reduce and self.sequence_parallel:
            return partial_y
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial_y, self.comm, self.axis, dim=1)
        return reduce_from_tp(partial_y, self.comm, self.axis)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (/{self.tp}), {self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}, defer_reduce={self.defer_reduce}")


# -- the loss over vocab-sharded logits --------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits [N, V/t] whose vocabulary is split over tp.

    loss = log Σ_v exp(z_v − m) − (z_target − m), m = max_v z_v. Three reductions over tp, in two
    all-reduces of N (and 2N) elements: the max (MAX), then sum-exp and the target logit (only
    the rank holding the target contributes it) together (SUM). No rank holds more than its
    [N, V/t] slice. Backward on the local slice: softmax − one-hot(target), times the row's grad.
    """

    @staticmethod
    def forward(ctx, logits, targets, comm, axis, ignore_index):
        local_vocab, ctx.logits_dtype = logits.shape[-1], logits.dtype
        start = comm.mesh.coord(axis) * local_vocab
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, axis, op=dist.ReduceOp.MAX)
        exp = (logits - row_max.unsqueeze(-1)).exp_()
        ignored = targets == ignore_index
        local_target = targets - start
        here = (local_target >= 0) & (local_target < local_vocab) & ~ignored
        local_target = local_target.masked_fill(~here, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max
        sums = torch.stack([exp.sum(-1), target_logit.masked_fill(~here, 0.0)])
        comm.all_reduce(sums, axis)
        loss = (sums[0].log() - sums[1]).masked_fill(ignored, 0.0)
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, here, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, here, ignored = ctx.saved_tensors
        row_grad = grad_loss.masked_fill(ignored, 0.0)
        grad = softmax * row_grad.unsqueeze(-1)
        # − row_grad at each row's target column where this rank holds it; a scatter, not an index by
        # nonzero() (whose size the host would have to read from the device).
        target_grad = row_grad.masked_fill(~here, 0.0).unsqueeze(-1).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -target_grad)
        return grad.to(ctx.logits_dtype), None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "sum") -> torch.Tensor:
    """`F.cross_entropy` of logits [.., V] against targets [..], computed in at least fp32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm, axis: str = "tp",
                                 ignore_index: int = -100, reduction: str = "sum") -> torch.Tensor:
    """`F.cross_entropy` of logits [.., V/t] sharded by vocabulary over `axis`, never gathering them.

    Value and gradient equal `F.cross_entropy(full_logits, targets, ignore_index, reduction)`
    (reduction "sum", "mean" over non-ignored targets, or "none"); computed and returned in fp32
    (fp64 for fp64 logits).
    """
    if reduction not in ("sum", "mean", "none"):
        raise TensorParallelError(f"reduction={reduction!r} is invalid; use 'sum', 'mean' or 'none'")
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            comm, axis, ignore_index)
    if reduction == "none":
        return loss.view(targets.shape)
    if reduction == "mean":
        return loss.sum() / (targets != ignore_index).sum()
    return loss.sum()


# -- whole-model helpers: norms, gathering, RNG ----------------------------------------------

def tp_norm_sq(named_tensors: Iterable[tuple[str, torch.Tensor]], info: TensorParallelInfo) -> torch.Tensor:
    """Σ‖t‖² over the tp group: tp-sharded tensors summed over ranks, replicated ones counted once.

    Takes (parameter name, tensor) pairs, e.g. grads or a ZeRO engine's local shards of them;
    the result is then complete over tp and still partial over any other axis the tensors are
    split on (a ZeRO engine all-reduces it over dp next: the sum is linear).
    """
    sharded, replicated = tp_norm_sq_parts(named_tensors, info)
    info.comm.all_reduce(sharded, info.axis)
    return sharded + replicated


def tp_norm_sq_parts(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     info: TensorParallelInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (Σ‖t‖² of its tp-sharded tensors, Σ‖t‖² of its replicated ones), no communication."""
    split: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # is sharded → tensors
    for name, tensor in named_tensors:
        split[name in info.sharded].append(tensor)
    device = next((t.device for t in split[True] + split[False]), info.comm.mesh.device)
    sharded, replicated = (sum_of_squares(split[s], device) for s in (True, False))
    return sharded, replicated


def tp_grad_norm_sq(model: nn.Module, info: TensorParallelInfo) -> torch.Tensor:
    """Squared norm of the whole model's gradient (every parameter once), the same on every tp rank."""
    return tp_norm_sq(((n, p.grad) for n, p in model.named_parameters() if p.grad is not None), info)


@torch.no_grad()
def clip_grad_norm_tp_(model: nn.Module, info: TensorParallelInfo, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` for a tensor-parallel model: the same total norm and scale on every tp rank."""
    total = tp_grad_norm_sq(model, info).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(scale.to(param.grad.device, param.grad.dtype))
    return total


@torch.no_grad()
def gather_full(value: torch.Tensor, dim: int | None, comm: Comm, axis: str) -> torch.Tensor:
    """The whole tensor from this rank's slice split along `dim` over `axis` (a copy; None: not split)."""
    return value.detach().clone() if dim is None else _all_gather(value.detach(), dim, comm, axis)


def full_parameters(model: nn.Module, info: TensorParallelInfo) -> dict[str, torch.Tensor]:
    """Every parameter at its full shape (sharded ones all-gathered over tp), by name."""
    return {name: info.gather(name, param) for name, param in model.named_parameters()}


def tp_rng(mesh, seed: int, name: str, *, sharded: bool, axis: str = "tp", device="cpu") -> torch.Generator:
    """A named random stream for dropout in a tensor-parallel model.

    Replicated activations (the residual stream without SP, a row layer's reduced output) must
    get the same mask on every tp rank, or the replicas drift apart: the stream is keyed by
    (seed, name) alone. Sharded activations (a column layer's heads or ffn columns, sequence
    shards under SP) are different numbers on each rank and need independent masks: the tp
    coordinate joins the key.
    """
    where = f"{axis}={mesh.coord(axis)}" if sharded else f"{axis}=*"
    digest = hashlib.sha256(f"{seed}:{name}:{where}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
