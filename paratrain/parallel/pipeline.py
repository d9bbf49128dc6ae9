"""Pipeline parallelism: this rank's stages run by a schedule, activations and gradients point to point.

`paratrain.parallel.stages` splits the model; this module runs it. One step is m
micro-batches. `PipelineModel.train_step` walks this rank's action list from
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
batch (each micro-batch's token-loss sum divided by the step's global token
count), so m micro-batches equal one batch of m·b. Data-parallel gradient
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
from torch import nn

from paratrain.parallel.schedules import Action, Kind, build_schedule
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


class PipelineModel(nn.Module):
    """This rank's pipeline stages under a data/tensor-parallel engine, run by a schedule.

    `train_step(micro_batches, normalizer)` replaces the user's forward/backward loop for one
    optimizer step; gradient clipping, the optimizer and the loss scaler work as with
    `ParallelModel`, to which everything else is delegated.
    """

    def __init__(self, inner, split: StageSplit, schedule: str, mesh):
        super().__init__()
        self.inner = inner
        self.split = split
        self.schedule_name = schedule
        self.pp, self.pp_rank = mesh.size("pp"), mesh.coord("pp")
        self.shells = {s: split.shell(s) for s in split.stages}
        self.last_stage = split.num_stages - 1
        self._schedules: dict[int, object] = {}
        self._shapes: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self._pending: list = []
        build_schedule(schedule, self.pp, self.pp, len(split.stages))  # a bad name or v fails now, not at step 1

    # -- the ParallelModel interface, delegated --------------------------------------------------
    @property
    def comm(self):
        return self.inner.comm

    @property
    def scaler(self):
        return self.inner.scaler

    @property
    def module(self) -> nn.Module:
        return self.inner.module

    @property
    def tp_info(self):
        return self.inner.tp_info

    def forward(self, *args, **kwargs):
        raise PipelineError("a pipeline-parallel model runs whole steps: call train_step(micro_batches, "
                            "normalizer), eval_loss_sum(inputs, labels) or causal_logits(tokens)")

    def loss_fn(self, *args, **kwargs):
        return self.inner.loss_fn(*args, **kwargs)

    def comm_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.inner.comm_sum(tensor)

    def no_sync(self):
        return self.inner.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> float:
        return self.inner.clip_grad_norm_(max_norm)

    def resident_bytes(self, optimizer=None) -> dict[str, int]:
        return self.inner.resident_bytes(optimizer)

    # -- training --------------------------------------------------------------------------------
    def schedule(self, num_microbatches: int):
        """The (validated) schedule for `num_microbatches` micro-batches per step."""
        if num_microbatches not in self._schedules:
            schedule = build_schedule(self.schedule_name, self.pp, num_microbatches, len(self.split.stages))
            validate(schedule)
            self._schedules[num_microbatches] = schedule
        return self._schedules[num_microbatches]

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], normalizer: float) -> torch.Tensor:
        """Forward and backward of every (inputs, labels) micro-batch in schedule order.

        Each micro-batch's loss is its token-loss sum divided by `normalizer` (the step's global
        token count). Returns the token-loss sum of this data rank's micro-batches, on every
        pipeline rank.
        """
        schedule = self.schedule(len(micro_batches))
        actions = schedule.actions[self.pp_rank]
        grad_kind = Kind.W if schedule.split_backward else Kind.B
        last_grad = max(i for i, a in enumerate(actions) if a.kind is grad_kind)
        device = self._device()
        batches = [(x.to(device), y.to(device)) for x, y in micro_batches]
        slots: dict[tuple[int, int], _Slot] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # a sum of m micro-batches' sums
        for i, action in enumerate(actions):
            with self.inner.no_sync() if i != last_grad else contextlib.nullcontext():
                if action.kind is Kind.F:
                    loss_sum += self._forward(action, batches, normalizer, slots)
                elif action.kind is Kind.B:
                    self._backward(action, slots, input_only=schedule.split_backward)
                else:
                    self._weight_backward(action, slots)
        self._finish_sends()
        self.comm.all_reduce(loss_sum, "pp")  # only the last stage contributed
        return loss_sum

    def _forward(self, action: Action, batches, normalizer: float, slots) -> torch.Tensor:
        mb, s = action.microbatch, action.stage
        inputs, labels = batches[mb]
        x = inputs if s == 0 else self._receive("activation", s - 1).requires_grad_()
        out = self.shells[s](x)
        if s == self.last_stage:
            token_loss = self.inner.loss_fn(out, labels)
            slots[mb, s] = _Slot(x if s > 0 else None, self.inner.scale_loss(token_loss / normalizer))
            return token_loss.detach()
        self._send(out.detach(), "activation", s)
        slots[mb, s] = _Slot(x if s > 0 else None, out)
        return torch.zeros((), device=out.device)

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
        peer, device = from_stage % self.pp, self._device()
        meta = None if header else self._shapes.get((direction, from_stage))
        if meta is None:
            description = torch.empty(_HEADER, dtype=torch.int64, device=device)
            self.comm.wait([self.comm.recv(description, "pp", peer)], "pp")
            meta = _decode_header(description)
            if not header:
                self._shapes[direction, from_stage] = meta
        buffer = torch.empty(meta[0], dtype=meta[1], device=device)
        self.comm.wait([self.comm.recv(buffer, "pp", peer)], "pp")
        return buffer

    def _finish_sends(self) -> None:
        self.comm.wait([work for work, _ in self._pending], "pp")
        self._pending.clear()

    def _device(self) -> torch.device:
        return next(self.inner.module.parameters()).device

    # -- evaluation and generation -----------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's output for `inputs` on the rank holding the last stage; None on the others."""
        out = None
        for s in self.split.stages:
            x = inputs.to(self._device()) if s == 0 else self._receive("activation", s - 1, header=True)
            out = self.shells[s](x)
            if s < self.last_stage:
                self._send(out, "activation", s, header=True)
        self._finish_sends()
        return out if self.last_stage in self.split.stages else None

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Token-loss sum of one batch, on every pipeline rank."""
        out = self.forward_only(inputs)
        if out is None:
            loss = torch.zeros((), device=self._device())
        else:
            loss = self.inner.loss_fn(out, labels.to(out.device), ignore_index=ignore_index).float()
        self.comm.all_reduce(loss, "pp")
        return loss

    @torch.no_grad()
    def causal_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary fp32 logits for `tokens` on every rank (the reference model; for generation)."""
        if self.split.kind != "transformer":
            raise PipelineError("causal_logits needs paratrain's Transformer (its vocabulary size)")
        out = self.forward_only(tokens)
        if out is None:
            shape = (*tokens.shape, self.split.module.config.vocab_size)
            logits = torch.empty(shape, dtype=torch.float32, device=self._device())
        else:
            logits = self.inner.full_logits(out).float().contiguous()
        self.comm.broadcast(logits, "pp", src=self.pp - 1)
        return logits

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, whole, on every rank (collective)."""
        local = self.inner.full_state_dict()
        dtype = next(iter(local.values())).dtype  # every stage holds its parameters in the same dtype
        out = {}
        for name, shape in self.split.param_shapes.items():
            owner = self.split.param_owner[name] % self.pp
            value = local[name].to(dtype).contiguous() if owner == self.pp_rank else \
                torch.empty(shape, dtype=dtype, device=self._device())
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
