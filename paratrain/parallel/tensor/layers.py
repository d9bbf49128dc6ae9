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

Applying layers to a whole model is `paratrain.parallel.tensor.plan`'s job.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import Axis
from paratrain.parallel.fp8 import fp8_linear
from paratrain.parallel.tensor.collectives import TensorParallelError, _all_gather, check_divisible
from paratrain.parallel.tensor.primitives import (
    InitFn, reduce_from_tp, gather_from_tp, reduce_scatter_sequence, enter_tp_region,
)


# -- parallel layers ----------------------------------------------------------------------------

class TensorParallelLayer(nn.Module):
    """What every parallel layer shares: its group, which parameters are split, slicing, init.

    A layer built by its constructor holds zeros (on `device`, e.g. meta): fill it with
    `init_from(init)`, or build it with `from_full(module)` from an existing full module.
    """

    shard_dims: dict[str, int]  # parameter name → the dim split over tp (absent: replicated)

    def _bind(self, comm: Comm, axis: Axis, sequence_parallel: bool) -> None:
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
    fp8_recipe: str | None = None  # the local matmul in FP8 (`paratrain.parallel.fp8.convert_to_fp8`)
    fp8_casts = None  # and the step's weight casts (`paratrain.parallel.fp8.Fp8Casts`)
    fp8_agree = None  # and the amax agreement over cp (`paratrain.parallel.fp8.convert_to_fp8`)

    @classmethod
    def from_full(cls, linear: nn.Module, comm: Comm, axis: Axis = Axis.TP, **options):
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
        weight = self.weight.t() if self.transposed else self.weight
        if self.fp8_recipe is not None:
            cast = (self.fp8_casts.weight(self, weight, self._agree_amax)
                    if self.fp8_casts and self.fp8_recipe == "tensorwise" else None)
            return fp8_linear(x, weight, bias, self.fp8_recipe, agree=self._agree_amax, cast=cast)
        return F.linear(x, weight, bias)

    def _agree_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The largest of the tp ranks' amaxes (and cp's): every shard casts with the whole tensor's scale."""
        self.comm.all_reduce(amax, self.axis, op=dist.ReduceOp.MAX)
        return self.fp8_agree(amax) if self.fp8_agree is not None else amax


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

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm, axis: Axis = Axis.TP, *,
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

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm, axis: Axis = Axis.TP, *,
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
    touches only its rows, complete and local. `padding_idx` as `nn.Embedding`'s: that row (on the
    rank holding it) gets no gradient. `scale`: the output times this factor, as transformers' scaled
    word embeddings multiply theirs (Gemma's √h; `embedding_scale`).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Comm, axis: Axis = Axis.TP, *,
                 sequence_parallel: bool = False, defer_reduce: bool = False, padding_idx: int | None = None,
                 scale: float | torch.Tensor | None = None, device=None, dtype=None):
        super().__init__()
        self._bind(comm, axis, sequence_parallel)
        check_divisible("VocabParallelEmbedding", "num_embeddings (vocabulary)", num_embeddings, self.tp)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.defer_reduce = defer_reduce
        self.padding_idx, self.scale = padding_idx, scale
        self.shard_dims = {"weight": 0}
        self.rows = num_embeddings // self.tp
        self.weight = nn.Parameter(torch.zeros(self.rows, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_full(cls, embedding: nn.Embedding, comm: Comm, axis: Axis = Axis.TP, **options) -> VocabParallelEmbedding:
        """The shard of an existing `nn.Embedding` (its rows for this rank)."""
        if embedding.max_norm is not None or embedding.sparse:
            raise TensorParallelError("VocabParallelEmbedding: max_norm and sparse are not supported; use a plain "
                                      "nn.Embedding")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm, axis, padding_idx=embedding.padding_idx,
                    scale=embedding_scale(embedding),
                    device=embedding.weight.device, dtype=embedding.weight.dtype, **options)
        layer._load_full(embedding)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.tp_rank * self.rows
        elsewhere = (ids < start) | (ids >= start + self.rows)
        # The padding row, where this rank holds it, by its local index; the ids held elsewhere read row 0 and are
        # zeroed below, so their gradient is zero whatever row 0 is.
        pad = self.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < start + self.rows else None
        partial_y = F.embedding((ids - start).masked_fill(elsewhere, 0), self.weight, padding_idx=local_pad)
        partial_y = partial_y.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.scale is not None:  # before the sum over ranks: one rank's row times it, as the whole table's
            partial_y = partial_y * (self.scale.to(partial_y.dtype) if torch.is_tensor(self.scale) else self.scale)
        if self.defer_reduce and self.sequence_parallel:
            return partial_y
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial_y, self.comm, self.axis, dim=1)
        return reduce_from_tp(partial_y, self.comm, self.axis)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (/{self.tp}), {self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}, defer_reduce={self.defer_reduce}")


def embedding_scale(embedding: nn.Embedding) -> float | torch.Tensor | None:
    """The factor an `nn.Embedding` subclass multiplies its output by, as the vocabulary-split layer must too: None
    for a plain `nn.Embedding`; transformers' scaled word embeddings (Gemma's; `forward` returns the lookup times
    `embed_scale`) give theirs, a 0-d tensor where they multiply by a tensor cast to the table's dtype, else the
    float. Any other subclass that overrides `forward` is refused: splitting it would drop what its forward adds."""
    if type(embedding).forward is nn.Embedding.forward:
        return None
    scale = getattr(embedding, "embed_scale", None)
    if torch.is_tensor(scale):  # a buffer a meta model may not hold yet: its value is the scalar it was made from
        return torch.tensor(embedding.scalar_embed_scale if hasattr(embedding, "scalar_embed_scale") else scale.item())
    if isinstance(scale, (int, float)):
        return float(scale)
    raise TensorParallelError(f"{type(embedding).__name__} overrides nn.Embedding's forward, which a vocabulary-split "
                              "embedding would drop; leave it whole (no tensor parallelism for it)")


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


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm, axis: Axis = Axis.TP,
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

@torch.no_grad()
def gather_full(value: torch.Tensor, dim: int | None, comm: Comm, axis: Axis) -> torch.Tensor:
    """The whole tensor from this rank's slice split along `dim` over `axis` (a copy; None: not split)."""
    return value.detach().clone() if dim is None else _all_gather(value.detach(), dim, comm, axis)


def tp_rng(mesh, seed: int, name: str, *, sharded: bool, axis: Axis = Axis.TP, device="cpu") -> torch.Generator:
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
