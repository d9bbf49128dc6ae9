"""One model type for every layout: the user's module under a data-parallel engine, tensor-parallel or not, a
pipeline stage or the whole model.

    model, optimizer = paratrain.parallelize(MyModel(), mesh, optimizer=partial(AdamW, lr=3e-4))
    result = model.train_step(micro_batches, num_tokens)     # 1. forward + backward of every micro-batch
    model.finish_gradients()                                 # 2. gradient communication done
    verdict = model.agree(result)                            # 3. one mesh-wide agreement: skip this step?
    model.clip_grad_norm_(1.0)                               # 4. clip by the agreed global norm
    optimizer.step(); optimizer.zero_grad()                  # 5. the step, then `after_step` (post-step hook)

What each step does:

1. `train_step`: each micro-batch's loss is its token-loss sum divided by the step's global token
   count; every backward but the last runs under `no_sync()`. With pipeline parallelism the
   schedule interleaves the micro-batches' passes instead (`pipeline.PipelineRunner`).
2. `finish_gradients`: the engine waits for its reductions and sets the master gradients; under sequence
   parallelism the partial gradients of replicated parameters are summed over tp; under pipeline parallelism
   those of the copies of a parameter several pipeline ranks hold (a tied head) over pp; fp16 ones unscaled.
3. `agree`: this rank's squared gradient norm is taken on the device (it is inf or nan exactly when a
   gradient is), then one all-reduce over every rank of the mesh carries each rank's flags (its own
   loss non-finite, its gradients non-finite, a stop request), the loss (a pipeline's from its last
   stage, so every stage learns it here), its share of the global squared norm, the caller's counts
   and the engine's per-master "used" flags (summed there: how many ranks reached each master), then
   one read to the host: the step's single host sync.
   Every rank takes the same decision from the same numbers: skip (fp16 overflow, or a
   non-finite loss or gradient anywhere) or not, stop after this step or not; and every rank
   knows the global gradient norm.
4. `clip_grad_norm_`: scales the gradients by the agreed norm: no collective, no host read (no kernel
   at all when the norm is within the bound, or when a fused AdamW's step applies the scale).
5. the optimizer steps the masters; `after_step` brings the parameters up to date and lets the
   fp16 loss scaler adapt.

A user's own loop (`loss.backward(); optimizer.step()`) gets the same sequence: the optimizer's
pre-step hook runs 2 and 3 when the caller did not (`prepare_step`), its post-step hook runs 5.
Nothing runs at the end of backward by itself.
"""

from __future__ import annotations

import contextlib
import math
from enum import Enum
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paratrain import compat
from paratrain.comm import Comm
from paratrain.mesh import PER_DATA_RANK, WORLD, Axis, replicated_over
from paratrain.parallel.context.split import unshard_sequence
from paratrain.parallel.contract import IGNORE_INDEX, LossFn, StepResult, Verdict, optimizer_state_bytes
from paratrain.parallel.data.engine import Engine, sum_of_squares_flat
from paratrain.parallel import whole
from paratrain.parallel.expert.sharding import moe_layers
from paratrain.parallel.loss import FusedHead
from paratrain.parallel.tensor.info import TensorParallelInfo, tp_norm_sq_parts
from paratrain.parallel.tensor.layers import gather_full
from paratrain.precision import LossScaler, Precision, cross_entropy

# The step's types live with the contract (`paratrain.parallel.contract`); importable from here as before.
__all__ = ["IGNORE_INDEX", "LossFn", "ParallelModel", "StepResult", "Verdict", "optimizer_state_bytes"]


class _Phase(Enum):
    """Where the step is: the one piece of state that keeps the optimizer hooks from repeating a stage."""

    BACKWARD = "backward"  # forward/backward passes; gradients not final
    FINISHED = "finished"  # finish_gradients done
    AGREED = "agreed"  # agree done: the optimizer may step


_FLAGS = ("loss_nonfinite", "grads_nonfinite", "stop", "loss_sum", "grad_sq")


