"""Pipeline parallelism: this rank's stages run by a schedule, activations and gradients point to point.

`paratrain.parallel.pipeline.stages` splits the model; this module runs it. One step is m
micro-batches. `PipelineRunner.run` (a `ParallelModel`'s `train_step` under
pipeline parallelism) walks this rank's action list from
`paratrain.parallel.pipeline.schedules` (F, B and for zero-bubble W); the point-to-point
traffic is the groups `exchanges.exchanges` lists (the ones the simulator checks):

=========  ============================================  ===================================
action     receives (posted before it)                   sends (posted after it)
=========  ============================================  ===================================
F(mb, s)   s > 0: the activation [b, s, h]                s < S-1: the output
B(mb, s)   s < S-1: the output's gradient                 s > 0: the input's gradient
W(mb, s)   —                                             —
=========  ============================================  ===================================

The sends of one run of actions and the receives of the next travel as one group
(`Comm.exchange`: one `batch_isend_irecv`, a group call under NCCL), whose
receives the rank waits for before the next run, its sends before the next
group (they complete while the run computes): an order the simulator proves
free of deadlock even when every send blocks until its receive is posted, as
NCCL's and gloo's do.
A receiver must know what it receives before it posts the receive: the first
time an input shape is seen, one forward without gradients walks the stages in
order and each boundary's shape and dtype travel as a small header along that
chain (a gradient has its activation's); then the shapes are fixed.

Under tensor parallelism every tp rank holds the same boundary tensor; each
sends only its 1/t slice of it, and the receiving stage all-gathers the slices
over tp (Megatron's scatter/gather): b·s·h/t elements per rank and boundary
point to point, then an all-gather inside the tp group. Per step, summed over
one pipeline's ranks: 2·(S−1)·m·b·s·h elements (activations forward, their
gradients backward), divided by t.

The loss lives on the last stage and is token-weighted over the global
batch (each micro-batch's `loss_fn` token-loss sum divided by the step's global
token count), so m micro-batches equal one batch of m·b. Data-parallel gradient
communication runs only in the rank's last backward of the step (earlier
ones accumulate under `no_sync`).

A split backward (ZB-H1) computes in B only the gradient of the stage's input,
and in W only the weights' gradients, from where B left off (`split_backward.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch

from paratrain.comm import Comm
from paratrain.mesh import Axis
from paratrain.parallel.pipeline.schedules import Action, Kind, Schedule, ScheduleName, build_schedule
from paratrain.parallel.pipeline.exchanges import Message, exchanges
from paratrain.parallel.pipeline.simulator import validate
from paratrain.parallel.pipeline.split_backward import input_backward, weight_backward
from paratrain.parallel.pipeline.stages import PipelineError, StageSplit
from paratrain.precision import Precision

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # ndim, up to 6 dims, dtype code


# -- running a schedule ----------------------------------------------------------------------------

@dataclass
class _Slot:
    """What one (micro-batch, stage) keeps between its forward and its backward."""

    input: torch.Tensor | None  # the received activation (a leaf that requires grad); None on stage 0
    output: torch.Tensor  # the stage's output, or on the last stage its scaled loss
    grad: torch.Tensor | None = None  # the output's gradient, kept from B for W
    weight_work: list | None = None  # what B left for W (`_split_weight_work`); None: W runs the whole backward


class PipelineRunner:
    """This rank's pipeline stages, run by a schedule: the pipeline half of a `ParallelModel`.

    `run(micro_batches, normalizer, loss_fn, no_sync, scale_loss)` is the forward and backward of
    one optimizer step (a `ParallelModel`'s `train_step` calls it with its engine's `no_sync` and
    its loss scaler's `scale_loss`: the runner knows neither the model nor its engine); each
    stage's floating-point input is cast to `precision`'s compute dtype as the stage begins. `tp_axis` names the tensor-parallel axis whose ranks share each
    boundary tensor (None: no tensor parallelism): they send a slice each, the receivers gather.
    """

    def __init__(self, split: StageSplit, schedule: str, comm: Comm, precision: Precision, tp_axis: Axis | None = None,
                 context=None):
        self.split = split
        self.context = context  # a `ContextSharding` under context parallelism: every stage runs on this rank's chunks
        self.precision = precision
        self.schedule_name = ScheduleName(schedule)
        self.comm = comm
        mesh = comm.mesh
        self.pp, self.pp_rank = mesh.size(Axis.PP), mesh.coord(Axis.PP)
        self.device = mesh.device
        self.tp_axis = tp_axis if tp_axis is not None and mesh.size(tp_axis) > 1 else None
        self.shells = {s: split.shell(s) for s in split.stages}
        self.last_stage = split.num_stages - 1
        self._schedules: dict[int, Schedule] = {}
        # (input shape, dtype) -> {sending stage: (shape, dtype) of the activation it sends}
        self._shapes: dict[tuple, dict[int, tuple[tuple[int, ...], torch.dtype]]] = {}

    @staticmethod
    def error(message: str) -> PipelineError:
        return PipelineError(message)

    # -- training --------------------------------------------------------------------------------
    def schedule(self, num_microbatches: int) -> Schedule:
        """The (validated) schedule for `num_microbatches` micro-batches per step."""
        if num_microbatches not in self._schedules:
            schedule = build_schedule(self.schedule_name, self.pp, num_microbatches, len(self.split.stages))
            validate(schedule)
            self._schedules[num_microbatches] = schedule
        return self._schedules[num_microbatches]

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], normalizer, loss_fn,
            no_sync: Callable[[], ContextManager], scale_loss: Callable[[torch.Tensor], torch.Tensor],
            loss_targets: Callable[[torch.Tensor], ContextManager] | None = None) -> torch.Tensor:
        """Forward and backward of every (inputs, labels) micro-batch in schedule order; this rank's token-loss sum.

        Each micro-batch's loss is `scale_loss(loss_fn(output, labels) / normalizer)` on the last
        stage, whose forward runs inside `loss_targets(labels)` (a fused head takes the loss there:
        `paratrain.parallel.loss`); every backward but this rank's last runs inside `no_sync()`. The sum (fp64, on the
        device) is the step's on the last stage, zero on the others. No collective of its own: the
        step's agreement carries the last stage's sum to every stage (`ParallelModel.agree`).
        """
        schedule = self.schedule(len(micro_batches))
        actions = schedule.actions[self.pp_rank]
        grad_kind = Kind.W if schedule.split_backward else Kind.B
        last_grad = max(i for i, a in enumerate(actions) if a.kind is grad_kind)
        batches = [(x.to(self.device), y.to(self.device)) for x, y in micro_batches]
        slots: dict[tuple[int, int], _Slot] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # a sum of m micro-batches' sums
        shapes = self._boundary_shapes(batches[0][0])
        for _, index, action, inbox, outbox in self._walk(schedule, shapes):
            # Data-parallel gradient communication runs in this rank's last backward of the step only.
            with no_sync() if index != last_grad else contextlib.nullcontext():
                if action.kind is Kind.F:
                    loss_sum += self._forward(action, batches, (normalizer, loss_fn, scale_loss, loss_targets), slots,
                                              inbox, outbox)
                elif action.kind is Kind.B:
                    self._backward(action, slots, schedule.split_backward, inbox, outbox)
                else:
                    self._weight_backward(action, slots)
        return loss_sum

    def _walk(self, schedule: Schedule, shapes: dict):
        """This rank's actions in order, the groups of transfers between them done on the way.

        Yields (runs so far, action index, action, inbox, outbox): an action takes its received
        tensors from `inbox` and leaves what it sends in `outbox`; before each run of actions the
        sends of the run before and the receives of this one travel as one group.
        """
        groups = exchanges(schedule, self.pp_rank)
        actions = schedule.actions[self.pp_rank]
        inbox: dict[Message, torch.Tensor] = {}
        outbox: dict[Message, torch.Tensor] = {}
        index = 0
        for run, length in enumerate(schedule.segments[self.pp_rank]):
            # The sends complete while the run computes (waited at the next group): a send waits for its
            # receive to be posted, and the receiver may still be computing.
            inbox.update(self._exchange(*groups[run], outbox, shapes, defer_sends=True))
            outbox = {}
            for action in actions[index:index + length]:
                yield run, index, action, inbox, outbox
                index += 1
        self._exchange(*groups[-1], outbox, shapes)  # and every send of the step is complete

    def _forward(self, action: Action, batches, loss, slots, inbox, outbox) -> torch.Tensor:
        normalizer, loss_fn, scale_loss, loss_targets = loss
        mb, s = action.microbatch, action.stage
        inputs, labels = batches[mb]
        x = inputs if s == 0 else inbox.pop(("activation", mb, s - 1)).requires_grad_()
        if s == self.last_stage:
            labels = self._local_labels(labels, inputs.shape[1])
            with loss_targets(labels) if loss_targets is not None else contextlib.nullcontext():
                out = self._run_stage(s, x, inputs)  # x stays the leaf whose gradient goes back
            token_loss = loss_fn(out, labels)
            slots[mb, s] = _Slot(x if s > 0 else None, scale_loss(token_loss / normalizer))
            return token_loss.detach()
        out = self._run_stage(s, x, inputs)
        outbox["activation", mb, s] = out.detach()
        slots[mb, s] = _Slot(x if s > 0 else None, out)
        return torch.zeros((), device=out.device)

    def _run_stage(self, stage: int, x, inputs: torch.Tensor):
        """One stage's forward: its input in the compute dtype (the model's floating-point input on the first
        stage, on a later one the activation its sender computed), its output checked. A later stage of a model
        that keeps packed documents apart (`documents_from_tokens`, the reference `Transformer` with
        `document_eos`) is given the micro-batch's token ids `inputs` too, which every pipeline rank holds: the
        document mask travels with the micro-batch, not through the stage boundary.

        Under context parallelism the first stage splits the token ids (sequences of `inputs.shape[1]` tokens)
        into this rank's chunks; a later stage receives activations of those chunks already, from the stage
        before it on the same cp rank. Every stage is given its chunks' positions (and, masking documents, the
        whole sequences' token ids) and runs its attention as the ring over the cp ranks of its own stage."""
        shell, x, seq_len = self.shells[stage], self.precision.cast_inputs(x), inputs.shape[1]
        documents = {"documents": inputs.to(self.device)} if stage > 0 and getattr(shell, "documents_from_tokens",
                                                                                   False) else {}
        if self.context is None:
            out = shell(x, **documents)
        elif stage == 0:  # (the split hands the whole sequences' token ids on as `documents` itself)
            out = self.context.forward(shell, (x,), {})
        else:
            out = self.context.local_forward(shell, (x,), documents, seq_len)
        return self._stage_output(stage, out)

    def _local_labels(self, labels: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The labels of the last stage's output for sequences of `seq_len` tokens: this rank's chunks of them under
        context parallelism."""
        return labels if self.context is None else self.context.labels(labels, seq_len // self.context.size)

    def _stage_output(self, stage: int, out):
        """A stage boundary carries one tensor: anything else is refused naming the stage and what it returned."""
        if stage == self.last_stage or isinstance(out, torch.Tensor):
            return out
        first, last = self.split.ranges[stage]
        raise PipelineError(f"pipeline stage {stage} (layers {first}..{last - 1}) returned a {type(out).__name__}, "
                            "but a stage boundary carries one tensor; make each layer of the nn.Sequential "
                            "return a single tensor (e.g. wrap a layer returning a tuple to keep its first element)")

    def _backward(self, action: Action, slots, input_only: bool, inbox, outbox) -> None:
        mb, s = action.microbatch, action.stage
        slot = slots[mb, s]
        slot.grad = None if s == self.last_stage else inbox.pop(("grad", mb, s + 1))
        if not input_only:
            torch.autograd.backward(slot.output, slot.grad)
            del slots[mb, s]
        elif slot.input is not None:
            params = [p for p in self.shells[s].parameters() if p.requires_grad]
            slot.weight_work = input_backward(slot.output, slot.grad, slot.input, params)
        if slot.input is not None:
            outbox["grad", mb, s] = slot.input.grad

    def _weight_backward(self, action: Action, slots) -> None:
        slot = slots.pop((action.microbatch, action.stage))
        if slot.weight_work is not None:
            weight_backward(slot.weight_work)
            return
        params = [p for p in self.shells[action.stage].parameters() if p.requires_grad]
        torch.autograd.backward(slot.output, slot.grad, inputs=params)  # stage 0: nothing to split

    # -- point to point ------------------------------------------------------------------------------
    def _exchange(self, sends: list[tuple[int, Message]], receives: list[tuple[int, Message]],
                  outbox: dict[Message, torch.Tensor], shapes: dict, defer_sends: bool = False) -> dict[Message, torch.Tensor]:
        """One group: send what `outbox` holds for `sends`, receive `receives`; the received tensors."""
        out = [(outbox[message].contiguous(), peer, message) for peer, message in sends]
        for tensor, _, message in out:
            self._check_shape(message, tensor, shapes)
        buffers = [self._buffer(shapes[_boundary_stage(message)]) for _, message in receives]
        self.comm.exchange([(self._slice(t), peer) for t, peer, _ in out],
                           [(b, peer) for b, (peer, _) in zip(buffers, receives)], Axis.PP, defer_sends)
        return {message: self._gather(buffer, shapes[_boundary_stage(message)])
                for buffer, (_, message) in zip(buffers, receives)}

    def _check_shape(self, message: Message, tensor: torch.Tensor, shapes: dict) -> None:
        known = shapes[_boundary_stage(message)]
        if known != (tuple(tensor.shape), tensor.dtype):
            direction, _, stage = message
            raise PipelineError(f"stage {stage} sends {direction} of shape {tuple(tensor.shape)} ({tensor.dtype}) "
                                f"where its first micro-batch sent {known[0]} ({known[1]}); keep the micro-batch "
                                f"shape fixed within a step")

    @torch.no_grad()
    def _boundary_shapes(self, inputs: torch.Tensor) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every boundary this rank sends or receives, for micro-batches like `inputs`.

        The first time: one forward without gradients through this rank's stages, in stage order;
        each boundary's shape and dtype travel from its sender to its receiver in a header, one
        after the other along the chain of stages (an order free of deadlock whatever the sends do).
        """
        key = (tuple(inputs.shape), inputs.dtype)
        if key in self._shapes:
            return self._shapes[key]
        shapes = {}
        for s in self.split.stages:
            if s == 0:
                x = inputs.to(self.device)
            else:
                header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                self.comm.exchange([], [(header, (s - 1) % self.pp)], Axis.PP)
                shapes[s - 1] = _decode_header(header)
                shape, dtype = shapes[s - 1]
                x = torch.zeros(shape, dtype=dtype, device=self.device)
            if s < self.last_stage:
                with torch.compiler.set_stance("force_eager"):  # compiled blocks: no graph for a no-grad pass run once
                    out = self._run_stage(s, x, inputs)
                shapes[s] = (tuple(out.shape), out.dtype)
                self.comm.exchange([(_encode_header(*shapes[s], self.device), (s + 1) % self.pp)], [], Axis.PP)
        self._shapes[key] = shapes
        return shapes

    def _sliced(self, numel: int) -> bool:
        return self.tp_axis is not None and numel % self.comm.mesh.size(self.tp_axis) == 0

    def _slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This tp rank's 1/t of a boundary tensor that every tp rank holds (the whole tensor without tp)."""
        if not self._sliced(tensor.numel()):
            return tensor
        mesh = self.comm.mesh
        return tensor.view(-1).chunk(mesh.size(self.tp_axis))[mesh.coord(self.tp_axis)]

    def _buffer(self, meta) -> torch.Tensor:
        shape, dtype = meta
        numel = torch.Size(shape).numel()
        if self._sliced(numel):
            numel //= self.comm.mesh.size(self.tp_axis)
            return torch.empty(numel, dtype=dtype, device=self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _gather(self, received: torch.Tensor, meta) -> torch.Tensor:
        """The whole boundary tensor from this tp rank's received slice: an all-gather over tp."""
        shape, dtype = meta
        if received.shape == torch.Size(shape):
            return received
        whole = torch.empty(torch.Size(shape).numel(), dtype=dtype, device=self.device)
        self.comm.all_gather(whole, received, self.tp_axis)
        return whole.view(shape)

    # -- evaluation and generation -----------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor):
        """The model's output for `inputs` on the rank holding the last stage; None on the others.

        Its transfers follow a schedule of forwards alone (one micro-batch), with the boundary
        shapes of `inputs` (an evaluation batch need not have the training batch's shape).
        """
        schedule = Schedule("forward", self.pp, 1, len(self.split.stages), False,
                            tuple(tuple(Action(Kind.F, 0, s) for s in range(r, self.last_stage + 1, self.pp))
                                  for r in range(self.pp)))
        out = None
        for _, _, action, inbox, outbox in self._walk(schedule, self._boundary_shapes(inputs)):
            s = action.stage
            x = inputs if s == 0 else inbox.pop(("activation", 0, s - 1))
            out = self._run_stage(s, x, inputs)
            if s < self.last_stage:
                outbox["activation", 0, s] = out
        return out if self.last_stage in self.split.stages else None

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn,
                      loss_targets: Callable[[torch.Tensor], ContextManager] | None = None) -> torch.Tensor:
        """Token-loss sum of one batch, on every pipeline rank (the forward inside `loss_targets(labels)`)."""
        labels = self._local_labels(labels, inputs.shape[1])
        with loss_targets(labels) if loss_targets is not None else contextlib.nullcontext():
            out = self.forward_only(inputs)
        loss = torch.zeros((), device=self.device) if out is None else loss_fn(out, labels).float()
        self.comm.all_reduce(loss, Axis.PP)
        if self.context is not None:  # each cp rank summed its chunks' tokens
            self.comm.all_reduce(loss, self.context.axis)
        return loss

    @torch.no_grad()
    def causal_logits(self, tokens: torch.Tensor, full_logits) -> torch.Tensor:
        """Whole-vocabulary fp32 logits for `tokens` on every rank (a model whose `config` names its `vocab_size`,
        as the reference model's does; for generation)."""
        vocab_size = getattr(getattr(self.split.module, "config", None), "vocab_size", None)
        if vocab_size is None:
            raise PipelineError("causal_logits needs a model whose `config.vocab_size` says its vocabulary size "
                                "(paratrain's Transformer)")
        out = self.forward_only(tokens)
        if out is None:
            shape = (*tokens.shape, vocab_size)
            logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            logits = full_logits(out).float().contiguous()
        self.comm.broadcast(logits, Axis.PP, src=self.pp - 1)
        return logits

    @torch.no_grad()
    def sum_shared_gradients(self, names: list[str], masters: list[torch.Tensor]) -> None:
        """Sum over pp the gradients of this rank's copies of a parameter every pipeline rank holds one of
        (`StageSplit.shared`: a head tied to the embedding, Megatron's embedding group), in the whole model's name
        order, after the data-parallel reduction: each copy then holds the whole model's gradient of the one
        parameter and takes the same step. The copies of a rank and its pp peers (the same dp and tp coordinates)
        are alike: the same tp slice, the same ZeRO rows (`paratrain.parallel.data.shard`), so master gradients,
        whole or sharded, are summed as they are. One all-reduce per step."""
        shared = self.split.shared
        copies = sorted(((shared[n], m) for n, m in zip(names, masters) if n in shared), key=lambda c: c[0])
        for _, master in copies:
            if master.grad is None:  # no part reached this copy: its peer's is the sum
                master.grad = torch.zeros_like(master)
        self.comm.all_reduce_coalesced([master.grad for _, master in copies], Axis.PP)

    @torch.no_grad()
    def stage_parameters(self, local: dict[str, torch.Tensor], whole) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of the whole model, one at a time: the stage holding it makes it whole
        (`whole(name, value)`, over tp) and broadcasts it over pp (collective: every rank iterates)."""
        dtype = next(iter(local.values())).dtype  # every stage holds its parameters in the same dtype
        for name, shape in self.split.param_shapes.items():
            owner = self.split.param_owner[name] % self.pp
            value = whole(name, local[name]).to(dtype).contiguous() if owner == self.pp_rank else \
                torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.broadcast(value, Axis.PP, src=owner)
            yield name, value


def _boundary_stage(message: Message) -> int:
    """The stage whose output crosses the boundary a message travels: an activation's sender, the
    receiver of a gradient (a gradient has its activation's shape and dtype)."""
    direction, _, stage = message
    return stage if direction == "activation" else stage - 1


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
