"""A model's blocks and ZeRO-3's units: which of its modules are the repeated blocks (`unit_modules`).

One rule for every strategy that works block by block: ZeRO-3 gathers each unit
(`paratrain.parallel.data.units`), recomputation and compilation wrap each block
(`paratrain.parallel.recompute`, `paratrain.parallel.compile`), FP8 converts the
linears inside the blocks (`paratrain.parallel.fp8`).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
UnitSpec = Callable[[str, nn.Module], bool] | tuple[type, ...] | str | None



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
