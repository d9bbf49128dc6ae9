"""One data-parallel engine per group of parameters, each reducing over the ranks that hold that group's copies.

Most parameters are copies on every data rank; a block of experts (expert parallelism) only on
the `ep_replicate` data ranks that hold the same block. `GroupedEngine` runs one
`DataParallelEngine` per group, each over its own axis, and answers the `Engine` contract for
all of them: masters, names and flags are the groups' in order, one after the other. Which
copies a rank owns (`paratrain.mesh.replicated_over`) is then a property of the group, so the
engine says, per master, which group it belongs to (`expert`). One engine that holds both kinds
itself (ZeRO-3 sharding each over its own axis) reports them as two `MasterGroup`s instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from paratrain.parallel.data.engine import sum_of_squares


class GroupedEngine:
    """Several engines, each over its own parameters and axis, as one `Engine`; `experts[i]`: whether group i
    holds expert tensors."""

    def __init__(self, engines: list, experts: list[bool]):
        self.engines, self.experts = engines, experts
        self.params_sharded = any(e.params_sharded for e in engines)
        self._sizes = [len(e.masters()) for e in engines]

    @property
    def grads_sharded(self) -> bool:
        return self.engines[0].grads_sharded

    def groups(self) -> list[tuple[object, bool]]:
        """(engine, holds experts) per group."""
        return list(zip(self.engines, self.experts))

    def masters(self) -> list[torch.Tensor]:
        return [m for e in self.engines for m in e.masters()]

    def master_names(self) -> list[str]:
        return [n for e in self.engines for n in e.master_names()]

    def master_rows(self):
        return [r for e in self.engines for r in e.master_rows()]

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.no_sync())
            yield

    def finish_gradients(self) -> torch.Tensor:
        return torch.cat([e.finish_gradients() for e in self.engines])

    def drop_gradients(self, indices: list[int]) -> None:
        start = 0
        for engine, size in zip(self.engines, self._sizes):
            engine.drop_gradients([i - start for i in indices if start <= i < start + size])
            start += size

    def after_step(self) -> None:
        for engine in self.engines:
            engine.after_step()

    def await_values(self, ready, defer: bool) -> None:
        for engine, start in zip(self.engines, self._starts()):
            engine.await_values(ready and (lambda indices, start=start: ready([start + i for i in indices])), defer)

    def values_to_device(self, indices) -> None:
        for engine, part in zip(self.engines, self._split(indices)):
            engine.values_to_device(part)

    def bring(self, indices) -> None:
        for engine, part in zip(self.engines, self._split(indices)):
            engine.bring(part)

    def _split(self, indices) -> list[list[int]]:
        """`indices` of `masters()` as each engine's own."""
        return [[i - start for i in indices if start <= i < start + size]
                for start, size in zip(self._starts(), self._sizes)]

    def _starts(self) -> list[int]:
        """Where each engine's masters begin in `masters()`."""
        return [sum(self._sizes[:k]) for k in range(len(self._sizes))]

    def keep_master_values(self, values: list[torch.Tensor]) -> None:
        start = 0
        for engine, size in zip(self.engines, self._sizes):
            engine.keep_master_values(values[start:start + size])
            start += size

    def zero_grad(self) -> None:
        for engine in self.engines:
            engine.zero_grad()

    def local_grad_sq_sum(self) -> torch.Tensor:
        return sum(e.local_grad_sq_sum() for e in self.engines)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for engine in self.engines:
            yield from engine.full_parameters()

    def resident_bytes(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for engine in self.engines:
            for key, value in engine.resident_bytes().items():
                totals[key] = totals.get(key, 0) + value
        return totals


class MasterGroup:
    """Some of one engine's masters, seen as a group: what `ParallelModel` asks a group (its gradient norm's
    part, whose copies count) of the engine's masters at `indices`."""

    def __init__(self, engine, indices: list[int]):
        self.engine, self.indices = engine, indices
        self.grads_sharded, self.params_sharded = engine.grads_sharded, engine.params_sharded

    def masters(self) -> list[torch.Tensor]:
        masters = self.engine.masters()
        return [masters[i] for i in self.indices]

    def master_names(self) -> list[str]:
        names = self.engine.master_names()
        return [names[i] for i in self.indices]

    def local_grad_sq_sum(self) -> torch.Tensor:
        return sum_of_squares((m.grad for m in self.masters() if m.grad is not None), self.engine.device)