class ParallelModel(nn.Module):
    """The user's module under a data-parallel engine; call it like the module itself (not under pipelines).

    What the trainer and `paratrain.run` may call is `TrainableModel` (`paratrain.parallel.contract`);
    the engine, the communication layer and the loss scaler stay inside: the model's own methods
    say what of them the outside needs (its masters, its loss-scale state, which copy of a
    tensor this rank owns).
    """

    def __init__(self, module: nn.Module, engine: Engine, comm: Comm, precision: Precision,
                 tp_info: TensorParallelInfo | None = None, pipeline=None, context=None, expert_info=None,
                 offload=None, loss_head: FusedHead | None = None, fp8_linears: Sequence[str] = (),
                 lora_targets: Sequence[str] = (),
                 optimizer: Callable[[ParallelModel], torch.optim.Optimizer] | None = None):
        super().__init__()
        self.fp8_linears = list(fp8_linears)  # the linears computing their matmuls in FP8 (`paratrain.parallel.fp8`)
        self.lora_targets = list(lora_targets)  # the linears given adapters (`paratrain.parallel.lora`)
        self.loss_head = loss_head  # `paratrain.parallel.loss.FusedHead`: the model's loss taken inside its head
        self.offload = offload  # `paratrain.parallel.data.offload.HostMasters`: the optimizer steps host masters
        # A `paratrain.parallel.expert.ExpertInfo` under expert parallelism: which parameters are blocks of experts.
        self.expert_info = expert_info
        self._moe = moe_layers(module)
        # A `paratrain.parallel.context.sdpa.ContextSharding` under context parallelism: the forward sees this
        # rank's chunks of each sequence, and labels given whole are split alike.
        self.context = context
        self.module = module
        self.engine = engine
        self.comm = comm
        self.precision = precision
        self.tp_info = tp_info
        self.pipeline = pipeline  # a PipelineRunner when this rank holds pipeline stages
        # This rank's copies of parameters every pipeline rank holds one of (`StageSplit.shared`: a tied head), by
        # their name here → the whole model's; the copy on pp rank 0 is the one a norm or a checkpoint counts.
        self._shared = pipeline.split.shared if pipeline is not None else {}
        self._counted_elsewhere = set(self._shared) if comm.mesh.coord(Axis.PP) != 0 else set()
        self.scaler = LossScaler(enabled=precision.needs_loss_scaling)
        self.verdict: Verdict | None = None  # of the step under way, once agreed
        self._result: StepResult | None = None  # train_step's, for an agreement its caller does not pass it to
        self._phase = _Phase.BACKWARD
        self._used: torch.Tensor | None = None  # this rank's per-master flags from finish_gradients
        # The agreement carries every stage's per-master flags side by side, each in a row of this many
        # columns: at least this rank's masters on every stage (a master per parameter), no communication.
        self._flag_width = len(engine.masters()) if pipeline is None else \
            max(len(engine.masters()), len(pipeline.split.param_shapes))
        self._grad_norm = math.nan  # the agreed norm of the gradients as they are now (clipping scales it)
        self._clip = None  # the clipping coefficient a fused AdamW's grad_scale applies (`clip_in_step`)
        # Which copies this rank counts (`paratrain.mesh`: rank ownership), decided once: the mesh is fixed.
        mesh = comm.mesh
        # Per group of parameters (the experts, under expert parallelism, are reduced by an engine of their own).
        self._groups = engine.groups()
        self._sharded = {expert: (group.grads_sharded, group.params_sharded) for group, expert in self._groups}
        self._owns_grad = {(expert, tp_sharded): mesh.owns(replicated_over(self._sharded[expert][0], tp_sharded, expert))
                           for expert in self._sharded for tp_sharded in (True, False)}  # split over tp or not
        # The axes a step reads (its rows over dp, the agreement's columns over the world and rows per stage),
        # as the communication layer resolved them once.
        self._dp, self._pp, self._world = (comm.axes[axis] for axis in (Axis.DP, Axis.PP, WORLD))
        world = range(self._world.size)
        self._data_ranks = [r for r in world if mesh.shape.owns(r, PER_DATA_RANK)]  # one rank per data rank
        self._loss_ranks = [r for r in world if mesh.shape.owns(r, (Axis.TP,))]  # every stage's: the last writes it
        # The caller's optimizer over the masters, built last, over the finished model, with its hooks around the
        # step (`_before_optimizer_step`, `_after_optimizer_step`); None without one.
        self.optimizer = optimizer(self) if optimizer is not None else None
        # torch's fused Adam and AdamW divide each gradient by `grad_scale` as they read it (GradScaler's unscale):
        # clipping through it saves a read and a write of every gradient (`clip_grad_norm_`)
        self.clip_in_step = (isinstance(self.optimizer, torch.optim.Adam)
                             and compat.steps_with_amp_scaling(self.optimizer)
                             and all(group.get("fused") for group in self.optimizer.param_groups))

    @property
    def mesh(self):
        return self.comm.mesh

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    # -- forward ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The module's forward; floating-point inputs cast to the compute dtype first (`Precision.cast_inputs`)."""
        if self.pipeline is not None:
            raise self.pipeline.error("a pipeline-parallel model runs whole steps: call train_step(micro_batches, "
                                      "normalizer), eval_loss_sum(inputs, labels) or causal_logits(tokens)")
        args, kwargs = self.precision.cast_inputs((args, kwargs))
        output = self.context.forward(self.module, args, kwargs) if self.context is not None else \
            self.module(*args, **kwargs)
        if self.offload is not None:  # each unit waited for its own masters; the backward's buckets need all
            self.offload.settle(bring=True)
        return output

    def _local_labels(self, output, labels: torch.Tensor) -> torch.Tensor:
        """Labels for `output`: this rank's chunks of them when they are whole sequences under context parallelism."""
        if self.context is None:
            return labels
        return self.context.labels(labels, getattr(output, "logits", output).shape[1])

    def _armed(self, loss_fn: LossFn | None, labels: torch.Tensor, seq_len: int | None = None):
        """(the labels of the output of sequences of `seq_len` tokens; around its forward, the fused head armed with
        them where `loss_fn` is the model's own, which takes the head's result)."""
        if self.context is not None and seq_len is not None:
            labels = self.context.labels(labels, seq_len // self.context.size)
        armed = self.loss_head is not None and loss_fn in (None, self.loss_fn)
        return labels, self.loss_head.targets(labels) if armed else contextlib.nullcontext()

    def loss_fn(self, output, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                reduction: str = "sum") -> torch.Tensor:
        """Cross-entropy of this model's logits (fp32): vocab-parallel when tensor parallelism shards them.

        `output` may be the logits or an object with `.logits` (Hugging Face models).
        """
        if self.loss_head is not None and (loss := self.loss_head.take(output)) is not None:
            return loss  # the armed head took the loss already (`_loss_targets`): the token-loss sum
        logits = getattr(output, "logits", output)
        targets = self._local_labels(logits, targets)
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
        """Whole-vocabulary fp32 logits of a causal model for token ids of any length (for generation), on every rank.

        Sequence parallelism needs a length divisible by tp, context parallelism one divisible by 2·cp:
        the ids are padded on the right, which a causal model's earlier positions never see, and the
        padded positions dropped. Under context parallelism each rank's chunks of the logits are
        gathered over the cp ranks and put back in sequence order.
        """
        length = tokens.shape[1]
        multiple = 2 * self.context.size if self.context is not None else 1
        if self.tp_info is not None and self.tp_info.sequence_parallel:
            multiple *= self.mesh.size(self.tp_info.axis)
        tokens = F.pad(tokens, (0, -length % multiple))
        if self.pipeline is not None:
            return self.pipeline.causal_logits(tokens.to(self.device), self.full_logits)[:, :length]
        logits = self.full_logits(self(tokens.to(self.device))).float()
        if self.context is not None:
            pieces = gather_full(logits, 1, self.comm, self.context.axis).chunk(self.context.size, dim=1)
            logits = unshard_sequence(list(pieces), dim=1)
        return logits[:, :length]

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn | None = None) -> torch.Tensor:
        """Token-loss sum of one batch (no gradients), on every rank of the pipeline."""
        loss_fn = loss_fn or self.loss_fn
        labels = labels.to(self.device)
        if self.pipeline is not None:
            return self.pipeline.eval_loss_sum(inputs.to(self.device), labels, loss_fn,
                                               lambda local: self._armed(loss_fn, local)[1])
        labels, armed = self._armed(loss_fn, labels, inputs.shape[1])
        with armed:
            output = self(inputs.to(self.device))
        loss = loss_fn(output, labels).float()
        if self.context is not None:  # each cp rank summed its chunks' tokens: the sequences' sum is theirs together
            self.comm.all_reduce(loss, self.context.axis)
        return loss

    def comm_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the data ranks (for losses and token counts); returns it."""
        self.comm.all_reduce(tensor, Axis.DP)
        return tensor

    def no_sync(self):
        """Gradient accumulation: backward passes inside only accumulate locally."""
        return self.engine.no_sync()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply by the fp16 loss scale before backward (identity for fp32 and bf16)."""
        return self.scaler.scale_loss(loss)

    # -- 1. forward and backward of a step ------------------------------------------------------
    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], normalizer: float | torch.Tensor,
                   loss_fn: LossFn | None = None) -> StepResult:
        """Forward and backward of every (inputs, labels) micro-batch of this data rank.

        Each micro-batch's loss is `loss_fn(output, labels)` (a sum over tokens; default:
        cross-entropy ignoring label -100, vocab-parallel under tensor parallelism) divided by
        `normalizer` (the step's global token count, a number or a 0-d tensor on the device),
        so m micro-batches on N data ranks give the gradient of one batch of m·N. Under pipeline
        parallelism the schedule runs the passes, `loss_fn` on the last stage. The auxiliary
        losses of MoE layers are averaged over the step's sequences on every data rank alike
        (`MoE.aux_rows`), the gradients being summed over the data ranks as the token loss's; their
        expert load (`MoE.step_tokens_per_expert`) sums over this step's micro-batches.
        """
        loss_fn = loss_fn or self.loss_fn
        self._phase = _Phase.BACKWARD
        rows = sum(inputs.shape[0] for inputs, _ in micro_batches) * self._dp.size
        for layer in self._moe:  # and each layer's expert load counts this step's forwards
            layer.aux_rows = rows
            layer.reset_step_load()
        if self.pipeline is not None:
            loss_sum = self.pipeline.run(micro_batches, normalizer, loss_fn, self.no_sync, self.scale_loss,
                                         lambda local: self._armed(loss_fn, local)[1])
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for i, (inputs, labels) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                labels, armed = self._armed(loss_fn, labels.to(self.device, non_blocking=True), inputs.shape[1])
                with contextlib.nullcontext() if last else self.no_sync(), armed:
                    output = self(inputs.to(self.device, non_blocking=True))
                    token_losses = loss_fn(output, labels)
                    self.scale_loss(token_losses / normalizer).backward()
                loss_sum += token_losses.detach()
        self._result = StepResult(loss_sum, ~torch.isfinite(loss_sum))
        return self._result

    # -- 2. gradients final ---------------------------------------------------------------------
    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Finish gradient communication; sum SP-partial gradients over tp; unscale fp16 gradients."""
        if self._phase is not _Phase.BACKWARD:
            return
        self._used = self.engine.finish_gradients()
        self._reduce_sequence_partial_grads()
        if self._shared:  # each copy of a tied head's table gets the one gradient: the sum of the stages' parts
            self.pipeline.sum_shared_gradients(self.engine.master_names(), self.engine.masters())
        grads = self.grads()
        if grads and self.scaler.enabled:  # × 1/scale is exact: the scale is a power of two
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        self._phase = _Phase.FINISHED

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.engine.masters() if m.grad is not None]

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

    # -- 3. the mesh-wide agreement ---------------------------------------------------------------
    @torch.no_grad()
    def agree(self, result: StepResult | None = None, *, stop: bool = False,
              counts: dict[str, float] | None = None) -> Verdict:
        """One all-reduce over every rank, one read to the host; every rank decides the same.

        `result` is `train_step`'s (None: the last `train_step`'s of this step, if any; a user's own
        loop calling backward has no loss to check); `stop` this rank's request to stop after the
        step; `counts` numbers of this data rank to sum over the data ranks (e.g. tokens) and to
        report per rank (e.g. peak memory). Under pipeline parallelism the result's `loss_sum` is
        set on every stage to the last stage's: the loss rides this all-reduce, not one of its own.
        """
        self.finish_gradients()
        result = result if result is not None else self._result
        counts = counts or {}
        world, rank = self._world.size, self.mesh.rank
        rows = len(_FLAGS) + len(counts)
        # Rows of one column per rank, then one row of per-master flags per pipeline stage.
        flags_at = rows * world + self._pp.coord * self._flag_width
        flat = torch.zeros(rows * world + self._pp.size * self._flag_width, dtype=torch.float64,
                           device=self.device)
        table = flat[:rows * world].view(rows, world)
        if result is not None:
            table[0, rank] = result.nonfinite.to(torch.float64)
            table[3, rank] = result.loss_sum.to(torch.float64)
        own_sq, share = self._grad_sq()
        table[1, rank] = (~own_sq.isfinite()).to(torch.float64)
        table[2, rank] = float(stop)
        if share is not None:
            table[4, rank] = share
        for i, value in enumerate(counts.values()):  # a tensor stays where it is until the one read below
            table[len(_FLAGS) + i, rank] = value.to(torch.float64) if torch.is_tensor(value) else float(value)
        used = self._used
        flat[flags_at:flags_at + len(used)] = used  # summed over the stage's ranks: how many reached each master
        self.comm.all_reduce(flat, WORLD)  # each rank wrote only its own column: a sum is a gather
        host = flat.tolist()  # the step's one host sync
        table_host = [host[i * world:(i + 1) * world] for i in range(rows)]
        verdict = self._decide(table_host, list(counts))
        if result is not None and self.pipeline is not None:  # the last stage's sum, on every stage (no sync)
            result.loss_sum.fill_(math.fsum(table_host[3][r] for r in self._pp.ranks))
        unused = [i for i, count in enumerate(host[flags_at:flags_at + len(used)]) if count == 0]
        self.engine.drop_gradients(list(range(len(used))) if verdict.skip else unused)
        self.verdict, self._phase, self._grad_norm = verdict, _Phase.AGREED, verdict.grad_norm
        return verdict

    def _grad_sq(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(Σ‖g‖² of this rank's gradients, this rank's share of the global Σ‖g‖² or None), on the device.

        The shares of all ranks add up to the squared norm of the whole model's gradient: each
        gradient counts on the rank that owns its copies (`Mesh.owns`): every stage's, a
        tensor-parallel shard on each tp rank, a replicated one on tp rank 0; gradients sharded over
        the data axis (ZeRO) on each rank of one replica (dp_replicate 0), whole ones (DDP) on data
        rank 0 only; a parameter every pipeline rank holds a copy of (a tied head), on pp rank 0 only.
        None: this rank's count elsewhere.
        """
        parts = [self._group_grad_sq(engine, expert) for engine, expert in self._groups]
        own = sum(p[0] for p in parts)
        shares = [p[1] for p in parts if p[1] is not None]
        return own, sum(shares) if shares else None

    def _group_grad_sq(self, engine, expert: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_grad_sq` of one group of parameters (all but experts, or the experts: copies along other axes)."""
        elsewhere = [m.grad for n, m in zip(engine.master_names(), engine.masters())
                     if n in self._counted_elsewhere and m.grad is not None]
        if self.tp_info is None:
            own = engine.local_grad_sq_sum()
            counted = own - sum_of_squares_flat([g.reshape(-1) for g in elsewhere], own.device) if elsewhere else own
            return own, counted if self._owns_grad[expert, False] else None
        named = [(n, m.grad) for n, m in zip(engine.master_names(), engine.masters())  # (a copy counted elsewhere
                 if m.grad is not None and n not in self._counted_elsewhere]              # is checked there too)
        sharded, replicated = tp_norm_sq_parts(named, self.tp_info)
        own = sharded + replicated
        if not self._owns_grad[expert, True]:  # no tp shard counts here, so no tp-replicated gradient either
            return own, None
        return own, own if self._owns_grad[expert, False] else sharded

    def _decide(self, table: list[list[float]], names: list[str]) -> Verdict:
        loss_bad, grads_bad, stop, loss, grad_sq = table[:len(_FLAGS)]
        own = tuple(r for r, flag in enumerate(loss_bad) if flag)
        overflow = self.scaler.enabled and any(grads_bad) and not own
        culprits = own or (() if self.scaler.enabled else tuple(r for r, flag in enumerate(grads_bad) if flag))
        # A data rank's values are written by every rank of its stage, tp and cp group: count the owner's. Its
        # loss only by its last pipeline stage (the other stages write 0): summed over the stages; and by each
        # cp rank, its chunks' part: summed over the cp ranks.
        rows = dict(zip(names, table[len(_FLAGS):]))
        return Verdict(skip=overflow or bool(culprits), overflow=overflow, nonfinite_ranks=culprits,
                       stop=any(stop), loss_sum=math.fsum(loss[r] for r in self._loss_ranks),
                       grad_norm=math.sqrt(math.fsum(grad_sq)),
                       sums={name: sum(row[r] for r in self._data_ranks) for name, row in rows.items()},
                       per_rank={name: tuple(row) for name, row in rows.items()})

    def prepare_step(self) -> Verdict:
        """Stages 2 and 3 unless the caller ran them: what clipping and the optimizer's pre-step hook call."""
        if self._phase is not _Phase.AGREED:
            self.agree()
        return self.verdict

    # -- 4. clipping ------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all shards; returns the norm before clipping (0-d tensor).

        The norm is the agreement's (`agree`: every rank's share of the squared norm travels in
        its one all-reduce), so clipping issues no collective and reads nothing back: one scale
        of every gradient by max_norm / (norm + 1e-6), as `torch.nn.utils.clip_grad_norm_`
        does, and none when that is at least 1; with a fused Adam/AdamW (`clip_in_step`) the step's
        own `grad_scale`, which divides each gradient as the step reads it: no pass of its own.
        """
        self.prepare_step()
        norm = self._grad_norm
        grads = self.grads()
        coef = max_norm / (norm + 1e-6)
        if grads and coef < 1.0:
            self._clip = coef * (self._clip or 1.0)
            if not self.clip_in_step:
                torch._foreach_mul_(grads, coef)
            self._grad_norm = norm * coef  # a second call sees the clipped gradients' norm
        return torch.full((), norm, dtype=torch.float64, device=self.device)

    # -- 5. after the optimizer step ----------------------------------------------------------------
    def after_step(self, ready=None) -> None:
        """Parameters up to date with the masters (offload's overlapped step: as the next forward reaches each
        unit, `ready`); the fp16 loss scaler adapts; the next step may begin."""
        self.scaler.update(self.verdict.overflow if self.verdict is not None else False)
        self.parameters_from_masters(ready)

    def parameters_from_masters(self, ready=None) -> None:
        """The parameters brought up to date with the masters (after a step, or a checkpoint loaded into them) by the
        engine's post-step path (ZeRO-1/2: an all-gather, collective; mixed-precision DDP: the cast copy); the
        next step begins afresh. The loss scale moves only in `after_step`: a loaded checkpoint took no step."""
        if self.offload is not None:  # (a stage's forward is the runner's: its collectives at once)
            self.offload.before_parameters(ready, defer=self.pipeline is None)
        self.engine.after_step()
        self.verdict, self._result, self._phase = None, None, _Phase.BACKWARD

    def _before_optimizer_step(self, optimizer, *_) -> None:
        self.prepare_step()  # a user's own loop: finish and agree here (the trainer did it already)
        if self.clip_in_step and self._clip is not None:  # (on the masters' device: the host's under offload)
            optimizer.grad_scale = torch.full((), 1.0 / self._clip, device=self.masters()[0].device)
        if self.offload is not None:  # the final gradients to the host masters, which the optimizer steps there
            self.offload.launch(optimizer)

    def _after_optimizer_step(self, optimizer, *_) -> None:
        optimizer.__dict__.pop("grad_scale", None)
        self._clip = None
        ready = self.offload.finish() if self.offload is not None else None  # (None: the host step is done)
        self.after_step(ready)
        if ready is not None and self.pipeline is not None:  # a stage's forward is the runner's: waits for all
            self.offload.settle(bring=True)

    # -- the state a checkpoint holds, and who owns which copy of it --------------------------------
    def masters(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps (fp32; under ZeRO this rank's rows; offloaded: on the host, stepped), in a
        fixed order."""
        if self.offload is None:
            return self.engine.masters()
        self.offload.settle()
        return self.offload.values

    def master_rows(self) -> list[tuple[str, tuple[int, int], torch.Size]]:
        """Per master, in `masters()` order: parameter name, the rows [lo, hi) of it the master holds (all of
        them without ZeRO), and the parameter's shape on this rank (its tp slice)."""
        return self.engine.master_rows()

    def replicated_over(self, name: str, *, at_rest: bool = False) -> tuple[str, ...]:
        """The mesh axes along which ranks hold equal copies of parameter `name`'s master (its gradient, its
        checkpoint box) or, `at_rest`, of the parameter itself as the module holds it between steps
        (ZeRO-1/2 shard the masters, not the parameters). `Mesh.owns` says which copy counts."""
        expert = self.expert_info is not None and name in self.expert_info.names
        data_sharded = self._sharded[expert][1 if at_rest else 0]
        axes = replicated_over(data_sharded, self.tp_info is not None and name in self.tp_info.sharded, expert)
        return axes + ((Axis.PP,) if name in self._shared else ())

    def whole_name(self, name: str) -> str:
        """The whole model's name of this rank's parameter `name`, the one a checkpoint knows: a tied head's copy on
        the last pipeline stage goes by its embedding's (`StageSplit.shared`)."""
        return self._shared.get(name, name)

    def loss_scale_state(self) -> dict:
        """The fp16 loss scaler's state (scale, clean and skipped steps), for a checkpoint."""
        return self.scaler.state_dict()

    def load_loss_scale_state(self, state: dict) -> None:
        self.scaler.load_state_dict(state)

    @property
    def skipped_steps(self) -> int:
        """Steps the fp16 loss scaler skipped for overflowing gradients (0 without fp16)."""
        return self.scaler.skipped_steps

    # -- whole-model views (`paratrain.parallel.whole`) ------------------------------------------------
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's whole shape, by name, in the order `full_parameters` yields them (no communication)."""
        return whole.full_shapes(self)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of the whole model, whole, one at a time, on every rank (collective: every rank
        iterates to the end, in the same order; only the one yielded last exists whole: `whole.full_parameters`)."""
        return whole.full_parameters(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All of `full_parameters` at once: the whole model on every rank, for tests and small models."""
        return {name: value.clone() for name, value in self.full_parameters()}

    def resident_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes of model state on this rank, from the tensors that exist: params, grads, master, optimizer."""
        result = dict(self.engine.resident_bytes())
        result["optimizer"] = optimizer_state_bytes(optimizer) if optimizer is not None else 0
        result["total"] = sum(result.values())
        return result
