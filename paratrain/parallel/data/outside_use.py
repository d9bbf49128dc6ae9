"""ZeRO-3's check of the first forward: a parameter read outside its unit's forward, where it is a shard."""

from __future__ import annotations

import torch

from paratrain.compat import ObservingMode, tree_leaves
from paratrain.parallel.data.units import ZeroConfigError


class OutsideUse(ObservingMode):  # compiled blocks compile and run under it
    """Active during the first forward: an operator on a shard is a parameter read outside its unit's forward.

    At rest a unit's module slots hold the shards; inside the unit's forward they hold the full
    parameters. A model that reads a parameter from somewhere else (a weight used transposed by
    its parent, say) would compute with the shard, which is the wrong shape or, worse, the right
    shape with the wrong values: this says so, once, with the fix.
    """

    def __init__(self, engine):  # the `zero3.FullyShardedEngine` whose shards it watches
        super().__init__()
        self.engine, self.active = engine, True
        self.names = {id(shard): name for shard, name in zip(engine._shards, engine._names)}
        self.owners = {name: unit.name or "the root" for unit in engine.units
                       for name in (engine._names[fp.index] for fp in unit.params)}
        # A unit that computes on its shards (`Unit.on_shards`) reads them inside its forward, rightly.
        self.readers: dict[int, list] = {}
        for unit in engine.units:
            for fp in unit.params if unit.on_shards else ():
                self.readers.setdefault(id(engine._shards[fp.index]), []).append(unit)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.engine._in_engine:
            for leaf in tree_leaves((args, kwargs)):
                name = self.names.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if (name is not None and any(leaf is s for s in self.engine._shards)
                        and not any(unit in self.engine._entered for unit in self.readers.get(id(leaf), ()))):
                    raise ZeroConfigError(
                        f"ZeRO-3: parameter {name!r} is read outside the forward of its unit "
                        f"({self.owners.get(name, 'the root')!r}), where it is this rank's shard; use "
                        f"DataParallel(units='blocks') (parameters outside the blocks stay gathered for the whole "
                        f"forward) or units= that puts that module together with the one that reads it")
        return func(*args, **(kwargs or {}))
