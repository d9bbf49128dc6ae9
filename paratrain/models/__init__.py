"""Reference Llama-style model, its named configs, and sampling.

The configs and `generate` import no torch at import time; the model needs it and is imported
on first use (PEP 562), so that reading a config (the planner, `paratrain models`) does not
import torch.
"""

from __future__ import annotations

import importlib

from paratrain.models.configs import (MODEL_CONFIGS, RECIPES, ModelConfig, ModelConfigError, Recipe, get_model_config,
                                      get_recipe)
from paratrain.models.generate import generate

_LAZY = {"Transformer": "paratrain.models.llama", "init_parameter": "paratrain.models.llama"}

__all__ = [
    "MODEL_CONFIGS",
    "RECIPES",
    "ModelConfig",
    "ModelConfigError",
    "Recipe",
    "Transformer",
    "generate",
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
