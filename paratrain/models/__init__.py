"""Reference Llama-style model, its named configs, and sampling (`paratrain.models.generate`).

The configs are pure Python; the model needs torch and is imported on first use (PEP 562), so
that reading a config (the planner, `paratrain models`) does not import torch. Sampling is its own
submodule's `generate` (a package attribute of that name would be shadowed by the submodule).
"""

from __future__ import annotations

import importlib

from paratrain.models.configs import (MODEL_CONFIGS, RECIPES, ModelConfig, ModelConfigError, Recipe, get_model_config,
                                      get_recipe)

_LAZY = {"Transformer": "paratrain.models.llama", "init_parameter": "paratrain.models.llama"}

__all__ = [
    "MODEL_CONFIGS",
    "RECIPES",
    "ModelConfig",
    "ModelConfigError",
    "Recipe",
    "Transformer",
    "get_model_config",
    "get_recipe",
    "init_parameter",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'paratrain.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
