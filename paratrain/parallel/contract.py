"""The contract of a parallel model: what the trainer (`paratrain.train`) and the run (`paratrain.run`) may call.

`paratrain.parallel.model.ParallelModel` is the implementation; this module says what of it
the outside sees, as `paratrain.parallel.data.engine.Engine` says what the model sees of an
engine. The engine, the communication layer and the loss scaler are not part of it: the
model's own methods answer what the outside needs of them (the masters a checkpoint saves,
the loss scaler's state, which copy of a tensor this rank owns), so that a strategy can change
how it keeps them without the trainer noticing. `tests/meta/test_architecture.py` checks that no
module outside `paratrain.parallel` reaches past the contract into `.engine`, `.comm` or
`.scaler`.

The communication layer (`paratrain.comm.Comm`: its counters of bytes and blocked seconds,
its listeners) belongs to whoever builds the model: the trainer makes one per run, hands it to
`parallelize` and reads it for its metrics, its step timer and its guard. A model does not
hand out its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

IGNORE_INDEX = -100
# loss_fn(output, labels) -> the sum of the per-token losses (a 0-d tensor): the default is cross-entropy.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepResult:
    """What the forward and backward passes of one step left behind, on the device (no host sync)."""

    # Σ token losses of this data rank's micro-batches (fp64). Under pipeline parallelism only the last
    # stage computes it: the other stages hold 0 until the step is agreed, when the agreement has
    # brought the last stage's sum to every stage (written here then; read it after optimizer.step()).
    loss_sum: torch.Tensor
    nonfinite: torch.Tensor  # this rank computed a non-finite loss itself (bool)


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on for this step, from the same numbers."""

    skip: bool  # no parameter moves: fp16 overflow, or a non-finite loss or gradient on some rank
    overflow: bool  # fp16 gradients overflowed (the loss scaler backs off); not counted as a bad step
    nonfinite_ranks: tuple[int, ...]  # the ranks behind a non-finite loss (else gradient); empty if none
    stop: bool  # some rank asked to stop after this step (SIGTERM)
    loss_sum: float  # Σ over the data ranks of their token-loss sums
    grad_norm: float  # the global gradient norm over every shard and stage, before clipping
    sums: dict[str, float] = field(default_factory=dict)  # the caller's counts, summed over the data ranks
    per_rank: dict[str, tuple[float, ...]] = field(default_factory=dict)  # the same, rank by rank


@runtime_checkable
class TrainableModel(Protocol):
    """What the trainer and `paratrain.run` call on a parallel model (`ParallelModel`), in the order of a step."""

    module: nn.Module
    """The user's module as this rank holds it (its stages, its tensor-parallel slices, under ZeRO-3 its rows)."""

    tp_info: object | None
    """The tensor-parallel facts (which parameters are split, their global shapes); None without tp."""

    pipeline: object | None
    """This rank's pipeline stages (their `split` names every parameter's stage); None without pp."""

    @property
    def mesh(self):
        """The process mesh the model is laid out on."""

    @property
    def device(self) -> torch.device:
        """Where this rank computes."""

    # -- one step (see `paratrain.parallel.model` for what each does) ---------------------------------
    def loss_fn(self, output, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                reduction: str = "sum") -> torch.Tensor:
        """The default token-loss sum: cross-entropy, vocab-parallel where tensor parallelism shards the logits."""

    def comm_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed in place over the data ranks."""

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], normalizer,
                   loss_fn: LossFn | None = None) -> StepResult:
        """Forward and backward of this data rank's micro-batches."""

    def finish_gradients(self) -> None:
        """Gradient communication done; the masters hold the final gradients."""

    def grads(self) -> list[torch.Tensor]:
        """This rank's final gradients, as the agreement and clipping read them (on the device, offload or not)."""

    def agree(self, result: StepResult | None = None, *, stop: bool = False,
              counts: dict[str, float] | None = None) -> Verdict:
        """The step's one mesh-wide all-reduce and host read: skip, stop, loss, norm, counts."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the agreed global norm (no collective)."""

    # -- evaluation and whole-model views ----------------------------------------------------------
    def train(self, mode: bool = True): ...

    def eval(self): ...

    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn | None = None) -> torch.Tensor:
        """Token-loss sum of one batch without gradients."""

    def causal_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits for generation, on every rank."""

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's whole shape, by name."""

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter whole, one at a time (collective)."""

    # -- checkpoints, the guard, the metrics ------------------------------------------------------------
    def masters(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps, in a fixed order."""

    def master_rows(self) -> list[tuple[str, tuple[int, int], torch.Size]]:
        """Per master: parameter name, the rows it holds, the parameter's shape on this rank."""

    def replicated_over(self, name: str, *, at_rest: bool = False) -> tuple[str, ...]:
        """The axes along which ranks hold equal copies of a parameter's master (or, at rest, of the parameter)."""

    def whole_name(self, name: str) -> str:
        """The whole model's name of this rank's parameter `name` (a tied head's copy goes by its embedding's)."""

    def parameters_from_masters(self) -> None:
        """The parameters brought up to date with masters written from outside (a loaded checkpoint)."""

    def loss_scale_state(self) -> dict:
        """The fp16 loss scaler's state, for a checkpoint."""

    def load_loss_scale_state(self, state: dict) -> None:
        """Restore `loss_scale_state`."""

    @property
    def skipped_steps(self) -> int:
        """Steps the fp16 loss scaler skipped (overflow)."""


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors (Adam's moments), not counting scalar step counters."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
