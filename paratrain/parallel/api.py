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
import functools
import math
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.comm import Comm
from paratrain.mesh import Mesh
from paratrain.parallel.data import DataParallelEngine
from paratrain.parallel.tensor import cross_entropy, gather_full, tp_norm_sq
from paratrain.parallel.tp_plan import LLAMA_SP_PLAN, LLAMA_TP_PLAN, TensorParallelInfo, apply_tensor_parallel
from paratrain.precision import LossScaler, Precision, precision_policy

ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adadelta)


class ParallelConfigError(ValueError):
    """parallelize() was asked for something it cannot do; the message says what instead."""


class ParallelModel(nn.Module):
    """The user's module under a data-parallel engine; call it like the module itself."""

    def __init__(self, module: nn.Module, engine, comm: Comm, precision: Precision,
                 tp_info: TensorParallelInfo | None = None):
        super().__init__()
        self.module = module
        self.engine = engine
        self.comm = comm
        self.precision = precision
        self.tp_info = tp_info
        self.scaler = LossScaler(enabled=precision.needs_loss_scaling)
        self._found_inf = False
        self._grads_ready = False

    def forward(self, *args, **kwargs):
        self._grads_ready = False
        return self.module(*args, **kwargs)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                reduction: str = "sum") -> torch.Tensor:
        """Cross-entropy of this model's logits (fp32): vocab-parallel when tensor parallelism shards them."""
        if self.tp_info is not None:
            return self.tp_info.loss_fn(logits, targets, ignore_index, reduction)
        return cross_entropy(logits, targets, ignore_index, reduction)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (all-gathered over tp when the model shards them; collective)."""
        info = self.tp_info
        if info is None or not info.vocab_sharded_logits:
            return logits
        return gather_full(logits, logits.dim() - 1, info.comm, info.axis)

    @torch.no_grad()
    def causal_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits of a causal model for token ids of any length (for generation).

        Sequence parallelism needs a length divisible by tp: the ids are padded on the right,
        which a causal model's earlier positions never see, and the padded positions dropped.
        """
        length = tokens.shape[1]
        if self.tp_info is not None and self.tp_info.sequence_parallel:
            pad = -length % self.comm.mesh.size(self.tp_info.axis)
            tokens = F.pad(tokens, (0, pad))
        return self.full_logits(self(tokens))[:, :length]

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
        self._reduce_sequence_partial_grads()
        self._found_inf = False
        if self.scaler.enabled:
            flag = torch.zeros((), device=self._device())
            for master in self.engine.masters():
                if master.grad is not None:
                    master.grad.div_(self.scaler.scale)
                    flag += (~torch.isfinite(master.grad)).any().float()
            self.comm.all_reduce_mesh(flag)
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
        if self.tp_info is None:
            sq = self.engine.local_grad_sq_sum()
        else:  # tp-sharded gradients summed over tp, replicated ones counted once
            named = zip(self.engine.master_names(), self.engine.masters())
            sq = tp_norm_sq(((n, m.grad) for n, m in named if m.grad is not None), self.tp_info)
        if self.engine.grads_sharded:
            self.comm.all_reduce(sq, "dp")
        self.comm.all_reduce(sq, "pp")  # each stage holds other layers
        norm = math.sqrt(sq.item())
        if math.isfinite(norm) and max_norm < math.inf and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for master in self.engine.masters():
                if master.grad is not None:
                    master.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def _reduce_sequence_partial_grads(self) -> None:
        """Under sequence parallelism, sum over tp the grads that each tp rank computed from its sequence shard.

        Done here, on the master gradients after the data-parallel reduction, rather than by hooks
        on the parameters: under ZeRO-3 the parameters autograd sees are transient gathered views,
        and the sum is linear, so reducing over dp first and tp second gives the same gradient.
        """
        if self.tp_info is None or not self.tp_info.sequence_partial:
            return
        wanted = set(self.tp_info.sequence_partial)
        self.comm.all_reduce_coalesced([m.grad for n, m in zip(self.engine.master_names(), self.engine.masters())
                                        if n in wanted and m.grad is not None], self.tp_info.axis)

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
            state = self.engine.full_state_dict()
        else:  # below ZeRO-3 every data rank holds its parameters whole
            state = {slot.name: slot.param.detach() for slot in self.engine.slots}
        if self.tp_info is not None:
            state = {name: self.tp_info.gather(name, value) for name, value in state.items()}
        return state

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
                tp_plan: Mapping | None = None, sequence_parallel: bool = False, schedule: str = "1f1b",
                virtual_stages: int = 1, stage_boundaries: list[int] | None = None,
                units=None, init: Callable | None = None, device=None, comm: Comm | None = None):
    """Wrap `model` for the mesh; return (model, optimizer) (optimizer None if no factory was given).

    optimizer: a factory called with the master tensors (e.g. partial(AdamW, lr=3e-4)); ZeRO
        needs an element-wise optimizer.
    zero: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters), over the dp axis.
    precision: "fp32", "bf16" or "fp16" compute, fp32 master weights; reduce_dtype: gradient
        communication dtype (default fp32).
    activation_checkpointing: 0 off, k > 0 recompute every k-th block.
    grad_reduction: "mean" averages gradients over data ranks (the DDP convention); "sum"
        when the loss is already normalized over the global batch.
    tp_plan: module-name pattern → tensor-parallel style (see `paratrain.parallel.tp_plan`), applied
        over the tp axis; None with tp > 1 takes the reference model's plan (`LLAMA_TP_PLAN`, or
        `LLAMA_SP_PLAN` with `sequence_parallel`). With tensor parallelism use `model.loss_fn`:
        the logits are sharded along the vocabulary.
    schedule / virtual_stages / stage_boundaries: with pp > 1 the model (paratrain's Transformer or
        an nn.Sequential) is split into pp × virtual_stages stages, balanced by parameter count
        unless `stage_boundaries` (first layer of each later stage) are given, and the returned
        `PipelineModel` runs whole steps (`train_step`) by the schedule ("gpipe", "1f1b",
        "interleaved", "zb-h1").
    units / init: ZeRO-3 wrapping units and the initializer `init(name, full_shape)` of a model
        built on the meta device (each rank then materializes only its slices).
    device: where a meta model is materialized (default: torch's default device).
    """
    policy = precision if isinstance(precision, Precision) else precision_policy(precision, reduce_dtype)
    if zero not in (0, 1, 2, 3):
        raise ParallelConfigError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    comm = comm or Comm(mesh)
    split = None
    # 1. Pipeline split first: a rank keeps only its stages' layers (still on meta when built
    #    there), and everything after works on that smaller module under the same names.
    if mesh.size("pp") > 1:
        split = _split_pipeline(model, mesh, zero, virtual_stages, stage_boundaries)
        model = split.module
    elif virtual_stages != 1:
        raise ParallelConfigError("--virtual-stages needs pipeline parallelism (--pp > 1)")
    if init is None and any(p.is_meta for p in model.parameters()):
        init = _default_init(model)
    tp_info = None
    # 2. Tensor parallelism next: it swaps modules for twins holding this rank's slices, and
    #    everything after (recomputation, gradient buckets, ZeRO shards) must see those slices.
    if mesh.size("tp") > 1 or tp_plan is not None:
        tp_info, init = _apply_tensor_parallel(model, mesh, comm, tp_plan, sequence_parallel, init,
                                               materialize=zero < 3, device=device, whole_model=split is None)
        if split is not None and sequence_parallel:
            from paratrain.parallel.stages import sequence_parallel_boundaries

            tp_info.handles += sequence_parallel_boundaries(split, comm, tp_info.axis)
    elif sequence_parallel:
        raise ParallelConfigError("--sequence-parallel needs tensor parallelism (--tp > 1)")
    if zero < 3:
        _materialize(model, init, device)
    # 3. Activation checkpointing next: ZeRO-3 gathers parameters in forward hooks, and
    #    recomputation must pass through those hooks to find whole parameters again.
    if activation_checkpointing:
        checkpoint_blocks(model, every=activation_checkpointing)
    # 4. The data-parallel engine last: it sees the final parameters it has to reduce.
    if zero == 3:
        from paratrain.parallel.zero3 import FullyShardedEngine

        engine = FullyShardedEngine(model, mesh, comm, policy, units=units, init=init,
                                    grad_reduction=grad_reduction)
    else:
        engine = DataParallelEngine(model, mesh, comm, policy, stage=zero, bucket_mb=bucket_mb,
                                    grad_reduction=grad_reduction)
    wrapped = ParallelModel(model, engine, comm, policy, tp_info)
    if optimizer is not None:
        opt = optimizer(engine.masters())
        if zero > 0 and not isinstance(opt, ELEMENTWISE_OPTIMIZERS):
            raise ParallelConfigError(
                f"ZeRO shards optimizer state element by element, which {type(opt).__name__} does not allow; "
                f"use zero=0 or one of {[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}")
        opt.register_step_pre_hook(wrapped._before_step)
        opt.register_step_post_hook(wrapped._after_step)
    if split is not None:
        from paratrain.parallel.pipeline import PipelineModel

        # Built last: a stage's shell shares the modules the steps above may have replaced.
        wrapped = PipelineModel(wrapped, split, schedule, mesh)
    return wrapped, (opt if optimizer is not None else None)


