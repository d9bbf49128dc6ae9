"""Mixed precision: which dtype computes, which reduces gradients, which holds the master weights.

The model's parameters are stored in ``param_dtype`` and the forward and
backward run in it (floating-point inputs are cast to it where the model's
forward, or a pipeline stage's, begins: `Precision.cast_inputs`); gradients are communicated in ``reduce_dtype``; the
optimizer updates fp32 master weights (for ``fp32`` the parameters themselves
are the master copy). fp16's narrow range needs dynamic loss scaling:
:class:`LossScaler` multiplies the loss, skips a step whose gradients hold
inf/nan on any rank, and adapts the scale. Whatever the compute dtype, the loss is taken in at
least fp32 (`cross_entropy`): bf16 would keep fewer than three significant digits of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paratrain.errors import ParatrainError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ParatrainError, ValueError):
    """An unknown precision or reduce dtype."""


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy."""

    name: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        """Whether the optimizer needs a separate fp32 master copy of the parameters."""
        return self.param_dtype != self.master_dtype

    @property
    def needs_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16

    def cast_inputs(self, value):
        """`value` with each floating-point tensor in it (nested in tuples, lists, dicts) in the compute dtype.

        A module whose weights are in `param_dtype` cannot multiply an fp32 input (`mat1 and mat2
        must have the same dtype`): inputs are cast where the forward begins, as FSDP2's
        `MixedPrecisionPolicy(cast_forward_inputs=True)` does. Integer and boolean tensors (token ids, masks)
        and other values are left as they are; under fp32 nothing is cast.
        """
        return _cast_floats(value, self.param_dtype) if self.mixed else value


def _cast_floats(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _cast_floats(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_cast_floats(item, dtype) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple by field
    return value


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "sum") -> torch.Tensor:
    """`F.cross_entropy` of logits [.., V] against targets [..], computed in at least fp32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss


def precision_policy(name: str = "fp32", reduce_dtype: str | None = None) -> Precision:
    """fp32, bf16 or fp16 compute; gradients reduced in `reduce_dtype` (default: fp32)."""
    if name not in DTYPES:
        raise PrecisionError(f"--precision {name!r} is not one of {list(DTYPES)}")
    if reduce_dtype is not None and reduce_dtype not in DTYPES:
        raise PrecisionError(f"--reduce-dtype {reduce_dtype!r} is not one of {list(DTYPES)}")
    reduce = DTYPES[reduce_dtype] if reduce_dtype else torch.float32
    return Precision(name=name, param_dtype=DTYPES[name], reduce_dtype=reduce)


class LossScaler:
    """Dynamic loss scaling: back off on overflow, grow after `growth_interval` clean steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after a step (found_inf must already agree across ranks)."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.skipped_steps = state["scale"], state["clean_steps"], state["skipped_steps"]
