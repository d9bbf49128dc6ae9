"""parallelize(): apply paratrain's strategies to a plain module, in one fixed order.

    mesh = paratrain.init_mesh(dp=4)
    model, optimizer = paratrain.parallelize(model, mesh, optimizer=partial(torch.optim.AdamW, lr=3e-4), zero=3)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()

The returned optimizer is the stock torch optimizer the caller asked for,
built over the master weights the engine owns (ZeRO: this rank's shard); two
step hooks connect it to the engine: before the step, gradient communication
is finished (and fp16 gradients unscaled and checked); after it, the model's
parameters are brought up to date (ZeRO: all-gather of updated shards).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.comm import Comm
from paratrain.mesh import Mesh
from paratrain.parallel.data import DataParallelEngine
from paratrain.precision import LossScaler, Precision, precision_policy

ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adadelta)


class ParallelConfigError(ValueError):
    """parallelize() was asked for something it cannot do; the message says what instead."""


class ParallelModel(nn.Module):
    """The user's module under a data-parallel engine; call it like the module itself."""

    def __init__(self, module: nn.Module, engine, comm: Comm, precision: Precision):
        super().__init__()
        self.module = module
        self.engine = engine
        self.comm = comm
        self.precision = precision
        self.scaler = LossScaler(enabled=precision.needs_loss_scaling)
        self._found_inf = False
        self._grads_ready = False

    def forward(self, *args, **kwargs):
        self._grads_ready = False
        return self.module(*args, **kwargs)

    def comm_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the data ranks (for losses and token counts); returns it."""
        self.comm.all_reduce(tensor, "dp")
        return tensor

    def no_sync(self):
        """Gradient accumulation: backward passes inside only accumulate locally."""
        return self.engine.no_sync()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply by the fp16 loss scale before backward (identity for fp32 and bf16)."""
        return self.scaler.scale_loss(loss)

    def finish_gradients(self) -> bool:
        """Finish gradient communication, unscale fp16 gradients; return whether any rank saw inf/nan."""
        if self._grads_ready:
            return self._found_inf
        self.engine.finish_grad_sync()
        self._found_inf = False
        if self.scaler.enabled:
            flag = torch.zeros((), device=self._device())
            for master in self.engine.masters():
                if master.grad is not None:
                    master.grad.div_(self.scaler.scale)
                    flag += (~torch.isfinite(master.grad)).any().float()
            self.comm.all_reduce(flag, "dp")
            self._found_inf = bool(flag.item() > 0)
        self._grads_ready = True
        return self._found_inf

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global gradient norm over all shards; returns the norm before clipping.

        Each rank sums the squares of the gradients it owns; for sharded
        gradients (ZeRO) those sums are all-reduced, so the norm equals the
        norm of the unsharded gradient.
        """
        self.finish_gradients()
        sq = self.engine.local_grad_sq_sum()
        if self.engine.grads_sharded:
            self.comm.all_reduce(sq, "dp")
        norm = math.sqrt(sq.item())
        if math.isfinite(norm) and max_norm < math.inf and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for master in self.engine.masters():
                if master.grad is not None:
                    master.grad.mul_(coef)
        return norm

    def _before_step(self, *_):
        if self.finish_gradients():
            for master in self.engine.masters():
                master.grad = None  # every rank skips this step: no parameter moves

    def _after_step(self, *_):
        self.scaler.update(self._found_inf)
        self.engine.after_step()
        self._grads_ready = False

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on every rank (collective under ZeRO-3)."""
        if hasattr(self.engine, "full_state_dict"):
            return self.engine.full_state_dict()
        # Below ZeRO-3 every rank holds every parameter whole.
        return {slot.name: slot.param.detach() for slot in self.engine.slots}

    def resident_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes of model state on this rank, from the tensors that exist: params, grads, master, optimizer."""
        result = dict(self.engine.resident_bytes())
        result["optimizer"] = optimizer_state_bytes(optimizer) if optimizer is not None else 0
        result["total"] = sum(result.values())
        return result

    def _device(self) -> torch.device:
        return self.engine.masters()[0].device


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors (Adam's moments), not counting scalar step counters."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


def parallelize(model: nn.Module, mesh: Mesh, optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] | None = None,
                zero: int = 0, precision: str | Precision = "fp32", reduce_dtype: str | None = None,
                activation_checkpointing: int = 0, bucket_mb: float = 25.0, grad_reduction: str = "mean",
                units=None, init: Callable | None = None, comm: Comm | None = None):
    """Wrap `model` for the mesh; return (model, optimizer) (optimizer None if no factory was given).

    optimizer: a factory called with the master tensors (e.g. partial(AdamW, lr=3e-4)); ZeRO
        needs an element-wise optimizer.
    zero: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters).
    precision: "fp32", "bf16" or "fp16" compute, fp32 master weights; reduce_dtype: gradient
        communication dtype (default fp32).
    activation_checkpointing: 0 off, k > 0 recompute every k-th block.
    grad_reduction: "mean" averages gradients over data ranks (the DDP convention); "sum"
        when the loss is already normalized over the global batch.
    units / init: ZeRO-3 wrapping units and parameter initializer (see FullyShardedEngine).
    """
    policy = precision if isinstance(precision, Precision) else precision_policy(precision, reduce_dtype)
    if zero not in (0, 1, 2, 3):
        raise ParallelConfigError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    comm = comm or Comm(mesh)
    # 1. Activation checkpointing first: ZeRO-3 gathers parameters in forward hooks, and
    #    recomputation must pass through those hooks to find whole parameters again.
    if activation_checkpointing:
        checkpoint_blocks(model, every=activation_checkpointing)
    # 2. The data-parallel engine last: it sees the final parameters it has to reduce.
    if zero == 3:
        from paratrain.parallel.zero3 import FullyShardedEngine

        engine = FullyShardedEngine(model, mesh, comm, policy, units=units, init=init,
                                    grad_reduction=grad_reduction)
    else:
        engine = DataParallelEngine(model, mesh, comm, policy, stage=zero, bucket_mb=bucket_mb,
                                    grad_reduction=grad_reduction)
    wrapped = ParallelModel(model, engine, comm, policy)
    if optimizer is None:
        return wrapped, None
    opt = optimizer(engine.masters())
    if zero > 0 and not isinstance(opt, ELEMENTWISE_OPTIMIZERS):
        raise ParallelConfigError(
            f"ZeRO shards optimizer state element by element, which {type(opt).__name__} does not allow; "
            f"use zero=0 or one of {[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}")
    opt.register_step_pre_hook(wrapped._before_step)
    opt.register_step_post_hook(wrapped._after_step)
    return wrapped, opt


def block_lists(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the children of its ModuleLists and ModuleDicts."""
    blocks = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks.extend(module.children() if isinstance(module, nn.ModuleList) else module.values())
    return blocks


