"""The training state of a parallel model as boxes of global tensors: what each rank saves, what each rank loads.

Each master weight (fp32) is saved as ``model/<parameter name>`` and each of
its optimizer state tensors as ``optim/<parameter name>/<key>`` (Adam:
``exp_avg``, ``exp_avg_sq``, ``step``), under the parameter's global shape.
A rank's box of a master composes two splits:

* tensor parallelism splits the parameter along dim 0 or dim 1 into tp equal
  slices (`TensorParallelInfo.global_shape` gives the tp-local slice's offset);
* ZeRO splits the tp-local parameter along dim 0: rank r of N holds rows
  [lo, hi) (`paratrain.parallel.data.shard`), so the box's offset on dim 0 is the
  tp offset + lo and its shape (hi − lo, rest of the tp-local shape).

Every box is written by exactly one rank, the one that owns its copies
(`paratrain.mesh`: `Mesh.owns` of the axes `ParallelModel.replicated_over`
names): a master replicated over dp (DDP, zero=0) only by dp coordinate 0, a
ZeRO shard kept by every replica of hybrid sharding only by dp_replicate
coordinate 0, a parameter replicated over tp (not in ``tp_info.sharded``)
only by tp coordinate 0, an empty box (trailing ZeRO ranks of a short
tensor) by nobody. Element-wise optimizer state has its
master's box. Scalar state (``step``) is a 0-d tensor, written by the rank
that writes the master's first box (offset all zeros): a scalar rather than
shared state because under pipeline parallelism rank 0 does not hold every
parameter, and every stage writes its own names.

Loading reads exactly this rank's boxes in the new layout, whatever layout
saved them (`CheckpointReader.read` assembles a box from the stored ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.checkpoint.format import IncompatibleCheckpointError, ShardSpec
from paratrain.checkpoint.reader import CheckpointReader

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


@dataclass(frozen=True)
class MasterBox:
    """Where one of this rank's masters sits in its global tensor, and whether this rank writes it."""

    name: str  # the parameter's name
    master: torch.Tensor
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]  # the master viewed as its box
    empty: bool  # this rank holds no element of the parameter (trailing ZeRO rank of a short tensor)
    writer: bool

    @property
    def first(self) -> bool:
        """Whether this box starts at the global tensor's origin (its writer then writes the scalar state)."""
        return not any(self.offset)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the master or an element-wise state of it) viewed as the box."""
        return tensor.reshape(self.shape)


def master_boxes(model) -> list[MasterBox]:
    """This rank's masters with their boxes, in the engine's order."""
    mesh, tp_info, expert_info = model.mesh, model.tp_info, getattr(model, "expert_info", None)
    boxes = []
    for master, (name, (lo, hi), local_shape) in zip(model.masters(), model.master_rows()):
        local_shape = tuple(local_shape)
        if local_shape:
            global_shape, tp_offset = (tp_info.global_shape(name, local_shape) if tp_info is not None
                                       else (local_shape, (0,) * len(local_shape)))
            if expert_info is not None and name in expert_info.names:  # a block of experts: offset on dim 0
                global_shape, tp_offset = expert_info.global_shape(name, local_shape)
            offset, shape = (tp_offset[0] + lo, *tp_offset[1:]), (hi - lo, *local_shape[1:])
        else:  # a 0-d parameter: ZeRO shards it as one row of one element
            global_shape, offset, shape = (), (), ()
        writer = mesh.owns(model.replicated_over(name)) and hi > lo  # (a tied head's copies: pp rank 0's)
        boxes.append(MasterBox(model.whole_name(name), master, tuple(global_shape), tuple(offset), tuple(shape),
                               hi == lo, writer))
    return boxes


def _state_items(optimizer, box: MasterBox):
    """(key, tensor, element-wise?) of the optimizer state of one master."""
    if optimizer is None:
        return
    for key, value in optimizer.state.get(box.master, {}).items():
        if not torch.is_tensor(value):
            raise IncompatibleCheckpointError(f"optimizer state {key!r} of {box.name} is a {type(value).__name__}; "
                                              "only tensor state can be checkpointed")
        if value.shape == box.master.shape and value.dim() > 0:
            yield key, value, True
        elif value.numel() == 1:
            yield key, value.reshape(()), False
        else:
            raise IncompatibleCheckpointError(f"optimizer state {key!r} of {box.name} has shape {list(value.shape)}, "
                                              f"neither the parameter's {list(box.master.shape)} nor a scalar")


def model_shards(model, optimizer, held: bool = False) -> dict[str, tuple[ShardSpec, torch.Tensor]]:
    """What this rank writes: {key: (ShardSpec, tensor)} for `save_checkpoint`, masters and optimizer state.

    With `held`, every non-empty box this rank holds, written or not (and the scalar state of each): a
    checkpoint of this rank alone from which it reloads all it holds (a snapshot, `paratrain.checkpoint.snapshot`).
    """
    shards = {}
    for box in master_boxes(model):
        if not (box.writer or (held and not box.empty)):
            continue
        name = MODEL_PREFIX + box.name
        shards[name] = (ShardSpec(name, box.global_shape, box.offset), box.view(box.master.detach()))
        for key, value, elementwise in _state_items(optimizer, box):
            state_name = f"{OPTIM_PREFIX}{box.name}/{key}"
            if elementwise:
                shards[state_name] = (ShardSpec(state_name, box.global_shape, box.offset), box.view(value))
            elif box.first or held:
                shards[state_name] = (ShardSpec(state_name, (), ()), value)
    return shards


def expected_tensors(model, reader: CheckpointReader) -> dict[str, tuple[tuple[int, ...], torch.dtype | str]]:
    """{name: (global shape, dtype)} the current model expects of `reader`'s checkpoint, model tensors first.

    Optimizer entries follow the stored ones (an optimizer that has not stepped has no state
    yet): each must belong to one of the model's parameters and have its shape (or be a scalar).
    """
    boxes = master_boxes(model)
    expected = {MODEL_PREFIX + b.name: (b.global_shape, b.master.dtype) for b in boxes}
    by_name = {b.name: b for b in boxes}
    for stored in reader.names():
        if not stored.startswith(OPTIM_PREFIX):
            continue
        box = by_name.get(_parameter_of(stored))
        if box is None:
            continue  # unexpected: reported by check_compatible under strict checking
        scalar = reader.global_shape(stored) == () and box.global_shape != ()
        expected[stored] = ((), reader.dtype(stored)) if scalar else (box.global_shape, box.master.dtype)
    return expected


def check_compatible(model, reader: CheckpointReader) -> None:
    """Raise IncompatibleCheckpointError naming the first tensor whose shape or dtype the model does not expect.

    Then every expected tensor must be stored and every stored one expected; a pipeline
    stage expects only its own parameters and tolerates those of the other stages.
    """
    expected = expected_tensors(model, reader)
    compat = reader.check_compatible(expected, strict=False)  # raises for a shape or dtype mismatch
    elsewhere = _other_stages_names(model)
    unexpected = [n for n in compat.unexpected if _parameter_of(n) not in elsewhere]
    problems = [f"{what} the checkpoint: {_name_list(names)}"
                for what, names in (("missing from", compat.missing), ("unexpected in", unexpected)) if names]
    if problems:
        raise IncompatibleCheckpointError(f"{reader.path.name} does not match the model: {'; '.join(problems)}")


def _other_stages_names(model) -> set[str]:
    """Parameter names that other pipeline stages hold (none without pipeline parallelism)."""
    return set(model.pipeline.split.param_owner) if model.pipeline is not None else set()


def _parameter_of(stored: str) -> str:
    """The parameter name of a stored tensor: model/<name> or optim/<name>/<key>."""
    if stored.startswith(MODEL_PREFIX):
        return stored[len(MODEL_PREFIX):]
    return stored[len(OPTIM_PREFIX):].rpartition("/")[0] if stored.startswith(OPTIM_PREFIX) else stored


def _name_list(names) -> str:
    names = list(names)
    shown = ", ".join(names[:5])
    return shown if len(names) <= 5 else f"{shown}, … ({len(names)} in all)"


@torch.no_grad()
def load_model_shards(model, optimizer, reader: CheckpointReader) -> None:
    """Load this rank's boxes of masters and optimizer state from `reader`, saved under any layout.

    Checks compatibility first (IncompatibleCheckpointError naming the first mismatching
    tensor and both shapes), then makes the model's parameters consistent with the loaded
    masters (`parameters_from_masters`: the engine's own post-step path; ZeRO-1/2: all-gather of
    every rank's rows; mixed-precision DDP: the cast copy; ZeRO-3: nothing; the loss scale does
    not move). Collective under ZeRO-1/2.
    The optimizer's state is replaced by the checkpoint's, placed as torch's own
    `Optimizer.load_state_dict` places it.
    """
    check_compatible(model, reader)
    stored = set(reader.names())
    states = {}
    for box in master_boxes(model):
        if box.empty:
            continue  # no element to load; the optimizer never sees one either
        box.view(box.master).copy_(reader.read(MODEL_PREFIX + box.name, box.offset, box.shape))
        if optimizer is not None:
            states[box.master] = _read_state(box, reader, stored)
    if optimizer is not None:
        _load_optimizer_state(optimizer, states)
    model.parameters_from_masters()


def _read_state(box: MasterBox, reader: CheckpointReader, stored: set[str]) -> dict[str, torch.Tensor]:
    """The optimizer state of one master from the checkpoint ({} if the saved optimizer had not stepped it)."""
    prefix = f"{OPTIM_PREFIX}{box.name}/"
    state = {}
    for name in sorted(name for name in stored if name.startswith(prefix)):
        if reader.global_shape(name) == () and box.global_shape != ():
            state[name[len(prefix):]] = reader.read(name)  # a scalar (Adam's step): torch's load places it
        else:
            # Shaped as the master: onto its device and into its dtype as soon as it is read (where torch's
            # load puts such state too, and then leaves it), so the host holds one of them at a time.
            value = reader.read(name, box.offset, box.shape)
            state[name[len(prefix):]] = value.to(box.master.device, box.master.dtype).reshape(box.master.shape)
    return state


def _load_optimizer_state(optimizer, states: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    """Give the optimizer `states` (per master) through torch's own `load_state_dict`, with its current param groups.

    Torch's load decides where each value lives, and it depends on the optimizer: a fused or
    capturable one keeps Adam's `step` on the parameter's device in fp32 (CUDA's fused kernel
    reads it there: a host tensor is an illegal access, or a wrong step), the others on the host;
    the rest of the state goes to the parameter's device and dtype.
    """
    groups = optimizer.state_dict()["param_groups"]  # torch's numbering of the parameters, hyperparameters as they are
    index = {id(p): i for group, numbered in zip(optimizer.param_groups, groups)
             for p, i in zip(group["params"], numbered["params"])}
    optimizer.load_state_dict({"state": {index[id(master)]: state for master, state in states.items()
                                         if state and id(master) in index},
                               "param_groups": groups})
