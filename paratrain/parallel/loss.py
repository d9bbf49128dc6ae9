"""The loss with the output head fused in: the head's matmul and the cross-entropy in chunks of tokens.

A micro-batch's logits are its largest activation: b·s·V numbers, taken in fp32 for the softmax (Llama 3's
128,256-token vocabulary makes one micro-batch of 2 × 8,192 tokens 8.4 GB of fp32 logits, and its backward as
much again). A fused head never holds them whole (as Liger's fused linear cross-entropy and Apple's Cut
Cross-Entropy do, here in plain PyTorch):

- forward, per chunk of c tokens: z = x_c Wᵀ (+ b) in the compute dtype, upcast to fp32, its log-sum-exp and
  its target logit kept (two floats per token), z freed;
- backward, per chunk: z recomputed, softmax = exp(z − lse), minus the one-hot target, times the token's
  gradient (fp32, as `precision.cross_entropy`'s backward), cast to the compute dtype; dX_c = g W is complete
  for its tokens; dW += gᵀ x_c, one addmm per chunk into a gradient in W's dtype (as Liger accumulates: an
  fp32 accumulator would add V·D·4 bytes at the step's peak).

Under vocabulary-parallel tensor parallelism (rank r holds rows r·V/t … of W: `OutputHead`) each rank takes the
log-sum-exp over its vocabulary shard chunk by chunk, and the shards' are combined once per micro-batch: the max
(an all-reduce MAX of N floats), then Σ_r exp(lse_r − m) with the target logit (only the rank holding the target
has it) in one all-reduce SUM of 2N: the two all-reduces of `vocab_parallel_cross_entropy`, never the logits.

Memory: c·V/t·(p + 4) bytes in forward and c·V/t·(4 + p) in backward at most (p the compute dtype's size),
instead of N·V/t·4 kept from forward to backward and twice that in backward. Cost: the head's matmul runs once
more in backward (4 × 2·N·D·V/t FLOPs instead of 3).

`FusedHead` puts the function in a model: the module whose output is the logits (`head_name`: the one a model's
`get_output_embeddings()` returns, as Hugging Face models and paratrain's Transformer have, or the last layer of an
`nn.Sequential`) computes the loss instead while its caller has armed it with the labels (`FusedHead.targets`),
inside the head's own forward: so ZeRO-3 gathers its weight there, tensor parallelism enters its region, and a
pipeline's last stage runs it as it runs the head. Unarmed, the head computes its logits as before.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.comm import Comm
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis
from paratrain.parallel.rules import DEFAULT_LOSS_CHUNK
from paratrain.parallel.tensor.layers import ColumnParallelLinear
from paratrain.parallel.tensor.primitives import enter_tp_region

LOGIT_SOFTCAP_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


class LossChunkError(ParatrainError, ValueError):
    """A fused loss that cannot be: the message names the model's head and the fix."""


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of x Wᵀ (+ b) against targets, in chunks of `chunk` tokens (see the module)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, ignore_index: int, chunk: int, vocab_start: int,
                comm: Comm | None, axis: Axis | None):
        local_vocab = weight.shape[0]
        ignored = targets == ignore_index
        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < local_vocab) & ~ignored
        local_target = local_target.masked_fill(~here, 0)
        lse = torch.empty(x.shape[0], dtype=torch.float32 if x.dtype != torch.float64 else x.dtype, device=x.device)
        target_logit = torch.empty_like(lse)
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = _logits(x[rows], weight, bias, lse.dtype)
            target_logit[rows] = z.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1)
            top = z.max(dim=-1).values
            lse[rows] = top + z.sub_(top.unsqueeze(-1)).exp_().sum(-1).log_()  # in place: no second chunk
            del z
        target_logit.masked_fill_(~here, 0.0)
        if comm is not None:  # the shards' log-sum-exps combined: max, then Σ exp(lse_r − m) with the target logit
            top = lse.clone()
            comm.all_reduce(top, axis, op=dist.ReduceOp.MAX)
            sums = torch.stack([(lse - top).exp_(), target_logit])
            comm.all_reduce(sums, axis)
            lse, target_logit = top + sums[0].log(), sums[1]
        ctx.chunk = chunk
        ctx.save_for_backward(x, weight, bias, lse, local_target, here, ignored)
        return (lse - target_logit).masked_fill_(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, bias, lse, local_target, here, ignored = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        row_grad = grad_loss.masked_fill(ignored, 0.0).to(lse.dtype)
        target_grad = row_grad.masked_fill(~here, 0.0)
        grad_x = torch.empty_like(x) if need_x else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_bias else None
        for start in range(0, x.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            z = _logits(x[rows], weight, bias, lse.dtype)
            # softmax × the token's gradient, minus it at the target: the fp32 gradient of the logits
            z.sub_(lse[rows].unsqueeze(-1)).exp_().mul_(row_grad[rows].unsqueeze(-1))
            z.scatter_add_(-1, local_target[rows].unsqueeze(-1), -target_grad[rows].unsqueeze(-1))
            grad = z.to(x.dtype)
            del z
            if need_x:
                grad_x[rows] = grad @ weight
            if need_weight:
                grad_weight.addmm_(grad.t(), x[rows])
            if need_bias:
                grad_bias += grad.sum(0, dtype=grad_bias.dtype)
            del grad  # before the next chunk's logits: one chunk's at a time
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


def _logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits in the compute dtype, then in `dtype` (fp32; the same tensor when it is already)."""
    return F.linear(x, weight, bias).to(dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100,
                         chunk: int = DEFAULT_LOSS_CHUNK, reduction: str = "sum", vocab_start: int = 0,
                         comm: Comm | None = None, axis: Axis | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias), targets)` without the whole logits: chunks of `chunk` tokens.

    hidden [.., D] in the compute dtype; weight [V, D] (or this rank's rows [V/t, D] starting at vocabulary id
    `vocab_start`, the shards' loss combined over `axis` of `comm`); targets [..]. The loss is taken in fp32
    (fp64 for fp64 inputs); reduction "sum", "mean" over the targets not ignored, or "none" (per token).
    Value and gradients equal the unfused loss's (within float rounding).
    """
    if reduction not in ("sum", "mean", "none"):
        raise LossChunkError(f"reduction={reduction!r} is invalid; use 'sum', 'mean' or 'none'")
    if chunk < 1:
        raise LossChunkError(f"--loss-chunk must be a positive number of tokens here, got {chunk}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] != targets.numel():
        raise LossChunkError(f"the head saw {flat.shape[0]} tokens but the labels hold {targets.numel()}; "
                             "give labels of the inputs' shape, or --loss-chunk 0")
    loss = _LinearCrossEntropy.apply(flat, weight, bias, targets.reshape(-1), ignore_index, chunk, vocab_start,
                                     comm, axis)
    if reduction == "none":
        return loss.view(targets.shape)
    if reduction == "mean":
        return loss.sum() / (targets != ignore_index).sum()
    return loss.sum()


# -- the head of a model ----------------------------------------------------------------------------------

def head_name(model: nn.Module) -> tuple[str | None, str]:
    """(the qualified name of the module whose output is `model`'s logits, None when there is none that can be
    fused; why not, in one line).

    The head is what `model.get_output_embeddings()` returns (Hugging Face's convention; paratrain's Transformer
    follows it), or an `nn.Sequential`'s last layer; it must be an `nn.Linear`. A model that scales or caps its
    logits after the head (Gemma 2's soft-capping, Cohere's logit scale) is refused: the fused loss would miss it.
    """
    # the model's config, or the transformers config of a model that wraps one (`models.hf.HFCausalLM`)
    configs = [getattr(model, "config", None), getattr(getattr(model, "hf", None), "config", None)]
    for field in LOGIT_SOFTCAP_FIELDS:
        if any(getattr(config, field, None) not in (None, 0, 1, 1.0) for config in configs):
            return None, f"{type(model).__name__} transforms its logits after the head ({field})"
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        head = get_head()
        name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    elif isinstance(model, nn.Sequential) and len(model):
        name = next(reversed(model._modules))
        head = model._modules[name]
    else:
        return None, (f"{type(model).__name__} names no output head (a get_output_embeddings() method, as Hugging "
                      "Face models and paratrain's Transformer have, or the last layer of an nn.Sequential)")
    if name is None:
        return None, f"{type(model).__name__}.get_output_embeddings() gives no module of the model"
    if type(head) is not nn.Linear:
        return None, f"the output head {name} is a {type(head).__name__}, not an nn.Linear"
    return name, ""


def loss_head_name(model: nn.Module, loss_chunk: int | None) -> tuple[str | None, int]:
    """`parallelize(loss_chunk=...)`: (the name of the head the loss fuses into or None, the chunk in tokens); a chunk
    asked for a model whose head cannot be fused is refused in one line."""
    if loss_chunk is not None and loss_chunk < 0:
        raise LossChunkError(f"--loss-chunk must be 0 (off) or a number of tokens, got {loss_chunk}")
    if loss_chunk == 0:
        return None, 0
    name, why = head_name(model)
    if name is None and loss_chunk is not None:
        raise LossChunkError(f"--loss-chunk {loss_chunk}: {why}; use --loss-chunk 0 (loss_chunk=0)")
    return name, loss_chunk or DEFAULT_LOSS_CHUNK


def fuse_head(model: nn.Module, name: str | None, chunk: int) -> FusedHead | None:
    """The fused loss over this rank's module `name` (None where the rank holds none: a pipeline stage before the
    last; or where FP8 converted it, as it does an nn.Sequential's last linear, a block: it keeps its FP8 matmul
    and whole logits, the head a transformer keeps outside its blocks staying in the compute dtype)."""
    module = dict(model.named_modules()).get(name) if name is not None else None
    if module is None or getattr(module, "fp8_recipe", None) is not None:
        return None
    return FusedHead(module, chunk)


class FusedHead:
    """A model's output head computing the loss in chunks (`linear_cross_entropy`) while armed with labels.

    Installed as the head module's forward (`module.forward`; the class, parameters and hooks stay). Unarmed it
    computes the logits as before. Armed (`targets`), its next forward returns the token-loss sum of its input
    against them (a 0-d fp32 tensor), which `take` recognizes in the model's output. A plain `nn.Linear` uses its
    whole weight; a `ColumnParallelLinear` (`OutputHead` under tensor parallelism) enters its tp region as its
    own forward does and takes the loss over its vocabulary rows, combined over tp.
    """

    def __init__(self, module: nn.Module, chunk: int, ignore_index: int = -100):
        self.module, self.chunk, self.ignore_index = module, chunk, ignore_index
        self._forward = module.forward
        self._targets: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        module.forward = self.forward

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor) -> Iterator[None]:
        """The head's forwards inside compute the loss against `labels` (the labels of its input's tokens)."""
        self._targets = labels
        try:
            yield
        finally:
            self._targets = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        targets, self._targets = self._targets, None  # one forward per arming
        if targets is None:
            return self._forward(x)
        head, comm, axis, start = self.module, None, None, 0
        weight = head.weight
        if isinstance(head, ColumnParallelLinear):
            if not head.input_entered:
                x = enter_tp_region(x, head.comm, head.axis, head.sequence_parallel)
            weight = weight.t() if head.transposed else weight
            comm, axis, start = head.comm, head.axis, head.tp_rank * weight.shape[0]
        self._loss = linear_cross_entropy(x, weight, targets, head.bias, ignore_index=self.ignore_index,
                                          chunk=self.chunk, vocab_start=start, comm=comm, axis=axis)
        return self._loss

    def take(self, output) -> torch.Tensor | None:
        """The loss the armed head returned, when `output` (the model's, or its `.logits`) is it; None when no armed
        forward ran. A model that changed its head's result before returning it is refused."""
        loss, self._loss = self._loss, None
        if loss is None:
            return None
        if getattr(output, "logits", output) is not loss:
            raise LossChunkError("the model changed its output head's result before returning it, which a fused loss "
                                 "cannot follow; use --loss-chunk 0 (loss_chunk=0)")
        return loss
