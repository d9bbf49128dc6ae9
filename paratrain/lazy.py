"""Names a package exports without importing their modules until first use (PEP 562).

`import paratrain` and the commands that need no tensors (`paratrain plan`, `paratrain models`) do
not pay for importing torch: the names whose modules import it are looked up on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a module path) on first use of `name`, then keeps the
    value in the package's `namespace` so that later lookups are plain attribute reads."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    return __getattr__
