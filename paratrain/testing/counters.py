"""Count, at torch's dispatcher, what a step asks of the host and of the network.

Two dispatch modes that watch whatever runs under them, paratrain or PyTorch's own:

- `HostSyncs`: the operations that make the host wait for the device (a GPU's stall,
  found on the CPU).
- `Collectives`: the bytes every c10d collective sends, per process group or mesh axis,
  independently of what paratrain's `Comm` counts.
- `MemoryTraffic`: the bytes every operator reads and writes in memory, per operator: what a
  memory-bound stretch of a step (the optimizer, the casts, the gradient norm) costs a GPU.

Tests and benchmarks use them (`paratrain.testing` holds them for both).
"""

from __future__ import annotations

from typing import Callable

import torch

from paratrain.compat import TorchDispatchMode

__all__ = ["Collectives", "HostSyncs", "MemoryTraffic"]


class HostSyncs(TorchDispatchMode):
    """Count the operations that make the host wait for the device, on any device.

    On a GPU the host runs ahead of the kernels it queues; an operation whose result the host
    must read (a scalar read by `.item()`/`float()`/`bool()`, `nonzero` and other ops whose
    output size depends on the values, `.tolist()`/`.numpy()`) stalls it until the device has
    caught up. On the CPU nothing stalls, but the same calls are made, so counting them here
    finds the syncs a GPU would pay. `.tolist()` and `.numpy()` read memory without an operator:
    they are counted by wrapping them while the mode is active. Tensors made on the host before
    the count began (a batch from the data loader) can be excused with `host=`.
    """

    _VALUE_DEPENDENT = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                        "unique_consecutive", "unique_dim", "equal", "is_nonzero", "bincount", "histc")

    def __init__(self, host: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.calls: list[str] = []
        self._host = {t.untyped_storage().data_ptr() for t in host}
        self._saved: dict[str, Callable] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in self._VALUE_DEPENDENT and not self._from_host(args):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))

    def _from_host(self, args) -> bool:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return bool(tensors) and all(t.untyped_storage().data_ptr() in self._host for t in tensors)

    def __enter__(self):
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(tensor, *a, _original=original, _name=method, **k):
                if tensor.untyped_storage().data_ptr() not in self._host:
                    self.calls.append(_name)
                return _original(tensor, *a, **k)
            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)


def _all_to_all_sent(input: torch.Tensor, input_splits: list[int], rank: int, n: int) -> float:
    """Bytes of an all-to-all's input that go to other ranks: all but this rank's own split (equal splits if none)."""
    total = input.numel() * input.element_size()
    rows = input.shape[0] if input.dim() else 1
    own = input_splits[rank] if input_splits else rows // n
    return total - own * (total / rows if rows else 0)


class Collectives(TorchDispatchMode):
    """Bytes that reach torch.distributed, per process group, counted from the tensors of each c10d op.

    Every collective torch.distributed issues passes the dispatcher as a ``c10d`` operator with
    its tensors and its process group. This counts them as a bandwidth-optimal ring sends them
    from one rank, on average over the ranks (all-reduce 2·S·(n−1)/n of a tensor of S bytes,
    all-gather and reduce-scatter S·(n−1)/n of the full tensor, broadcast S·(n−1)/n) under the
    group's name, independently of what
    paratrain's own `Comm` believes it issued. `by_axis(mesh)` names the groups by mesh axis.
    """

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.op_bytes: dict[str, float] = {}  # the same bytes by operator (all groups): "allreduce_", "_allgather_base_"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._count(func._overloadpacket.__name__, args)
        return func(*args, **(kwargs or {}))

    def _count(self, op: str, args) -> None:
        group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        if group is None:
            return
        group = torch.distributed.ProcessGroup.unbox(group)
        n = group.size()
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
        nbytes = [t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)]
        if op.startswith("allreduce"):
            sent = 2 * sum(nbytes) * (n - 1) / n
        elif op.startswith(("_allgather_base", "_reduce_scatter_base", "allgather_into_tensor",
                            "reduce_scatter_tensor")):
            sent = max(nbytes) * (n - 1) / n  # the full tensor is the output of a gather, the input of a scatter
        elif op.startswith("broadcast"):
            sent = sum(nbytes) * (n - 1) / n  # a ring's (or tree's) S·(n−1) in all, per rank
        elif op.startswith("alltoall_base"):  # (output, input, group, output splits, input splits, ...)
            sent = _all_to_all_sent(args[1], args[4], group.rank(), n)
        else:
            sent = 0.0  # point-to-point and barriers: not what this count is for
        name = group.group_name
        self.op_bytes[op] = self.op_bytes.get(op, 0.0) + sent
        self.bytes[name] = self.bytes.get(name, 0.0) + sent
        self.calls[name] = self.calls.get(name, 0) + 1

    def by_axis(self, mesh) -> dict[str, float]:
        """Bytes sent per mesh axis (a group no axis of `mesh` names is reported under its own name)."""
        names = {}
        for axis, group in mesh.groups.items():
            if group is not None:
                names.setdefault(group.group_name, axis)
        out: dict[str, float] = {}
        for name, sent in self.bytes.items():
            out[names.get(name, name)] = out.get(names.get(name, name), 0.0) + sent
        return out


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _size(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MemoryTraffic(TorchDispatchMode):
    """Bytes each operator reads and writes, as its schema declares them (the device runs what the host asks).

    An operator reads every tensor it is given and writes what its schema marks as written (an in-place
    operand, an `out=`) and every fresh output; a view or an allocation moves nothing; a copy or fill does not
    read what it overwrites. Communication is not counted here (`Collectives` is). `by_op` maps operator name to bytes.
    """

    _OVERWRITES = frozenset({"copy_", "_foreach_copy_", "fill_", "_foreach_fill_", "zero_", "_foreach_zero_"})
    _ALLOCATES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})  # no write

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "c10d" and not func.is_view and func._overloadpacket.__name__ not in self._ALLOCATES:
            self._count(func, args, kwargs, out)
        return out

    def _count(self, func, args, kwargs, out) -> None:
        name = func._overloadpacket.__name__
        schema = func._schema.arguments
        given = [(a, args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema)]
        written = [v for a, v in given if a.alias_info is not None and a.alias_info.is_write]
        read = [v for a, v in given if not (name in self._OVERWRITES and v is given[0][1])]
        inputs = {id(t) for t in _tensors([v for _, v in given])}
        fresh = [t for t in _tensors(out) if id(t) not in inputs]
        total = _size(_tensors(read)) + _size(_tensors(written)) + _size(fresh)
        self.by_op[name] = self.by_op.get(name, 0) + total
