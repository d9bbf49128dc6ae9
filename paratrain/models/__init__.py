"""Reference Llama-style model, its named configs, and sampling.

The configs and `generate` import no torch at import time; the model needs it and is imported
on first use (PEP 562), so that reading a config (the planner, `paratrain models`) does not
import torch.
"""

from __future__ import annotations

from paratrain.lazy import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
