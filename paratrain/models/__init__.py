"""Reference Llama-style model, its named configs, and sampling."""

from paratrain.models.configs import (MODEL_CONFIGS, RECIPES, ModelConfig, ModelConfigError, Recipe, get_model_config,
                                      get_recipe)
from paratrain.models.generate import generate
from paratrain.models.llama import Transformer, init_parameter

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