def _split_pipeline(model: nn.Module, mesh: Mesh, zero: int, virtual_stages: int, boundaries):
    from paratrain.parallel.stages import split_for_pipeline

    if zero == 3:
        raise ParallelConfigError(
            "--zero 3 with --pp > 1 is refused: ZeRO-3 would all-gather every stage's parameters for each "
            "micro-batch's forward and again for its backward (4·m gathers per step) and could not defer its "
            "gradient reduce-scatter across micro-batches; use --zero 1 or 2, which shard the optimizer state")
    return split_for_pipeline(model, mesh.size("pp"), mesh.coord("pp"), virtual_stages, boundaries)


def _default_init(model: nn.Module):
    """The initializer of a model built on the meta device without one: its own `param_init`, seed 0."""
    if not hasattr(model, "param_init"):
        raise ParallelConfigError(f"{type(model).__name__} is on the meta device: pass "
                                  "init=(name, full_shape) -> full fp32 tensor")
    return functools.partial(model.param_init, seed=0)


@torch.no_grad()
def _materialize(model: nn.Module, init, device) -> None:
    """Give a meta model real storage on `device`, each parameter filled with `init(name, shape)`."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device or torch.get_default_device())
    for name, param in model.named_parameters():
        param.copy_(init(name, param.shape))


def _apply_tensor_parallel(model: nn.Module, mesh: Mesh, comm: Comm, plan, sequence_parallel: bool,
                           init, materialize: bool, device, whole_model: bool):
    """Apply the plan; return its info and the initializer the data-parallel engine gets next.

    A meta model is materialized here, slice by slice, unless ZeRO-3 follows: then the modules
    stay on meta and ZeRO-3 gets an initializer of tp-local shapes (the slice of the full init),
    so no rank ever holds more than its tp × dp share of a layer.
    """
    if plan is None:
        from paratrain.models import Transformer

        if not isinstance(model, Transformer):
            raise ParallelConfigError(f"tensor parallelism needs a plan for {type(model).__name__}: pass "
                                      "tp_plan={module pattern: style} (see paratrain.parallel.tp_plan)")
        plan = LLAMA_SP_PLAN if sequence_parallel else LLAMA_TP_PLAN
    on_meta = any(p.is_meta for p in model.parameters())
    info = apply_tensor_parallel(model, plan, mesh, comm, sequence_parallel=sequence_parallel,
                                 init=init if on_meta and materialize else None, device=device,
                                 sp_grad_hooks=False,  # ParallelModel reduces those grads itself
                                 strict=whole_model)  # a pipeline stage lacks the other stages' modules
    if not on_meta or materialize:
        return info, None
    return info, functools.partial(_tp_local_init, init, info)


def _tp_local_init(init, info: TensorParallelInfo, name: str, local_shape) -> torch.Tensor:
    """This tp rank's slice of `init(name, global shape)`."""
    shape, offset = info.global_shape(name, local_shape)
    full = init(name, shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]


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
