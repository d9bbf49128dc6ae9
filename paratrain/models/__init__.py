"""Reference Llama-style model, its named configs, and sampling."""

from paratrain.models.configs import MODEL_CONFIGS, ModelConfig, ModelConfigError, get_model_config
from paratrain.models.generate import generate
from paratrain.models.llama import Transformer, init_parameter

__all__ = [
    "MODEL_CONFIGS",
    "ModelConfig",
    "ModelConfigError",
    "Transformer",
    "generate",
    "get_model_config",
    "init_parameter",
]