def checkpoint_blocks(model: nn.Module, every: int = 1) -> int:
    """Recompute every `every`-th block's activations in backward instead of storing them.

    The block's class is swapped for a subclass whose call runs under
    torch.utils.checkpoint, so parameter names (and checkpoints) do not change.
    Returns the number of checkpointed blocks.
    """
    if every < 1:
        raise ParallelConfigError(f"--activation-checkpointing must be ≥ 1 (every k-th block), got {every}")
    chosen = block_lists(model)[::every]
    for block in chosen:
        block.__class__ = _checkpointed_class(type(block))
    return len(chosen)


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if getattr(cls, "_paratrain_checkpointed", False):
        return cls
    if cls not in _CHECKPOINTED:
        def __call__(self, *args, **kwargs):
            if not torch.is_grad_enabled():
                return nn.Module.__call__(self, *args, **kwargs)
            return checkpoint(nn.Module.__call__, self, *args, use_reentrant=False, **kwargs)

        _CHECKPOINTED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_paratrain_checkpointed": True})
    return _CHECKPOINTED[cls]


@contextlib.contextmanager
def maybe_no_sync(model: nn.Module, enabled: bool):
    """model.no_sync() when it is a ParallelModel and `enabled`; otherwise nothing."""
    if enabled and isinstance(model, ParallelModel):
        with model.no_sync():
            yield
    else:
        yield
