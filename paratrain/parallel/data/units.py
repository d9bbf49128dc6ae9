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

A unit one rank holds whole (its axis has one rank) has chunks of its real rows only, laid out as the full
buffer: its chunk is that buffer, with nothing to gather or copy out, and its gradients need no flat layout
(the engine keeps them as its masters'); where the chunk would be a copy of the shards (their dtype, their
device, no codec) the module computes on the shards themselves (`Unit.on_shards`).

The gather's buffers are bytes: each parameter travels as its codec says (`GatherCodec`: the compute
dtype by default; a codec of the caller's may carry another dtype, e.g. one byte per element with a scale,
and hand the module what it computes with), its place in a chunk and in the full buffer aligned to its dtype
(to the largest alignment a codec of the unit asks for), so that every full parameter is an aligned view of
its dtype. The reduce-scatter's layout is the elements' above, in the reduce dtype, of the parameters that
train alone.

A frozen parameter (`requires_grad=False`: a LoRA base) is sharded and gathered like the others but never
reduce-scattered: it has no place in the reduce-scatter's layout (a unit of frozen parameters alone has none at
all), and it travels as its shard is stored (`frozen_gather_dtype`): in the compute dtype, or in its own dtype
where that is narrower (a bf16 base under fp32 compute, an NF4 base's bytes), the module casting it as one
process does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis
from paratrain.parallel.data.shard import Tile, row_tiles, rows_per_rank


class ZeroConfigError(ParatrainError, ValueError):
    """A ZeRO-3 setting or model that the engine cannot shard."""


class GatherCodec:
    """What some parameters travel as in their unit's all-gather, and what their module computes with after it:
    the extension point for parameters gathered otherwise than as their values in the compute dtype.

    The engine asks each codec it was given which parameters it takes (`claims`), after each optimizer step lets
    it derive what its encoding needs from the updated shards (`refresh`, collective: every rank calls it), and
    around each gather calls `encode` (this rank's rows into its chunk) and, once gathered, `decode` (the tensor
    autograd sees in the module's slot) and `install` / `restore` (anything else the module reads). Parameters no
    codec takes travel as their values in the compute dtype, in one batched copy.
    """

    align = 1  # bytes: where each parameter of a unit holding one of this codec's starts

    def dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype this codec's parameters travel in."""
        return compute_dtype

    def reads(self, module: nn.Module, attr: str) -> bool:
        """Whether `module` reads its parameter `attr` only through this codec's decoding."""
        return False

    def claims(self, slots: list[tuple[nn.Module, str, int]]) -> frozenset[int]:
        """The parameters (engine indices) of the (module, attribute, index) `slots` this codec carries: those that
        every slot holding them reads only through it (a parameter tied to another reader travels plainly)."""
        return frozenset({i for _, _, i in slots} - {i for mod, attr, i in slots if not self.reads(mod, attr)})

    def refresh(self, shards: list[torch.Tensor], indices: list[int], axes: list[Axis], comm: Comm,
                compute_dtype: torch.dtype) -> None:
        """After the masters changed: what encoding the parameters at `indices` (their `shards`, split over
        `axes[i]`) needs from their new values (collective: every rank calls it)."""

    def encode(self, index: int, values: torch.Tensor, out: torch.Tensor):
        """This rank's rows of parameter `index` (flat, in the compute dtype) into `out` (flat, in `dtype`); returns
        what `decode` and `install` need of this gather."""
        out.copy_(values)

    def decode(self, gathered: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        """What the module's slot holds (autograd gives it the parameter's gradient), from the gathered parameter."""
        return gathered

    def install(self, module: nn.Module, gathered: torch.Tensor, meta) -> None:
        """Whatever else `module` reads of the gathered parameter (`meta`: what `encode` returned)."""

    def restore(self, module: nn.Module) -> None:
        """Undo `install`."""


def frozen_gather_dtype(stored: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """What a frozen parameter stored in `stored` travels in: the compute dtype, or its own where that is not a
    float or is narrower (casting it to the compute dtype is then the module's, after the gather)."""
    if not stored.is_floating_point or stored.itemsize < compute_dtype.itemsize:
        return stored
    return compute_dtype


def row_shape(shape: torch.Size) -> torch.Size:
    """The shape a parameter is sharded in: itself, or one row for a 0-d parameter."""
    return shape if len(shape) else torch.Size([1])


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
    """One parameter's place in its unit's flat buffers, and how its rows split over the unit's ranks
    (`shard.row_tiles`), computed once: the layout never changes, each step applies it to fresh buffers."""

    index: int          # the engine's parameter index (its master)
    shape: torch.Size   # full shape
    num_ranks: int      # the ranks its rows are split over
    chunk_offset: int   # element offset inside one rank's chunk of the reduce-scatter (a frozen one: none, -1)
    gather_dtype: torch.dtype  # what it is gathered as: the compute dtype, or its codec's
    chunk_byte: int     # byte offset inside one rank's chunk of the all-gather
    full_byte: int      # byte offset inside the full-parameter buffer
    codec: GatherCodec | None = None  # None: its values in the compute dtype
    # Derived from the above when it is made:
    rows: int = field(init=False, compare=False)  # the parameter as rows × rest (a 0-d one: one row of one element)
    rest: int = field(init=False, compare=False)
    chunk_numel: int = field(init=False, compare=False)  # elements of one rank's chunk (its rows, then padding)
    tiles: list[Tile] = field(init=False, compare=False)  # its rows of elements ↔ the reduce-scatter's columns
    padding: list[tuple[slice, slice]] = field(init=False, compare=False)  # ... and the columns that hold no row
    gathered_tiles: list[Tile] = field(init=False, compare=False)  # its rows of bytes ↔ the gathered columns

    def __post_init__(self):
        shape = row_shape(self.shape)
        rows, rest = shape[0], math.prod(shape[1:])
        tiles, padding = row_tiles(rows, self.num_ranks, rest)
        derived = {"rows": rows, "rest": rest, "chunk_numel": rows_per_rank(rows, self.num_ranks) * rest,
                   "tiles": tiles, "padding": padding,
                   "gathered_tiles": row_tiles(rows, self.num_ranks, rest * self.gather_dtype.itemsize)[0]}
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def trains(self) -> bool:
        """Whether its gradient is reduce-scattered (a frozen parameter has none)."""
        return self.chunk_offset >= 0


class Unit:
    """The parameters of one unit, their slots in the model, and their gathered state.

    States: free (only shards exist), pending (an async all-gather in flight),
    gathered (`full` holds every full parameter). A fresh buffer is allocated
    per gather, so a view that escaped an earlier gather still reads the values
    it was computed with.
    """

    def __init__(self, name: str, module: nn.Module, slots: list[tuple[nn.Module, str, int]],
                 shards: list[nn.Parameter], full_shapes: list[torch.Size], num_ranks: int, axis: Axis = Axis.DP,
                 gather_dtype: torch.dtype = torch.float32, codecs: dict[int, GatherCodec] | None = None,
                 device: torch.device | None = None):
        """`slots`: (module, attribute, engine parameter index) of every parameter slot in the unit; the
        shards are split over the `num_ranks` ranks of the mesh axis `axis` and gathered in `gather_dtype` onto
        `device` (None: the shards'; shards may live on the host), but the parameters (engine indices) in
        `codecs` as their codec encodes them, and frozen shards (`requires_grad=False`) as `frozen_gather_dtype`
        says, outside the reduce-scatter's layout."""
        codecs = codecs or {}
        self.name, self.module, self.num_ranks, self.axis = name, module, num_ranks, axis
        self.device = device or (shards[slots[0][2]].device if slots else torch.device("cpu"))
        order = list(dict.fromkeys(index for _, _, index in slots))  # each parameter once, in first-use order
        self.slots = [(mod, attr, order.index(index)) for mod, attr, index in slots]
        self.shards = [shards[i] for i in order]
        self.params: list[FlatParam] = []
        chunk_offset = chunk_byte = full_byte = 0
        align = max([gather_dtype.itemsize] + [codecs[i].align for i in order if i in codecs])
        for i in order:
            codec, trains = codecs.get(i), shards[i].requires_grad
            dtype = codec.dtype(gather_dtype) if codec is not None else \
                gather_dtype if trains else frozen_gather_dtype(shards[i].dtype, gather_dtype)
            fp = FlatParam(i, full_shapes[i], num_ranks, chunk_offset if trains else -1, dtype, chunk_byte, full_byte,
                           codec)
            self.params.append(fp)
            chunk_offset += fp.chunk_numel if trains else 0
            chunk_byte += -(-fp.chunk_numel * dtype.itemsize // align) * align
            full_byte += -(-math.prod(fp.shape) * dtype.itemsize // align) * align
        # chunk_numel: elements of one rank's chunk of the reduce-scatter (0: every parameter frozen)
        self.chunk_numel, self.chunk_bytes, self.full_bytes = chunk_offset, chunk_byte, full_byte
        self.gather_dtype = gather_dtype
        # Every row of every parameter is here (one rank on the unit's axis): the local chunk is the whole unit,
        # laid out as the full buffer (one rank's padded rows are the rows), so it is the full buffer.
        self.whole = num_ranks == 1
        assert not self.whole or self.chunk_bytes == self.full_bytes
        # The module computes on the shards themselves, the parameters at rest (nothing gathered; autograd
        # accumulates into the masters' gradients): set by the engine where a whole unit's shards already are
        # what it would gather (`computes_on_shards`) and its gradients are summed over no other rank.
        self.on_shards = False
        self.full: torch.Tensor | None = None  # bytes
        self.meta: dict[int, object] = {}  # per codec-encoded parameter, what its encoding of `full` returned
        self._pending = None
        # What the unit's forward saved for backward through the engine's saved-tensor hooks (in the last
        # forward): anything, and views of its gathered parameters.
        self.saved_any = self.saved_own = False

    @property
    def computes_on_shards(self) -> bool:
        """Whether gathering this unit would copy its shards unchanged: whole, each parameter gathered in its
        shard's dtype (no codec), on the device its shard lives on."""
        return self.whole and all(fp.codec is None and fp.gather_dtype == shard.dtype
                                  and shard.device.type == self.device.type
                                  for fp, shard in zip(self.params, self.shards))

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
    def launch_gather(self, comm: Comm) -> None:
        """Copy the local rows (cast to their gather dtype, or encoded by their codec; zero-padded) into one chunk
        and start the all-gather; a whole unit's chunk is its full buffer, with nothing to gather."""
        device = self.device
        chunk = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=device)
        self.meta = {}
        dsts, srcs = [], []  # one foreach copy (a cast, in mixed precision) for the parameters no codec encodes
        for fp, shard in zip(self.params, self.shards):
            n = shard.numel()
            values = chunk[fp.chunk_byte:fp.chunk_byte + fp.chunk_numel * fp.gather_dtype.itemsize]
            values = values.view(fp.gather_dtype)
            rows = shard.detach().reshape(-1).to(device, non_blocking=True)  # (shards on the host: copied here)
            if fp.codec is not None:  # the compute dtype's values encoded, as a whole parameter's would be
                self.meta[fp.index] = fp.codec.encode(fp.index, rows.to(self.gather_dtype), values[:n])
            else:
                dsts.append(values[:n])
                srcs.append(rows)
            if n < values.numel():
                values[n:].view(torch.uint8).zero_()  # padding
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if self.whole:
            self._pending = (None, chunk, None, comm)
            return
        gathered = torch.empty(self.num_ranks * self.chunk_bytes, dtype=torch.uint8, device=device)
        work = comm.all_gather(gathered, chunk, axis=self.axis, async_op=True)
        self._pending = (work, gathered, chunk, comm)  # chunk must outlive the collective

    def finish_gather(self) -> None:
        """Wait for the all-gather and copy it out into the contiguous full-parameter buffer (a whole unit's
        chunk is that buffer already)."""
        work, gathered, _, comm = self._pending
        self._pending = None
        if self.whole:
            self.full = gathered
            return
        comm.wait([work], self.axis)
        chunks = gathered.view(self.num_ranks, self.chunk_bytes)
        full = torch.empty(self.full_bytes, dtype=torch.uint8, device=gathered.device)
        for fp in self.params:
            size = fp.gather_dtype.itemsize
            rows2d = full[fp.full_byte:fp.full_byte + math.prod(fp.shape) * size].view(fp.rows, fp.rest * size)
            part = chunks[:, fp.chunk_byte:fp.chunk_byte + fp.chunk_numel * size]
            for rows, shape, columns in fp.gathered_tiles:
                rows2d[rows].view(shape).copy_(part[columns])
        self.full = full

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def free(self) -> None:
        """Drop the full parameters (waiting first for a gather still in flight: gloo writes into its buffer)."""
        if self._pending is not None:
            work, _, _, comm = self._pending
            if work is not None:
                comm.wait([work], self.axis)
            self._pending = None
        self.full = None

    def full_view(self, fp: FlatParam) -> torch.Tensor:
        """One full parameter, in its gather dtype, as a view of the gathered buffer."""
        size = fp.gather_dtype.itemsize
        return self.full[fp.full_byte:fp.full_byte + math.prod(fp.shape) * size].view(fp.gather_dtype).view(fp.shape)

    def views(self) -> list[torch.Tensor]:
        """What the unit's module computes with, in unit parameter order: each full parameter as a view of the
        gathered buffer, or what its codec decodes from that view."""
        return [fp.codec.decode(self.full_view(fp), self.gather_dtype) if fp.codec is not None else self.full_view(fp)
                for fp in self.params]

    def gathered_bytes(self) -> int:
        """Bytes of the gather buffers alive now."""
        alive = [self.full] + (list(self._pending[1:3]) if self._pending else [])
        return sum(t.numel() * t.element_size() for t in alive if t is not None)

    # -- module slots ------------------------------------------------------
    def install(self, tensors) -> None:
        """Put `tensors` (one per unit parameter, `views`) in the unit's module slots, and what a codec's module
        reads besides (`GatherCodec.install`)."""
        for mod, attr, k in self.slots:
            mod._parameters[attr] = tensors[k]
            fp = self.params[k]
            if fp.codec is not None:
                fp.codec.install(mod, self.full_view(fp), self.meta[fp.index])

    def restore(self) -> None:
        """Put the shards back in the module slots (the at-rest state)."""
        for mod, attr, k in self.slots:
            mod._parameters[attr] = self.shards[k]
            if self.params[k].codec is not None:
                self.params[k].codec.restore(mod)

    # -- reduce-scatter ----------------------------------------------------
    def flatten_grads(self, grads, dtype: torch.dtype, divide_by: int) -> torch.Tensor:
        """Full gradients (None: no gradient, counted as zeros; a frozen parameter's: none, left out) as the [N·C]
        reduce-scatter input in `dtype`.

        Every element is written once: rows by a (scaled) copy, padding and missing gradients by
        zeros; nothing is zero-filled first.
        """
        flat = torch.empty(self.num_ranks, self.chunk_numel, dtype=dtype, device=self.device)
        for fp, grad in zip(self.params, grads):
            if not fp.trains:
                continue
            part = flat[:, fp.chunk_offset:fp.chunk_offset + fp.chunk_numel]
            if grad is None:
                part.zero_()
                continue
            grad = grad.reshape(fp.rows, fp.rest)
            for rows, shape, columns in fp.tiles:
                src, dst = grad[rows].reshape(shape), part[columns]
                torch.div(src, divide_by, out=dst) if divide_by != 1 else dst.copy_(src)
            for columns in fp.padding:
                part[columns].zero_()
        return flat.view(-1)

    def shard_pieces(self, chunk: torch.Tensor):
        """(parameter index, this rank's real rows) views of a reduce-scatter output chunk, for those that train."""
        return [(fp.index, chunk[fp.chunk_offset:fp.chunk_offset + shard.numel()].view(shard.shape))
                for fp, shard in zip(self.params, self.shards) if fp.trains]

    @property
    def trains(self) -> bool:
        """Whether any of its parameters trains (a unit of frozen parameters alone is never reduce-scattered)."""
        return any(fp.trains for fp in self.params)


@torch.no_grad()
def gather_whole(shard: torch.Tensor, shape: torch.Size, comm: Comm, axis: Axis, ranks: int) -> torch.Tensor:
    """One parameter of `shape` whole, in its shards' dtype, from this rank's `shard` of it over `axis` (collective;
    on the mesh's device, wherever the shard lives)."""
    rows = row_shape(shape)
    c = math.ceil(rows[0] / ranks)
    device = comm.mesh.device
    chunk = torch.empty((c, *rows[1:]), dtype=shard.dtype, device=device)
    chunk[:shard.shape[0]] = shard
    chunk[shard.shape[0]:].zero_()  # padding
    out = torch.empty((ranks * c, *rows[1:]), dtype=shard.dtype, device=device)
    comm.all_gather(out.view(-1), chunk.view(-1), axis=axis)
    return out[:rows[0]].reshape(shape).clone()


class SavedView:
    """A tensor saved for backward that is a view of a unit's gathered buffer, kept as a recipe."""

    __slots__ = ("unit", "dtype", "offset", "size", "stride")

    def __init__(self, unit: Unit, tensor: torch.Tensor):
        self.unit, self.dtype = unit, tensor.dtype
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()

    def view(self) -> torch.Tensor:
        """The saved view, of the unit's buffer as gathered now."""
        return self.unit.full.view(self.dtype).as_strided(self.size, self.stride, self.offset)


def default_init(model: nn.Module, originals: dict[str, nn.Parameter]):
    """ZeRO-3's initializer of a meta model's parameters: its own `param_init` (None: the parameters are real)."""
    if not any(p.is_meta for p in originals.values()):
        return None
    if not hasattr(model, "param_init"):
        raise ZeroConfigError(f"{type(model).__name__} is on the meta device and has no param_init; "
                              "pass init=(name, full_shape) -> full fp32 tensor")
    return functools.partial(model.param_init, seed=0)


def check_buffers(model: nn.Module) -> None:
    """ZeroConfigError for a buffer still on the meta device (ZeRO-3 shards parameters, not buffers)."""
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise ZeroConfigError(f"buffer {name!r} is on the meta device; materialize buffers before sharding")
