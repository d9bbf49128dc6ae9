"""ZeRO-3 (fully sharded data parallel): parameters, gradients and optimizer state split over dp.

Partition (``shard.py``): every parameter is split along dim 0 over the N ranks
of the dp axis; rank r keeps rows [r·c, min((r+1)·c, d0)), c = ceil(d0/N), as
an fp32 leaf that is at once the model's parameter at rest and the optimizer's
master. Ψ parameters cost 4Ψ/N (shard) + 4Ψ/N (its gradient) + 8Ψ/N (Adam's
moments) = 16Ψ/N bytes per rank, in fp32 and in mixed precision alike.

Hybrid sharding (a mesh with dp_replicate > 1): N is the shard group
(`Mesh.shard_axis`, dp_shard ranks); every gather stays within it, and each
reduce-scatter's 1/N shard is then all-reduced over dp_replicate.

Communication per step, per unit (``units.py``: a block, or the root's
remaining parameters), on the dp axis (its shard group):

- forward: one all-gather of the unit's parameters (in the compute dtype),
  launched one unit ahead (prefetch), freed when the unit's forward returns;
  but the last unit (the head) stays gathered into its backward, which comes
  first with nothing to overlap a gather (as FSDP2 keeps its root);
- backward: one all-gather again, when the backward first needs a tensor that
  the forward saved from the unit's parameters (saved-tensor hooks pack such a
  tensor as a reference into the gathered buffer instead of keeping the buffer
  alive; unpacking re-gathers), prefetched one such unit ahead: a unit whose
  forward saved no view of its parameters (an embedding: its backward reads the
  indices) is not gathered; and one reduce-scatter of the unit's gradients
  (in the reduce dtype) when autograd has every gradient of them;
- nothing more: which parameters some rank's backward reached (so that a parameter no
  rank used keeps grad None) travels in the model's one agreement per step.

A unit this rank holds whole (N = 1 over its axis, no replicas summing its gradients) takes none of these
steps: its gather is the cast of its shards into the compute dtype (none in fp32, where the module computes
on the shards, `Unit.on_shards`), its gradients go to the masters cast, without a flat buffer.

With ring collectives this is 3·Ψ·(N−1)/N elements per rank per step, less the
units not gathered in backward (the embedding and the head), against
2·Ψ·(N−1)/N for DDP. Gradient accumulation cannot defer the reduce-scatter
(the full gradient exists only while its unit is gathered), so ZeRO-3
communicates every micro-batch and ``no_sync()`` changes nothing.

Mixed precision casts the fp32 shards to ``param_dtype`` as they enter the
all-gather (as FSDP2 does): the full parameters compute in ``param_dtype``, and
no separate low-precision shard is kept, because the stock optimizer cannot step
an fp32 master with a bf16 gradient and an fp32 gradient plus a bf16 shard would
cost 18Ψ/N instead of 16Ψ/N. A frozen parameter (`requires_grad=False`: a LoRA base) is sharded and gathered
like the others but is no master: no gradient, no reduce-scatter (`units.py`), no optimizer state; its shard is
stored as the model held it (a bf16 base: 2Ψ/N bytes, an NF4 base's bytes: about 0.52Ψ/N) and it travels so
where that is narrower than the compute dtype. The masters are the engine's first parameters, those that
train, in the model's order. A parameter that a codec of the caller's takes
(`units.GatherCodec`) enters the gather as the codec encodes it instead (e.g.
one byte per element with a scale); after each optimizer step every codec
derives what its encoding needs from the updated shards (`GatherCodec.refresh`).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Callable, Collection, ContextManager, Iterator

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.compat import in_backward
from paratrain.mesh import Axis
from paratrain.parallel.data.engine import GradReduction, sum_of_squares, used_flags, weak_hook
from paratrain.parallel.data.replicas import ReplicaSum
from paratrain.parallel.data.shard import row_range
from paratrain.parallel.data.groups import MasterGroup
from paratrain.parallel.data.outside_use import OutsideUse
from paratrain.parallel.data.placement import axis_units, shard_place, unit_axis
from paratrain.parallel.blocks import UnitSpec, unit_modules
from paratrain.parallel.data.units import (GatherCodec, SavedView, Unit, ZeroConfigError, check_buffers,
                                          default_init, gather_whole, parameter_slots, row_shape)
from paratrain.precision import Precision


class FullyShardedEngine:
    """Shard `model` in place over the dp axis of the comm's mesh and drive its gathers and reductions.

    An `Engine` (engine.py). The model keeps its structure and is called as before; each parameter slot
    holds the rank's shard at rest and the full parameter only inside its
    unit's forward. Parameters on the meta device are materialized shard by
    shard with `init(name, full_shape)` (default: the reference model's
    ``param_init`` with seed 0), or, where the initializer can give part of
    a value (`init.rows(name, full_shape, lo, hi)`: its rows [lo, hi) along
    dim 0, as a model directory's files are read), with only the rows the
    shard keeps; real parameters are sliced from this rank's
    copy, which the caller guarantees equal on every rank (same seed), so
    nothing is broadcast either way.

    `units`: None (blocks of ModuleList/ModuleDict), module classes, or a
    predicate (name, module) -> bool. `grad_reduction`: `GradReduction.MEAN` divides
    gradients by N (DDP semantics), `SUM` adds them (the caller's loss is
    already normalized by the global token count). `axes`: parameter name -> the axis of the ranks
    that hold its copies, where that is not the shard axis (a table the caller computes: `placement.py`);
    such a parameter is sharded over those ranks and reported in a group of its own (`groups`).
    `shard_store`: where the shards live when not on the device (`tensors(shapes, dtype)`, and
    `gradients(grads)` bringing the device's gradients there). `codecs`: how parameters that a codec
    takes travel in their gathers (`units.GatherCodec`).
    """

    grads_sharded = True  # each rank holds only its shard of every gradient: global norms need a dp all-reduce
    params_sharded = True

    def __init__(self, model: nn.Module, comm: Comm, precision: Precision,
                 units: UnitSpec = None, prefetch: bool = True,
                 init: Callable[[str, torch.Size], torch.Tensor] | None = None,
                 grad_reduction: GradReduction = GradReduction.MEAN,
                 axes: dict[str, Axis] | None = None, shard_store=None, codecs: Collection[GatherCodec] = ()):
        try:
            grad_reduction = GradReduction(grad_reduction)
        except ValueError:
            raise ZeroConfigError(f"grad_reduction={grad_reduction!r} is invalid; use 'mean' or 'sum'") from None
        mesh = comm.mesh
        self.model, self.comm, self.precision, self.prefetch = model, comm, precision, prefetch
        # Shards split over the shard group: the data axis, or its dp_shard part under hybrid sharding,
        # whose dp_replicate groups each hold a copy of the shards (and sum their gradients).
        self.shard_axis, self.replicas = mesh.shard_axis, mesh.replicas
        self.mesh, self.device = mesh, mesh.device
        self._divide_by = mesh.size(mesh.data_axis) if grad_reduction is GradReduction.MEAN else 1
        # name -> parameter, each shared tensor once: those that train first (the masters), then the frozen ones
        originals = dict(sorted(model.named_parameters(), key=lambda item: not item[1].requires_grad))
        self._trained = sum(p.requires_grad for p in originals.values())  # the masters: the first parameters
        index_of = {id(p): i for i, p in enumerate(originals.values())}
        self._names = list(originals)
        self._shapes = [p.shape for p in originals.values()]
        axes = axes or {}
        self._axes = [axes.get(name, self.shard_axis) for name in self._names]
        # state_dict names (a tied parameter has several) -> parameter index
        self._state_names = {name: index_of[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        check_buffers(model)
        init = init or default_init(model, originals)
        # the shards (and so the optimizer's state) where the store keeps them (host memory), gathered onto the device
        self._store = shard_store
        shapes = [self._shard_shape(p.shape, axis) for p, axis in zip(originals.values(), self._axes)]
        store = self._stored(shapes, [self._stored_dtype(p) for p in originals.values()])
        self._shards = [self._make_shard(name, p, init, axis, out)
                        for (name, p), axis, out in zip(originals.items(), self._axes, store)]
        self._codecs = list(codecs)
        self.units = self._build_units(model, units, index_of, set(axes))
        self._values: list[torch.Tensor] | None = None  # the masters' values kept elsewhere (`keep_master_values`)
        self._await = None  # how `after_step` waits for them (`await_values`)
        self.after_step()
        self.root = self.units[0]
        for unit in self.units:
            unit.restore()
            self._register_hooks(unit)
        self._plan = self.units[1:]   # non-root unit calls of the last forward (registration order at first)
        self._calls: list[Unit] = []  # the same, being recorded by the current forward
        self._backward_cursor = 0
        self._live: dict[int, Unit] = {}  # storage address -> gathered unit (for the pack hook)
        self._hooks_ctx: ContextManager | None = None  # set while a forward runs
        self._entered: list[Unit] = []  # the units whose forward is running, innermost last
        self._kept: Unit | None = None  # the forward's last unit, still gathered until its backward first needs it
        self._in_flight: deque = deque()
        self._in_flight_limit = comm.reductions_in_flight()
        self._replica_sum = ReplicaSum(comm)  # hybrid sharding: each reduced shard summed over the replicas
        self._new_grads: dict[int, torch.Tensor] = {}
        self._used = [False] * len(self._shards)  # on the host while backward runs: no kernel per gradient
        self._used_mask = torch.zeros(self._trained, device=self._device())  # per master
        # A step's gradients are being collected: from its first reduce-scatter to finish_gradients().
        self._accumulating = False
        self._outside_use: OutsideUse | None = None
        self._in_engine = 0  # > 0 while the engine's own code runs (it may touch shards)

    @contextlib.contextmanager
    def _engine_code(self):
        self._in_engine += 1
        try:
            yield
        finally:
            self._in_engine -= 1

    # -- construction ------------------------------------------------------
    def _device(self) -> torch.device:
        return self.device

    def _rows(self, shape: torch.Size, axis: Axis) -> tuple[int, int]:
        """The rows [lo, hi) of a parameter of `shape` this rank's shard over `axis` holds."""
        return row_range(row_shape(shape)[0], *shard_place(self.mesh, axis))

    def _shard_shape(self, shape: torch.Size, axis: Axis) -> tuple[int, ...]:
        lo, hi = self._rows(shape, axis)
        return (hi - lo, *row_shape(shape)[1:])

    def _stored_dtype(self, param: nn.Parameter) -> torch.dtype:
        """A shard's dtype: the master dtype for a parameter that trains, its own for a frozen one."""
        return self.precision.master_dtype if param.requires_grad else param.dtype

    def _stored(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> list[torch.Tensor | None]:
        """The shards' storage where the store keeps them (host memory), by dtype; None each without a store."""
        if self._store is None:
            return [None] * len(shapes)
        out: list[torch.Tensor | None] = [None] * len(shapes)
        for dtype in dict.fromkeys(dtypes):
            at = [i for i, d in enumerate(dtypes) if d == dtype]
            for i, tensor in zip(at, self._store.tensors([shapes[i] for i in at], dtype)):
                out[i] = tensor
        return out

    def _make_shard(self, name: str, param: nn.Parameter, init, axis: Axis, out: torch.Tensor | None) -> nn.Parameter:
        """This rank's rows over `axis` of one parameter as a leaf in its stored dtype (`_stored_dtype`; in `out`:
        host memory, or on the mesh's device, whatever device a materialized model was built on); a meta
        parameter's full value lives only here."""
        rows = row_shape(param.shape)
        lo, hi = self._rows(param.shape, axis)
        # The shard is allocated before the full value, so that the freed full value is the most
        # recent allocation and the next one reuses its memory (measured: peak RSS of a sharded
        # 200 MB model = shard + 8 MB, against shard + 58 MB the other way round).
        shard = out if out is not None else torch.empty(self._shard_shape(param.shape, axis),
                                                        dtype=self._stored_dtype(param), device=self.device)
        rows_of = getattr(init, "rows", None) if param.is_meta and param.dim() else None
        if rows_of is not None:  # only the rows this shard keeps are read
            part = rows_of(name, param.shape, lo, hi)
            if part.shape != shard.shape:
                raise ZeroConfigError(f"init.rows({name!r}, {lo}, {hi}) returned shape {tuple(part.shape)}, "
                                      f"expected {tuple(shard.shape)}")
            shard.copy_(part)
            return nn.Parameter(shard, requires_grad=param.requires_grad)
        full = init(name, param.shape) if param.is_meta else param.detach()
        if full.shape != param.shape:
            raise ZeroConfigError(f"init({name!r}) returned shape {tuple(full.shape)}, expected {tuple(param.shape)}")
        shard.copy_(full.reshape(rows)[lo:hi])
        return nn.Parameter(shard, requires_grad=param.requires_grad)

    def _build_units(self, model: nn.Module, spec: UnitSpec, index_of: dict[int, int], apart: set[str]) -> list[Unit]:
        named = [("", model)] + axis_units(model, unit_modules(model, spec), apart)
        slots = parameter_slots(model, {id(m) for _, m in named[1:]})
        units = []
        indexed = {name: [(mod, attr, index_of[id(mod._parameters[attr])]) for mod, attr in slots.get(id(module), [])]
                   for name, module in named}
        every_slot = [slot for slot_list in indexed.values() for slot in slot_list]
        self._coded: dict[int, GatherCodec] = {}  # parameter index -> the codec that carries it (the first to claim)
        for codec in self._codecs:
            for index in sorted(codec.claims(every_slot) - self._coded.keys()):
                self._coded[index] = codec
        for name, module in named:
            axis = unit_axis(name, [self._axes[i] for _, _, i in indexed[name]], self.shard_axis)
            units.append(Unit(name, module, indexed[name], self._shards, self._shapes, self.mesh.size(axis), axis,
                              self.precision.param_dtype, self._coded, self.device))
        for unit in units:
            unit.on_shards = self._reduced_here(unit) and unit.computes_on_shards
        self._watch_shards_computed_on(units)
        return units

    def _reduced_here(self, unit: Unit) -> bool:
        """Whether this rank alone makes the unit's gradients: it holds the unit whole and no replica of its shards
        adds to them (hybrid sharding's replicas do, over dp_replicate; parameters on an axis of their own: none)."""
        return unit.whole and (self.replicas == 1 or unit.axis != self.shard_axis)

    def _watch_shards_computed_on(self, units: list[Unit]) -> None:
        """The shards the modules compute on (`Unit.on_shards`): autograd accumulates their gradients into them,
        each contribution divided as it arrives (a mean), and says which arrived."""
        indices = {fp.index for unit in units if unit.on_shards for fp in unit.params}
        self._shard_index = {id(self._shards[i]): i for i in indices}
        for index in sorted(indices):
            shard = self._shards[index]
            if not shard.requires_grad:
                continue
            if self._divide_by != 1:
                shard.register_hook(functools.partial(torch.div, other=self._divide_by))
            shard.register_post_accumulate_grad_hook(weak_hook(self._shard_grad_arrived))

    def _register_hooks(self, unit: Unit) -> None:
        unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
        unit.module.register_forward_hook(functools.partial(self._post_forward, unit), always_call=True)

    # -- forward -----------------------------------------------------------
    def _pre_forward(self, unit: Unit, module, args) -> None:
        with self._engine_code():
            self._enter_unit(unit)

    def _enter_unit(self, unit: Unit) -> None:
        if in_backward():  # inside backward: activation checkpointing recomputes
            # The forward order was recorded already; what comes next is the unit backward reaches next.
            self._prefetch(unit)
            self._prefetch(self._backward_next(unit))
            if unit.params and not unit.on_shards:
                unit.install(GatherUnit.apply(self, unit, *unit.shards))
            return
        if unit is self.root:
            self._begin_forward()
            upcoming = self._plan[0] if self._plan else None
        else:
            self._entered.append(unit)
            self._calls.append(unit)
            position = len(self._calls)  # of the next call
            upcoming = self._plan[position] if position < len(self._plan) else None
        self._prefetch(unit)
        self._prefetch(upcoming)  # launched before waiting on this unit's gather, to overlap with its forward
        if unit.params and not unit.on_shards:
            unit.install(GatherUnit.apply(self, unit, *unit.shards))

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        unit.restore()
        if self._entered and self._entered[-1] is unit:
            self._entered.pop()
        if unit is self.root and self._hooks_ctx is not None:
            self._end_forward()
        # The previous forward's last call, called as often, is likely this one's last too: it stays gathered
        # (`_end_forward` frees it if not; a root with parameters ends last, and is the one kept).
        elif (self._hooks_ctx is None or self.root.params or self._plan[-1:] != [unit]
              or len(self._calls) != len(self._plan)):
            self._free(unit)

    def _begin_forward(self) -> None:
        """Root forward starts: from now on, saved views of gathered buffers are packed as references."""
        self._free_all()
        self._calls, self._entered = [], [self.root]
        for unit in self.units:
            unit.saved_any = unit.saved_own = False
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        if self._outside_use is None:  # the first forward: check that every parameter is read inside its unit
            self._outside_use = OutsideUse(self)
            self._outside_use.__enter__()

    def _end_forward(self) -> None:
        if self._outside_use is not None and self._outside_use.active:
            self._outside_use.active = False
            self._outside_use.__exit__(None, None, None)
        self._hooks_ctx.__exit__(None, None, None)
        self._hooks_ctx = None
        # The unit whose forward ended last stays gathered for its backward, which comes next with nothing to
        # overlap a gather; unless no backward comes (no grad) or it would not read the parameters.
        last = self.root if self.root.params else (self._calls[-1] if self._calls else None)
        keep = (last is not None and last.full is not None and torch.is_grad_enabled()
                and last.needs_params_in_backward)
        self._kept = last if keep else None
        for unit in self.units:  # and the prefetches the forward did not use
            if unit is not self._kept:
                self._free(unit)
        self._plan, self._backward_cursor = list(self._calls), len(self._calls)

    # -- gather / free -----------------------------------------------------
    def _prefetch(self, unit: Unit | None) -> None:
        """Start the async all-gather of `unit` unless it is gathered or on its way."""
        if (unit is not None and unit.params and not unit.on_shards and self.prefetch and unit.full is None
                and not unit.pending):
            self._launch_gather(unit)

    def _launch_gather(self, unit: Unit) -> None:
        if self._await is not None:  # the unit's masters' values stepped where they are kept (`await_values`)
            self._await([fp.index for fp in unit.params if fp.index < self._trained])
        unit.launch_gather(self.comm)

    def _gather(self, unit: Unit) -> torch.Tensor:
        """The unit's gathered buffer, all-gathering it now if no prefetch did."""
        if unit.full is None:
            if not unit.pending:
                self._launch_gather(unit)
            unit.finish_gather()
            self._live[unit.full.untyped_storage().data_ptr()] = unit
        return unit.full

    def _free(self, unit: Unit) -> None:
        if unit.full is not None:
            del self._live[unit.full.untyped_storage().data_ptr()]
        unit.free()

    def _free_all(self) -> None:
        self._kept = None
        for unit in self.units:
            self._free(unit)

    # -- backward ----------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        if self._entered:
            self._entered[-1].saved_any = True
        if tensor.layout != torch.strided:
            return tensor
        unit = self._live.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        unit.saved_own = True
        return SavedView(unit, tensor)

    def _unpack(self, saved):
        if not isinstance(saved, SavedView):
            return saved
        unit = saved.unit
        if unit.full is None or unit is self._kept:  # its first use in this backward: gather, fetch the next one
            self._kept = None
            self._free_frozen(but=unit)
            self._gather(unit)
            self._prefetch(self._backward_next(unit))
        return saved.view()

    def _free_frozen(self, but: Unit) -> None:
        """The backward reached another unit: the units of frozen parameters alone that it gathered are done (no
        reduce-scatter frees them; were one needed again, it would be gathered again)."""
        for other in self.units:
            if other is not but and other.full is not None and not other.trains:
                self._free(other)

    def _backward_next(self, unit: Unit) -> Unit | None:
        """The unit to gather after `unit` in backward: the nearest previous call in the last forward whose
        backward needs its parameters (the calls between need none, and run their backward meanwhile)."""
        if unit is not self.root:
            positions = [j for j in range(self._backward_cursor) if self._plan[j] is unit]
            if not positions:
                return None
            self._backward_cursor = positions[-1]
        earlier = reversed(self._plan[:self._backward_cursor])
        return next((u for u in earlier if u.needs_params_in_backward), None)

    def _grad_arrived(self, indices: list[int], *_) -> None:
        """Gradients of the masters at `indices` came from this rank's backward."""
        if not self._accumulating:  # the first gradients of a step
            self._accumulating = True
            self._used = [False] * len(self._shards)
        for index in indices:
            self._used[index] = True

    def _shard_grad_arrived(self, shard: nn.Parameter) -> None:
        if shard.grad is not None:  # (autograd runs this hook for an input that got no gradient too)
            self._grad_arrived([self._shard_index[id(shard)]])

    def _reduce_scatter(self, unit: Unit, grads) -> None:
        """Launch the reduce-scatter of a unit's full gradients, free its buffer, land older ones; a unit whose
        gradients no other rank adds to keeps them (`_keep_whole`)."""
        self._grad_arrived([fp.index for fp, grad in zip(unit.params, grads) if grad is not None])
        self._free(unit)
        if self._reduced_here(unit):
            self._keep_whole(unit, grads)
            return
        # The previous unit's reduce-scatter lands before this one's input is made: its input (and a
        # backend's copy of it: gloo copies the whole input) is freed first.
        # At most one in flight (`Comm.reductions_in_flight`: overlapping this unit's backward on CUDA,
        # none on the CPU).
        while len(self._in_flight) >= max(1, self._in_flight_limit):
            self._land(*self._in_flight.popleft())
        flat = unit.flatten_grads(grads, self.precision.reduce_dtype, self._divide_by)
        out = torch.empty(unit.chunk_numel, dtype=flat.dtype, device=flat.device)
        work = self.comm.reduce_scatter(out, flat, axis=unit.axis, async_op=True)
        self._in_flight.append((unit, work, out, flat))
        while len(self._in_flight) > self._in_flight_limit:
            self._land(*self._in_flight.popleft())

    @torch.no_grad()
    def _keep_whole(self, unit: Unit, grads) -> None:
        """A whole unit's full gradients are its masters' (no layout to flatten into, nothing to reduce): each
        cast to the master dtype and divided for a mean as it is added to this backward's new gradients."""
        for fp, shard, grad in zip(unit.params, unit.shards, grads):
            if grad is None:  # as a reduction would count it: zeros (dropped later if no rank used it)
                if shard.requires_grad and fp.index not in self._new_grads:
                    self._new_grads[fp.index] = torch.zeros(shard.shape, dtype=self.precision.master_dtype,
                                                            device=self.device)
                continue
            piece, dtype = grad.reshape(shard.shape), self.precision.master_dtype
            if piece.dtype != dtype:
                piece = piece.to(dtype)
                if self._divide_by != 1:
                    piece.div_(self._divide_by)
            else:  # a new tensor either way: autograd's may be another's too, and later adds must not reach it
                piece = piece / self._divide_by if self._divide_by != 1 else piece.clone()
            if fp.index in self._new_grads:
                self._new_grads[fp.index] += piece
            else:
                self._new_grads[fp.index] = piece

    def _land(self, unit: Unit, work, out: torch.Tensor, flat: torch.Tensor) -> None:
        """Wait for one reduce-scatter and add its shard gradients to this backward's new gradients; under
        hybrid sharding, first sum the shard over the replicas (`ReplicaSum`: asynchronously, landed at
        the next reduction or when the gradients are finished)."""
        self.comm.wait([work], unit.axis)
        if self.replicas == 1 or unit.axis != self.shard_axis:  # (an axis of their own: no replicas of their shards)
            self._add_shard(unit, out)
        else:
            self._replica_sum.push(out, functools.partial(self._add_shard, unit, out))

    def _add_shard(self, unit: Unit, out: torch.Tensor) -> None:
        for index, piece in unit.shard_pieces(out):
            piece = piece.to(self.precision.master_dtype)
            if index in self._new_grads:
                self._new_grads[index] += piece
            else:
                self._new_grads[index] = piece

    # -- the engine contract -----------------------------------------------
    def finish_gradients(self) -> torch.Tensor:
        """Land every reduce-scatter and set master grads (added to an existing grad: accumulation).

        Returns, per master, 1 if this rank produced a gradient for it this step, else 0; the model
        sums them over the data ranks and drops the gradients of those no rank used
        (`drop_gradients`), as in one process, so AdamW does not decay them. With no gradient since
        the last call, returns its flags.
        """
        if not self._accumulating:
            return self._used_mask
        while self._in_flight:
            self._land(*self._in_flight.popleft())
        if self.replicas > 1:  # hybrid sharding: the last shard's sum over the replicas
            self._replica_sum.land()
        self._used_mask = used_flags(self._used[:self._trained], self._device())
        if self._store is not None and self._shards and self._shards[0].device != self.device:  # to the shards
            self._new_grads = dict(zip(self._new_grads, self._store.gradients(list(self._new_grads.values()))))
        for index, grad in self._new_grads.items():
            master = self._shards[index]
            master.grad = grad if master.grad is None else master.grad.add_(grad)
        self._new_grads.clear()
        self._free_all()  # units re-gathered for a backward that reduced none of their gradients
        self._accumulating = False
        return self._used_mask

    def drop_gradients(self, indices: list[int]) -> None:
        for i in indices:
            self._shards[i].grad = None

    def groups(self) -> list[tuple[object, bool]]:
        """This engine alone, or its masters on the shard axis and those on an axis of their own as two groups
        (`MasterGroup`)."""
        axes = self._axes[:self._trained]
        if all(axis == self.shard_axis for axis in axes):
            return [(self, False)]
        return [(MasterGroup(self, [i for i, axis in enumerate(axes) if (axis != self.shard_axis) == apart]),
                 apart) for apart in (False, True)]

    def masters(self) -> list[torch.Tensor]:
        """The fp32 shards the optimizer updates (they are also the model's parameters at rest): those of the
        parameters that train."""
        return self._shards[:self._trained]

    def master_names(self) -> list[str]:
        return self._names[:self._trained]

    def master_rows(self) -> list[tuple[str, tuple[int, int], torch.Size]]:
        """Per master (in `masters()` order): parameter name, the rows [lo, hi) it holds, the parameter's full shape."""
        return [(name, self._rows(shape, axis), shape)
                for name, shape, axis in zip(self.master_names(), self._shapes, self._axes)]

    def await_values(self, ready, defer: bool) -> None:
        """A placement's (`HostPlaced`): with `ready`, each gather first waits for its unit's masters' values
        (`_launch_gather`, `defer` or not: gathers are collectives in the forward's order already)."""
        self._await = ready

    def after_step(self) -> None:
        """Nothing to copy (the masters are the shards, cast to param_dtype at each gather) but masters' values kept
        elsewhere into the shards; and each codec refreshes what its encoding needs from the updated shards, which
        needs every master's value (`await_values`)."""
        ready = self._await
        if ready is None:
            self.values_to_device(range(self._trained))
        elif self._coded:
            ready(range(self._trained))
        for codec in self._codecs:
            codec.refresh(self._shards, [i for i, c in self._coded.items() if c is codec], self._axes, self.comm,
                          self.precision.param_dtype)

    def bring(self, indices) -> None:
        """Nothing: each gather waits for its own masters."""

    @torch.no_grad()
    def values_to_device(self, indices) -> None:
        """A placement's (`HostPlaced`): the host values of the masters at `indices` into their shards, which the
        gathers read."""
        if self._values is not None:
            torch._foreach_copy_([self._shards[i].data for i in indices], [self._values[i] for i in indices],
                                 non_blocking=True)

    def keep_master_values(self, values: list[torch.Tensor]) -> None:
        """A placement's (`HostPlaced`): the masters' values are `values` (host copies, which the optimizer steps);
        `after_step` copies them into the shards, which the gathers read."""
        self._values = values

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Σ grad² over this rank's real rows (each parameter's rows live on exactly one rank)."""
        return sum_of_squares((m.grad for m in self._shards if m.grad is not None), self._device())

    def no_sync(self) -> ContextManager:
        """A no-op: ZeRO-3 reduce-scatters every micro-batch and accumulates into master.grad."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        for master in self._shards:
            master.grad = None

    def resident_bytes(self) -> dict[str, int]:
        """Bytes alive now: shards + gathered buffers, master grads (+ in flight), separate masters (none)."""
        on = [s for s in self._shards if s.device == self.device]  # shards kept on the host are not on this device
        params = sum(_nbytes(s) for s in on) + sum(u.gathered_bytes() for u in self.units)
        grads = sum(_nbytes(s.grad) for s in on if s.grad is not None)
        grads += sum(_nbytes(g) for g in self._new_grads.values())
        grads += sum(_nbytes(out) + _nbytes(flat) for _, _, out, flat in self._in_flight)
        grads += _nbytes(self._replica_sum.in_flight) if self._replica_sum.in_flight is not None else 0
        return {"params": params, "grads": grads, "master": 0}

    @torch.no_grad()
    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter that trains whole in fp32, one all-gather at a time (collective: every rank iterates)."""
        for index, name in enumerate(self.master_names()):
            yield name, self._gather_parameter(index)

    @torch.no_grad()
    def frozen_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every frozen parameter whole in its stored dtype, one all-gather at a time (collective)."""
        for index in range(self._trained, len(self._shards)):
            yield self._names[index], self._gather_parameter(index)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with every parameter whole, in fp32 (a frozen one in its stored dtype; collective:
        call on every rank)."""
        full = [self._gather_parameter(i) for i in range(len(self._shards))]
        return {name: full[self._state_names[name]] if name in self._state_names else value.detach().clone()
                for name, value in self.model.state_dict(keep_vars=True).items()}

    def _gather_parameter(self, index: int) -> torch.Tensor:
        axis = self._axes[index]
        return gather_whole(self._shards[index], self._shapes[index], self.comm, axis, self.mesh.size(axis))


class GatherUnit(torch.autograd.Function):
    """Forward: a unit's shards -> its full parameters (views of one gathered buffer).

    Backward: reduce-scatter the full gradients (async) and free the buffer. No
    gradient is returned to the shards: the engine sets master grads when the
    reduce-scatter lands, so autograd never holds a shard-sized gradient twice.
    """

    @staticmethod
    def forward(ctx, engine, unit: Unit, *shards: torch.Tensor):
        ctx.engine, ctx.unit = engine, unit
        ctx.set_materialize_grads(False)  # None marks a parameter that got no gradient
        engine._gather(unit)
        views = unit.views()
        # a frozen parameter's full view must not require grad just because its unit-mates do
        ctx.mark_non_differentiable(*(v for v, shard in zip(views, shards) if not shard.requires_grad))
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._reduce_scatter(ctx.unit, grads)
        return (None, None) + (None,) * len(grads)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
