"""Pipeline parallelism: this rank's stages run by a schedule, activations and gradients point to point.

`paratrain.parallel.stages` splits the model; this module runs it. One step is m
micro-batches. `PipelineRunner.run` (a `ParallelModel`'s `train_step` under
pipeline parallelism) walks this rank's action list from
`paratrain.parallel.schedules` (F, B and for zero-bubble W) and derives the point-to-point
traffic from it exactly as the simulator does:

=========  ============================================  ===================================
action     before                                        after
=========  ============================================  ===================================
F(mb, s)   s > 0: receive the activation [b, s, h]        s < S-1: send the output
B(mb, s)   s < S-1: receive the output's gradient         s > 0: send the input's gradient
W(mb, s)   —                                             —
=========  ============================================  ===================================

Per step, summed over the ranks of one pipeline: 2·(S−1)·m·b·s·h elements
(activations forward, their gradients backward). Sends are non-blocking and
waited on at the end of the step; receives block. Shapes travel once per
stage boundary and direction in a small header, then are fixed.

The loss lives on the last stage and is token-weighted over the global
batch (each micro-batch's `loss_fn` token-loss sum divided by the step's global
token count), so m micro-batches equal one batch of m·b. Data-parallel gradient
communication runs only in the rank's last backward of the step (earlier
ones accumulate under `no_sync`).

A split backward (ZB-H1) runs B as `backward(inputs=[stage input])` and W as
`backward(inputs=stage parameters)`: the schedule's order and its deferral of
weight gradients are exact, but autograd cannot reuse B's intermediate
gradients in W, so W recomputes the backward through the stage's activations.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from paratrain.parallel.schedules import Action, Kind, ScheduleName, build_schedule
from paratrain.parallel.simulator import validate
from paratrain.parallel.stages import PipelineError, StageSplit

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # ndim, up to 6 dims, dtype code


# -- running a schedule ----------------------------------------------------------------------------

@dataclass
class _Slot:
    """What one (micro-batch, stage) keeps between its forward and its backward."""

    input: torch.Tensor | None  # the received activation (a leaf that requires grad); None on stage 0
    output: torch.Tensor  # the stage's output, or on the last stage its scaled loss
    grad: torch.Tensor | None = None  # the output's gradient, kept from B for W


class PipelineRunner:
    """This rank's pipeline stages, run by a schedule: the pipeline half of a `ParallelModel`.

    `run(micro_batches, normalizer, loss_fn, model)` is the forward and backward of one
    optimizer step (the model's `train_step` calls it); the model's engine, loss scaler and
    device serve every stage.
    """

    def __init__(self, split: StageSplit, schedule: str, mesh, comm):
        self.split = split
        self.schedule_name = ScheduleName(schedule)
        self.comm = comm
        self.pp, self.pp_rank = mesh.size("pp"), mesh.coord("pp")
        self.device = mesh.device
        self.shells = {s: split.shell(s) for s in split.stages}
        self.last_stage = split.num_stages - 1
        self._schedules: dict[int, object] = {}
        self._shapes: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self._pending: list = []

    @staticmethod
    def error(message: str) -> PipelineError:
        return PipelineError(message)

    # -- training --------------------------------------------------------------------------------
    def schedule(self, num_microbatches: int):
        """The (validated) schedule for `num_microbatches` micro-batches per step."""
        if num_microbatches not in self._schedules:
            schedule = build_schedule(self.schedule_name, self.pp, num_microbatches, len(self.split.stages))
            validate(schedule)
            self._schedules[num_microbatches] = schedule
        return self._schedules[num_microbatches]

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], normalizer, loss_fn, model):
        """Forward and backward of every (inputs, labels) micro-batch in schedule order; a `StepResult`.

        Each micro-batch's loss is `loss_fn(output, labels) / normalizer` on the last stage. The
        token-loss sum of this data rank's micro-batches is all-reduced over pp, so every stage
        reports it; the non-finite flag is the last stage's own.
        """
        from paratrain.parallel.model import StepResult

        schedule = self.schedule(len(micro_batches))
        actions = schedule.actions[self.pp_rank]
        grad_kind = Kind.W if schedule.split_backward else Kind.B
        last_grad = max(i for i, a in enumerate(actions) if a.kind is grad_kind)
        batches = [(x.to(self.device), y.to(self.device)) for x, y in micro_batches]
        slots: dict[tuple[int, int], _Slot] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # a sum of m micro-batches' sums
        for i, action in enumerate(actions):
            # Data-parallel gradient communication runs in this rank's last backward of the step only.
            with model.no_sync() if i != last_grad else contextlib.nullcontext():
                if action.kind is Kind.F:
                    loss_sum += self._forward(action, batches, normalizer, loss_fn, model, slots)
                elif action.kind is Kind.B:
                    self._backward(action, slots, input_only=schedule.split_backward)
                else:
                    self._weight_backward(action, slots)
        self._finish_sends()
        nonfinite = ~torch.isfinite(loss_sum)  # before the sum over pp: this rank's own loss only
        self.comm.all_reduce(loss_sum, "pp")  # only the last stage contributed
        return StepResult(loss_sum, nonfinite)

    def _forward(self, action: Action, batches, normalizer, loss_fn, model, slots) -> torch.Tensor:
        mb, s = action.microbatch, action.stage
        inputs, labels = batches[mb]
        x = inputs if s == 0 else self._receive("activation", s - 1).requires_grad_()
        out = self._stage_output(s, self.shells[s](x))
        if s == self.last_stage:
            token_loss = loss_fn(out, labels)
            slots[mb, s] = _Slot(x if s > 0 else None, model.scale_loss(token_loss / normalizer))
            return token_loss.detach()
        self._send(out.detach(), "activation", s)
        slots[mb, s] = _Slot(x if s > 0 else None, out)
        return torch.zeros((), device=out.device)

    def _stage_output(self, stage: int, out):
        """A stage boundary carries one tensor: anything else is refused naming the stage and what it returned."""
        if stage == self.last_stage or isinstance(out, torch.Tensor):
            return out
        first, last = self.split.ranges[stage]
        raise PipelineError(f"pipeline stage {stage} (layers {first}..{last - 1}) returned a {type(out).__name__}, "
                            "but a stage boundary carries one tensor; make each layer of the nn.Sequential "
                            "return a single tensor (e.g. wrap a layer returning a tuple to keep its first element)")

    def _backward(self, action: Action, slots, input_only: bool) -> None:
        mb, s = action.microbatch, action.stage
        slot = slots[mb, s]
        slot.grad = None if s == self.last_stage else self._receive("grad", s + 1)
        if not input_only:
            torch.autograd.backward(slot.output, slot.grad)
            del slots[mb, s]
        elif slot.input is not None:
            torch.autograd.backward(slot.output, slot.grad, inputs=[slot.input], retain_graph=True)
        if slot.input is not None:
            self._send(slot.input.grad, "grad", s)

    def _weight_backward(self, action: Action, slots) -> None:
        slot = slots.pop((action.microbatch, action.stage))
        params = [p for p in self.shells[action.stage].parameters() if p.requires_grad]
        torch.autograd.backward(slot.output, slot.grad, inputs=params)

    # -- point to point ------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, direction: str, from_stage: int, header: bool = False) -> None:
        """Send to the neighbour stage; the shape goes first, once per boundary (always with `header`)."""
        tensor = tensor.contiguous()
        to_stage = from_stage + 1 if direction == "activation" else from_stage - 1
        peer, meta = to_stage % self.pp, (tuple(tensor.shape), tensor.dtype)
        known = self._shapes.get((direction, from_stage))
        if header or known is None:
            description = _encode_header(*meta, tensor.device)
            self._pending.append((self.comm.send(description, "pp", peer), description))
            if not header:
                self._shapes[direction, from_stage] = meta
        elif known != meta:
            raise PipelineError(f"stage {from_stage} sends {direction} of shape {meta[0]} ({meta[1]}) where earlier "
                                f"steps sent {known[0]} ({known[1]}); keep the micro-batch shape fixed")
        self._pending.append((self.comm.send(tensor, "pp", peer), tensor))

    def _receive(self, direction: str, from_stage: int, header: bool = False) -> torch.Tensor:
        peer = from_stage % self.pp
        meta = None if header else self._shapes.get((direction, from_stage))
        if meta is None:
            description = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self.comm.wait([self.comm.recv(description, "pp", peer)], "pp")
            meta = _decode_header(description)
            if not header:
                self._shapes[direction, from_stage] = meta
        buffer = torch.empty(meta[0], dtype=meta[1], device=self.device)
        self.comm.wait([self.comm.recv(buffer, "pp", peer)], "pp")
        return buffer

    def _finish_sends(self) -> None:
        self.comm.wait([work for work, _ in self._pending], "pp")
        self._pending.clear()

    # -- evaluation and generation -----------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor):
        """The model's output for `inputs` on the rank holding the last stage; None on the others."""
        out = None
        for s in self.split.stages:
            x = inputs if s == 0 else self._receive("activation", s - 1, header=True)
            out = self._stage_output(s, self.shells[s](x))
            if s < self.last_stage:
                self._send(out, "activation", s, header=True)
        self._finish_sends()
        return out if self.last_stage in self.split.stages else None

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn) -> torch.Tensor:
        """Token-loss sum of one batch, on every pipeline rank."""
        out = self.forward_only(inputs)
        loss = torch.zeros((), device=self.device) if out is None else loss_fn(out, labels).float()
        self.comm.all_reduce(loss, "pp")
        return loss

    @torch.no_grad()
    def causal_logits(self, tokens: torch.Tensor, full_logits) -> torch.Tensor:
        """Whole-vocabulary fp32 logits for `tokens` on every rank (the reference model; for generation)."""
        if self.split.kind != "transformer":
            raise PipelineError("causal_logits needs paratrain's Transformer (its vocabulary size)")
        out = self.forward_only(tokens)
        if out is None:
            shape = (*tokens.shape, self.split.module.config.vocab_size)
            logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            logits = full_logits(out).float().contiguous()
        self.comm.broadcast(logits, "pp", src=self.pp - 1)
        return logits

    @torch.no_grad()
    def gather_stages(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model from each stage's own (collective over pp)."""
        dtype = next(iter(local.values())).dtype  # every stage holds its parameters in the same dtype
        out = {}
        for name, shape in self.split.param_shapes.items():
            owner = self.split.param_owner[name] % self.pp
            value = local[name].to(dtype).contiguous() if owner == self.pp_rank else \
                torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.broadcast(value, "pp", src=owner)
            out[name] = value
        return out


def _encode_header(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    if len(shape) > _HEADER - 2:
        raise PipelineError(f"activations of {len(shape)} dims cannot cross a stage boundary (at most {_HEADER - 2})")
    if dtype not in _DTYPES:
        raise PipelineError(f"activations of dtype {dtype} cannot cross a stage boundary; use one of {_DTYPES}")
    values = [len(shape), *shape] + [0] * (_HEADER - 2 - len(shape)) + [_DTYPES.index(dtype)]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    return tuple(values[1:1 + values[0]]), _DTYPES[values[-1]]
