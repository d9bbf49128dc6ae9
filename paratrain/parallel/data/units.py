"""ZeRO-3 units: which parameters are gathered together, and one unit's flat layout.

A unit is a module whose parameters are all-gathered by one collective before
its forward (and again for its backward) and whose gradients are
reduce-scattered by one collective after its backward. By default the units
are the "blocks" (every child of an ``nn.ModuleList`` / ``nn.ModuleDict`` /
``nn.Sequential`` that holds parameters: the reference model's ``layers``
entries) and, outside them, every module with parameters of its own (the
embedding, the final norm, the output head), so the root is treated like the
others: each is gathered only for its own forward. The root unit holds
whatever no other unit claims (usually nothing). A parameter belongs to the nearest unit above the module that holds it; a
parameter object held by modules of two units (tied weights) is in both and is
gathered by each, its two gradients adding up in its one shard.

Flat layout of a unit over N ranks, following ``shard.py``: parameter p has
d0_p rows of rest_p elements (a 0-d parameter is one row of one element), and
c_p = ceil(d0_p / N) rows per rank. Rank r's chunk is the concatenation over p
of its c_p·rest_p elements (its real rows, then zero padding), C = Σ_p c_p·rest_p
elements in all. The all-gather output and the reduce-scatter input are
[N, C], row r being rank r's chunk. Within [N, C] the rows of one parameter are
not contiguous (they are interleaved with the other parameters' rows), so the
full parameters live in a second, contiguous buffer of Σ_p d0_p·rest_p
elements, filled by one copy right after the gather; each full parameter is a
view of it and the [N, C] gather output is dropped at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis
from paratrain.parallel.data.shard import chunk_padding, chunk_tiles, rows_per_rank

class ZeroConfigError(ParatrainError, ValueError):
    """A ZeRO-3 setting or model that the engine cannot shard."""


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
UnitSpec = Callable[[str, nn.Module], bool] | tuple[type, ...] | str | None


def row_shape(shape: torch.Size) -> torch.Size:
    """The shape a parameter is sharded in: itself, or one row for a 0-d parameter."""
    return shape if len(shape) else torch.Size([1])


def unit_modules(model: nn.Module, spec: UnitSpec) -> list[tuple[str, nn.Module]]:
    """(name, module) of every non-root unit, in registration order.

    `spec` is None (the default policy below), ``"blocks"`` (its blocks only: the root unit holds
    everything else, gathered for the whole forward), a tuple of module classes, or a predicate
    (qualified name, module) -> bool.

    The default: every child of an ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential`` that
    holds parameters is a block (a list or dict of modules there is only a holder: its entries
    are), one unit with everything below it (the reference model's ``layers`` entries, a Hugging
    Face model's decoder layers, the layers of a plain Sequential);
    and outside the blocks, every module that holds parameters of its own (an embedding, a final
    norm, an output head) is a unit too, so that it is gathered only while its own forward runs,
    not for the whole model's. A model that reads such a module's parameters outside that
    module's forward needs ``"blocks"`` or a `units=` that groups them with the module that
    reads them (the engine checks this in the first forward, and says so).
    """
    if spec not in (None, "blocks") and isinstance(spec, str):
        raise ValueError(f"units={spec!r}: use None, 'blocks', module classes or a predicate")
    if spec is None or spec == "blocks":
        loose = spec is None
        picked: list[tuple[str, nn.Module]] = []
        seen: set[int] = set()

        def visit(prefix: str, module: nn.Module) -> None:
            in_container = isinstance(module, _CONTAINERS)
            for name, child in module._modules.items():
                if child is None or id(child) in seen:
                    continue
                seen.add(id(child))
                # A block: one unit, nothing below it split. A list or dict of modules inside is only a
                # holder (it has no forward): its entries are the blocks. A Sequential has a forward: a block.
                if in_container and not isinstance(child, (nn.ModuleList, nn.ModuleDict)) and _has_params(child):
                    picked.append((prefix + name, child))
                    continue
                if loose and any(p is not None for p in child._parameters.values()):
                    picked.append((prefix + name, child))
                visit(prefix + name + ".", child)

        visit("", model)
        return picked
    if isinstance(spec, tuple):
        pick = lambda name, m: isinstance(m, spec)  # noqa: E731
    else:
        pick = spec
    return [(name, m) for name, m in model.named_modules() if m is not model and pick(name, m)]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def parameter_slots(model: nn.Module, unit_ids: set[int]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) holding a parameter, keyed by the id of its nearest unit (the root's for the rest)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {id(model): []}
    seen: set[int] = set()

    def walk(module: nn.Module, owner: int) -> None:
        if id(module) in seen:  # a module reachable twice is one module (as in named_modules)
            return
        seen.add(id(module))
        owner = id(module) if id(module) in unit_ids else owner
        slots.setdefault(owner, [])
        slots[owner] += [(module, attr) for attr, p in module._parameters.items() if p is not None]
        for child in module._modules.values():
            if child is not None:
                walk(child, owner)

    walk(model, id(model))
    return slots


@dataclass(frozen=True)
class FlatParam:
    """One parameter's place in its unit's flat buffers."""

    index: int          # the engine's parameter index (its master)
    shape: torch.Size   # full shape
    chunk_offset: int   # element offset inside one rank's chunk
    full_offset: int    # element offset inside the full-parameter buffer

    @property
    def rows(self) -> int:
        return row_shape(self.shape)[0]

    @property
    def rest(self) -> int:
        return math.prod(row_shape(self.shape)[1:])

    def chunk_numel(self, num_ranks: int) -> int:
        return rows_per_rank(self.rows, num_ranks) * self.rest


class Unit:
    """The parameters of one unit, their slots in the model, and their gathered state.

    States: free (only shards exist), pending (an async all-gather in flight),
    gathered (`full` holds every full parameter). A fresh buffer is allocated
    per gather, so a view that escaped an earlier gather still reads the values
    it was computed with.
    """

    def __init__(self, name: str, module: nn.Module, slots: list[tuple[nn.Module, str, int]],
                 shards: list[nn.Parameter], full_shapes: list[torch.Size], num_ranks: int, axis: Axis = Axis.DP):
        """`slots`: (module, attribute, engine parameter index) of every parameter slot in the unit; the
        shards are split over the `num_ranks` ranks of the mesh axis `axis`."""
        self.name, self.module, self.num_ranks, self.axis = name, module, num_ranks, axis
        order = list(dict.fromkeys(index for _, _, index in slots))  # each parameter once, in first-use order
        self.slots = [(mod, attr, order.index(index)) for mod, attr, index in slots]
        self.shards = [shards[i] for i in order]
        self.params: list[FlatParam] = []
        chunk_offset = full_offset = 0
        for i in order:
            self.params.append(FlatParam(i, full_shapes[i], chunk_offset, full_offset))
            chunk_offset += self.params[-1].chunk_numel(num_ranks)
            full_offset += math.prod(full_shapes[i])
        self.chunk_numel, self.full_numel = chunk_offset, full_offset
        self.full: torch.Tensor | None = None
        self._pending = None
        # What the unit's forward saved for backward through the engine's saved-tensor hooks (in the last
        # forward): anything, and views of its gathered parameters.
        self.saved_any = self.saved_own = False

    @property
    def needs_params_in_backward(self) -> bool:
        """Whether the unit's backward reads its gathered parameters, judged from what its forward saved.

        It does when the forward saved a view of them (a matmul's weight). It does not when the forward
        saved tensors, none of them its parameters (an embedding saves only its indices; a weight cast
        to another dtype is saved as that copy): autograd will ask for nothing to gather. When the forward
        saved nothing through the engine's hooks, nothing is known (activation checkpointing saves
        through hooks of its own, and its recomputation gathers the unit again): it does.
        """
        return self.saved_own or not self.saved_any

    # -- gather -----------------------------------------------------------
    def launch_gather(self, comm: Comm, dtype: torch.dtype) -> None:
        """Copy the local rows (cast to `dtype`, zero-padded) into one chunk and start the all-gather."""
        device = self.shards[0].device
        chunk = torch.empty(self.chunk_numel, dtype=dtype, device=device)
        for fp, shard in zip(self.params, self.shards):
            n = shard.numel()
            chunk[fp.chunk_offset:fp.chunk_offset + n].copy_(shard.detach().reshape(-1))
            chunk[fp.chunk_offset + n:fp.chunk_offset + fp.chunk_numel(self.num_ranks)].zero_()  # padding
        gathered = torch.empty(self.num_ranks * self.chunk_numel, dtype=dtype, device=device)
        work = comm.all_gather(gathered, chunk, axis=self.axis, async_op=True)
        self._pending = (work, gathered, chunk, comm)  # chunk must outlive the collective

    def finish_gather(self) -> None:
        """Wait for the all-gather and copy it out into the contiguous full-parameter buffer."""
        work, gathered, _, comm = self._pending
        self._pending = None
        comm.wait([work], self.axis)
        chunks = gathered.view(self.num_ranks, self.chunk_numel)
        full = torch.empty(self.full_numel, dtype=gathered.dtype, device=gathered.device)
        for fp in self.params:
            rows2d = full[fp.full_offset:fp.full_offset + math.prod(fp.shape)].view(fp.rows, fp.rest)
            part = chunks[:, fp.chunk_offset:fp.chunk_offset + fp.chunk_numel(self.num_ranks)]
            for dst, src in chunk_tiles(rows2d, part):
                dst.copy_(src)
        self.full = full

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def free(self) -> None:
        """Drop the full parameters (waiting first for a gather still in flight: gloo writes into its buffer)."""
        if self._pending is not None:
            work, _, _, comm = self._pending
            comm.wait([work], self.axis)
            self._pending = None
        self.full = None

    def views(self) -> list[torch.Tensor]:
        """Each full parameter as a view of the gathered buffer, in unit parameter order."""
        return [self.full[fp.full_offset:fp.full_offset + math.prod(fp.shape)].view(fp.shape) for fp in self.params]

    def gathered_bytes(self) -> int:
        """Bytes of the gather buffers alive now."""
        alive = [self.full] + (list(self._pending[1:3]) if self._pending else [])
        return sum(t.numel() * t.element_size() for t in alive if t is not None)

    # -- module slots ------------------------------------------------------
    def install(self, tensors) -> None:
        """Put `tensors` (one per unit parameter) in the unit's module slots."""
        for mod, attr, k in self.slots:
            mod._parameters[attr] = tensors[k]

    def restore(self) -> None:
        """Put the shards back in the module slots (the at-rest state)."""
        self.install(self.shards)

    # -- reduce-scatter ----------------------------------------------------
    def flatten_grads(self, grads, dtype: torch.dtype, divide_by: int) -> torch.Tensor:
        """Full gradients (None: no gradient, counted as zeros) as the [N·C] reduce-scatter input in `dtype`.

        Every element is written once: rows by a (scaled) copy, padding and missing gradients by
        zeros; nothing is zero-filled first.
        """
        flat = torch.empty(self.num_ranks, self.chunk_numel, dtype=dtype, device=self.shards[0].device)
        for fp, grad in zip(self.params, grads):
            part = flat[:, fp.chunk_offset:fp.chunk_offset + fp.chunk_numel(self.num_ranks)]
            if grad is None:
                part.zero_()
                continue
            for src, dst in chunk_tiles(grad.reshape(fp.rows, fp.rest), part):
                torch.div(src, divide_by, out=dst) if divide_by != 1 else dst.copy_(src)
            for pad in chunk_padding(fp.rows, fp.rest, part):
                pad.zero_()
        return flat.view(-1)

    def shard_pieces(self, chunk: torch.Tensor):
        """(parameter index, this rank's real rows) views of a reduce-scatter output chunk."""
        return [(fp.index, chunk[fp.chunk_offset:fp.chunk_offset + shard.numel()].view(shard.shape))
                for fp, shard in zip(self.params, self.shards)]


class SavedView:
    """A tensor saved for backward that is a view of a unit's gathered buffer, kept as a recipe."""

    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit: Unit, tensor: torch.Tensor):
        self.unit, self.offset, self.size, self.stride = unit, tensor.storage_offset(), tensor.size(), tensor.stride()
