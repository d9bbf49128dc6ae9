"""Hugging Face Llama and Mixtral directories: parameter names, `config.json` ↔ `ModelConfig`, reading the
weights under our names.

Names: `Transformer` and `LlamaForCausalLM` share the rotary convention (rotate-half), so
weights move across under `hf_name` / `from_hf_name` unchanged (no permutation of wq/wk).

A mixture of experts (`ModelConfig.n_experts` > 0) is a ``MixtralForCausalLM``, stored as the
Mixtral checkpoints on the Hub store it (and as transformers 5 still saves it, fusing the experts
only in memory): the router ``model.layers.{i}.block_sparse_moe.gate.weight`` [E, D] is our
``layers.{i}.feed_forward.router.weight``; expert j's ``...block_sparse_moe.experts.{j}.w1.weight``
[F, D], ``w3`` [F, D] and ``w2`` [D, F] are row j of our stacked ``feed_forward.experts.w1`` [E, F, D],
``w3`` [E, F, D] and ``w2`` [E, D, F] (`hf_names`). Mixtral routes as paratrain does: a softmax over
all E logits in fp32, the top k, their weights renormalized to sum to 1. Its training-time
load-balancing loss differs (transformers' ``load_balancing_loss_func`` averages the token fractions
and probabilities over all layers and tokens before the product and does not divide the fractions
by k, so a uniform load gives k, not one per layer); ``router_aux_loss_coef`` is carried over as
`aux_loss_coef` all the same, a coefficient of paratrain's own per-layer loss. A shared expert has
no Mixtral counterpart and is refused.

A directory holds ``config.json`` (a ``LlamaForCausalLM`` config) and the
weights, either in one ``model.safetensors`` or in several files listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``).
`HFWeights` opens one, checks every tensor's name and shape against the
config without reading any data, and then reads one tensor at a time, so a
rank that materializes its slices never holds more than one whole tensor.

Only what `paratrain.models.Transformer` computes is accepted: silu SwiGLU,
no biases, plain rotary embeddings or Llama 3.1's ``llama3`` rope scaling, a head size of
hidden_size / num_attention_heads. Anything else is refused with one line
naming the field, rather than loaded into a model that would compute
something else.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from paratrain.errors import ParatrainError
from paratrain.models import ModelConfig, ModelConfigError, Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"
MOE_ARCHITECTURE = "MixtralForCausalLM"
_ARCHITECTURES = {"llama": ARCHITECTURE, "mixtral": MOE_ARCHITECTURE}
# Stored by some converters, recomputed by every Llama implementation: not a weight.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Defaults of Hugging Face's LlamaConfig for keys a config.json may leave out.
_HF_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": False}


class HFNameError(ParatrainError, ValueError):
    """A parameter name has no counterpart in the other naming scheme."""


_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",  # Mixtral
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Our stacked expert tensors [E, ...]: one Mixtral tensor per expert, named by its index j.
_OURS_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def hf_name(name: str) -> str:
    """Hugging Face Llama (or Mixtral) name of our parameter `name`, e.g. layers.3.attention.wq.weight →
    model.layers.3.self_attn.q_proj.weight. A stacked expert tensor has one name per expert: `hf_names`."""
    return _translate(name, _TOP, _OURS_BLOCK, _BLOCK, "model.layers.{}.{}")


def from_hf_name(name: str) -> str:
    """Our parameter name for the Hugging Face name `name`; the inverse of `hf_name` (a Mixtral expert's
    tensor names the stacked tensor it is a row of, `from_hf_expert` says which)."""
    expert = from_hf_expert(name)
    if expert is not None:
        return expert[0]
    return _translate(name, _TOP_INV, _HF_BLOCK, _BLOCK_INV, "layers.{}.{}")


def is_stacked_experts(name: str) -> bool:
    """Whether our parameter `name` stacks the experts of a layer ([E, ...]: one Hugging Face tensor per row)."""
    return _OURS_EXPERTS.fullmatch(name) is not None


def hf_names(name: str, num_experts: int = 0) -> list[str]:
    """The Hugging Face tensors of our parameter `name`, in order: one, or for a stacked expert tensor
    layers.{i}.feed_forward.experts.w1 the E rows model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight."""
    match = _OURS_EXPERTS.fullmatch(name)
    if match is None:
        return [hf_name(name)]
    layer, weight = match.groups()
    return [f"model.layers.{layer}.block_sparse_moe.experts.{j}.{weight}.weight" for j in range(num_experts)]


def from_hf_expert(name: str) -> tuple[str, int] | None:
    """(our stacked tensor, row j) of a Mixtral expert tensor name; None for any other name."""
    match = _HF_EXPERT.fullmatch(name)
    if match is None:
        return None
    layer, j, weight = match.groups()
    return f"layers.{layer}.feed_forward.experts.{weight}", int(j)


def _translate(name: str, top: dict, block_re: re.Pattern, block: dict, block_fmt: str) -> str:
    if name in top:
        return top[name]
    match = block_re.fullmatch(name)
    if match and match.group(2) in block:
        return block_fmt.format(match.group(1), block[match.group(2)])
    raise HFNameError(f"parameter name {name!r} has no Llama counterpart; check the model's state_dict keys")


class HFError(ParatrainError, ValueError):
    """A Hugging Face directory (or an export source) is missing, malformed, or describes an unsupported model."""


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32, tokens: dict | None = None) -> dict:
    """The ``config.json`` of a `LlamaForCausalLM` (a `MixtralForCausalLM` for a mixture of experts) computing
    what `Transformer(cfg)` computes.

    `tokens` may give ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``.
    """
    if cfg.n_experts:
        return _mixtral_config(cfg, dtype, tokens)
    doc = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": hf_rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    doc.update({k: v for k, v in (tokens or {}).items() if v is not None})
    return doc


def hf_rope_scaling(cfg: ModelConfig) -> dict | None:
    """config.json's rope_scaling for `cfg` (None: plain rotary embeddings)."""
    if cfg.rope_scaling == "none":
        return None
    return {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len}


def _mixtral_config(cfg: ModelConfig, dtype: torch.dtype, tokens: dict | None) -> dict:
    """`hf_config` of a mixture of experts: a Mixtral config (its intermediate_size is one expert's width)."""
    if cfg.shared_expert:
        raise HFError("shared_expert=true has no Mixtral counterpart; only routed experts export")
    doc = {
        "architectures": [MOE_ARCHITECTURE],
        "model_type": "mixtral",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.expert_ffn_dim or cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": hf_rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    doc.update({k: v for k, v in (tokens or {}).items() if v is not None})
    return doc


def model_config_from_hf(doc: Any, where: str = CONFIG_FILE) -> ModelConfig:
    """The `ModelConfig` of a ``config.json`` document; HFError naming the field if it is not a plain Llama or
    Mixtral."""
    if not isinstance(doc, dict):
        raise HFError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    _check_supported(doc, where)
    rope = _rope_fields(doc, where)
    try:
        return ModelConfig(
            vocab_size=_required(doc, "vocab_size", where),
            dim=_required(doc, "hidden_size", where),
            n_layers=_required(doc, "num_hidden_layers", where),
            n_heads=_required(doc, "num_attention_heads", where),
            n_kv_heads=doc.get("num_key_value_heads") or _required(doc, "num_attention_heads", where),
            ffn_dim=_required(doc, "intermediate_size", where),
            max_seq_len=_get(doc, "max_position_embeddings"),
            norm_eps=float(_get(doc, "rms_norm_eps")),
            **rope,
            tie_embeddings=_get(doc, "tie_word_embeddings"),
            **_moe_fields(doc, where),
        )
    except (ModelConfigError, TypeError, ValueError) as exc:
        raise HFError(f"{where}: {exc}") from None


def _moe_fields(doc: dict, where: str) -> dict:
    """The mixture-of-experts fields of a Mixtral config (none for a Llama one)."""
    if doc.get("model_type", "llama") != "mixtral":
        return {}
    sliding = doc.get("sliding_window")
    if sliding is not None and sliding < _get(doc, "max_position_embeddings"):
        raise HFError(f"{where}: sliding_window {sliding} is not supported; paratrain's attention is full "
                      f"causal (set sliding_window null)")
    return {"n_experts": _required(doc, "num_local_experts", where),
            "top_k": _required(doc, "num_experts_per_tok", where),
            "aux_loss_coef": float(doc.get("router_aux_loss_coef", 0.001))}


def _check_supported(doc: dict, where: str) -> None:
    model_type = doc.get("model_type", "llama")
    if model_type not in _ARCHITECTURES:
        raise HFError(f"{where}: model_type {model_type!r} is not supported; only 'llama' and 'mixtral' models "
                      f"import")
    architecture = _ARCHITECTURES[model_type]
    architectures = doc.get("architectures") or [architecture]
    if architecture not in architectures:
        raise HFError(f"{where}: architectures {architectures} has no {architecture!r}; only causal-LM "
                      f"{model_type} weights (with lm_head) import")
    if doc.get("hidden_act", "silu") != "silu":
        raise HFError(f"{where}: hidden_act {doc['hidden_act']!r} is not supported; paratrain's Llama uses 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if doc.get(key):
            raise HFError(f"{where}: {key}=true is not supported; paratrain's Llama has no biases")
    head_dim, hidden, heads = doc.get("head_dim"), doc.get("hidden_size"), doc.get("num_attention_heads")
    if head_dim is not None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
            and head_dim * heads != hidden:
        raise HFError(f"{where}: head_dim {head_dim} differs from hidden_size/num_attention_heads = "
                      f"{hidden}/{heads}; only head_dim = hidden_size/num_attention_heads is supported")


_LLAMA3_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_seq_len"}


def _rope_fields(doc: dict, where: str) -> dict:
    """rope_theta and the rope scaling, from the top level and rope_scaling (transformers 4) or from
    rope_parameters (transformers 5): plain rotary embeddings, or Llama 3.1's "llama3" scaling."""
    params = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise HFError(f"{where}: rope_parameters {params!r} is not an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFError(f"{where}: rope_type {kind!r} is not supported; only plain rotary embeddings ('default') and "
                      f"Llama 3.1's 'llama3' scaling import")
    theta = params.get("rope_theta", doc.get("rope_theta", _HF_DEFAULTS["rope_theta"]))
    if "rope_theta" in doc and "rope_theta" in params and doc["rope_theta"] != theta:
        raise HFError(f"{where}: rope_theta {doc['rope_theta']} and rope_parameters.rope_theta {theta} disagree")
    if kind == "default":
        return {"rope_theta": float(theta)}
    missing = [key for key in _LLAMA3_KEYS if key not in params]
    if missing:
        raise HFError(f"{where}: rope scaling 'llama3' needs {missing[0]}")
    return {"rope_theta": float(theta), "rope_scaling": "llama3",
            **{ours: (int if ours == "rope_original_max_seq_len" else float)(params[theirs])
               for theirs, ours in _LLAMA3_KEYS.items()}}


def _required(doc: dict, key: str, where: str) -> Any:
    if doc.get(key) is None:
        raise HFError(f"{where}: {key} is missing; a Llama config.json needs it")
    return doc[key]


def _get(doc: dict, key: str) -> Any:
    value = doc.get(key)
    return _HF_DEFAULTS[key] if value is None else value


def read_hf_config(directory: str | os.PathLike) -> ModelConfig:
    """The model config of the Hugging Face directory `directory` (reads config.json only)."""
    directory = _existing_dir(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise HFError(f"{directory} has no {CONFIG_FILE}; pass a directory written by `paratrain export` or "
                      f"by save_pretrained")
    return model_config_from_hf(_load_json(path), str(path))


def from_pretrained(directory: str | os.PathLike, dtype: torch.dtype | None = None):
    """paratrain's reference model (`paratrain.models.Transformer`) with the weights of the Hugging Face Llama or
    Mixtral directory `directory` (config.json and safetensors; what `paratrain train --init-from` loads), on the
    CPU in fp32 (or `dtype`), in eval mode. Anything the model would not compute as the directory
    describes is refused in one line (HFError)."""
    from paratrain.models import Transformer

    weights = HFWeights(directory)
    with torch.device("meta"):
        model = Transformer(weights.config)
    model.to_empty(device="cpu")
    model.load_state_dict(weights.state_dict(), strict=True)
    weights.close()
    return (model.to(dtype) if dtype is not None else model).eval()


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name → shape for `Transformer(cfg)`, a tied table once (as `tok_embeddings.weight`);
    a stacked expert tensor whole ([E, ...])."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


class HFWeights:
    """The weights of a Hugging Face Llama directory, checked against its config, read one tensor at a time.

    `config` is the directory's `ModelConfig`; `names` our parameter names (a
    tied table once); `read(name)` one whole tensor in its stored dtype, on
    the CPU. ``output.weight`` of a tied model reads the embedding table.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = _existing_dir(directory)
        self.config = read_hf_config(self.directory)
        self._shapes = expected_shapes(self.config)
        self._stored = _stored_tensors(self.directory)  # HF name -> (file, shape)
        self._handles: dict[str, Any] = {}
        self._check_tensors()

    @property
    def names(self) -> list[str]:
        """Our names of the parameters, in model order."""
        return list(self._shapes)

    def read(self, name: str) -> torch.Tensor:
        """Parameter `name` (our naming), whole, in the stored dtype."""
        if self.config.tie_embeddings and name == "output.weight":
            name = "tok_embeddings.weight"
        if name not in self._shapes:
            raise HFError(f"{self.directory}: the model has no parameter {name!r}")
        if is_stacked_experts(name):  # one stored tensor per expert, stacked in expert order
            return torch.stack([self._read_hf(key) for key in hf_names(name, self.config.n_experts)])
        return self._read_hf(hf_name(name))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, loadable with `Transformer(config).load_state_dict(..., strict=True)`.

        A tied model's ``output.weight`` is the same tensor as ``tok_embeddings.weight``.
        """
        state = {name: self.read(name) for name in self.names}
        if self.config.tie_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        return state

    def close(self) -> None:
        """Release the open files (they reopen on demand)."""
        self._handles.clear()

    def _read_hf(self, key: str) -> torch.Tensor:
        file = self._stored[key][0]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(self.directory / file), framework="pt", device="cpu")
        with torch.device("cpu"):  # host memory, whatever default device the caller set
            return handle.get_tensor(key)

    def _check_tensors(self) -> None:
        """Names and shapes of every stored tensor against the config (from the file headers only).

        A stacked expert tensor [E, ...] is checked as its E stored rows, each of the shape [...].
        """
        stored = set()
        for key, (file, _) in self._stored.items():
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            try:
                from_hf_name(key)
            except HFNameError:
                raise HFError(f"{self.directory / file}: tensor {key!r} is not part of a Llama model (nor of a "
                              f"Mixtral one)") from None
            stored.add(key)
        tied_head = hf_name("output.weight") if self.config.tie_embeddings else None
        tied_head = tied_head if tied_head in stored else None
        wanted = {key: (name, shape) for name, shape in self._shapes.items() for key, shape in self._stored_form(name, shape)}
        missing = [key for key in wanted if key not in stored]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise HFError(f"{self.directory}: tensor {missing[0]!r} is missing{more}")
        for key, (_, expected) in wanted.items():
            shape = self._stored[key][1]
            if shape != expected:
                raise HFError(f"{self.directory}: tensor {key!r} has shape {list(shape)} but "
                              f"config.json implies {list(expected)}")
        if tied_head is not None:
            self._check_tied_head(tied_head)

    def _stored_form(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """(stored key, shape) of each tensor holding our parameter `name` of `shape`."""
        if is_stacked_experts(name):
            return [(key, shape[1:]) for key in hf_names(name, shape[0])]
        return [(hf_name(name), shape)]

    def _check_tied_head(self, key: str) -> None:
        """tie_word_embeddings with an lm_head.weight stored anyway: accepted only if it is the table."""
        embedding = hf_name("tok_embeddings.weight")
        if not torch.equal(self._read_hf(key), self._read_hf(embedding)):
            raise HFError(f"{self.directory}: config.json says tie_word_embeddings=true but {key!r} differs "
                          f"from {embedding!r}")


def _stored_tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name → (file, shape) for a single-file or sharded (index) layout, from the headers."""
    index, single = directory / INDEX_FILE, directory / WEIGHTS_FILE
    if index.is_file():
        doc = _load_json(index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFError(f"{index}: expected an object with a 'weight_map' of tensor name → file name")
    elif single.is_file():
        weight_map = None
    else:
        raise HFError(f"{directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}; only safetensors weights import")
    files = sorted(set(weight_map.values())) if weight_map is not None else [WEIGHTS_FILE]
    stored = {}
    for file in files:
        shapes = _header_shapes(directory, file, index if weight_map is not None else None)
        keys = [k for k, f in weight_map.items() if f == file] if weight_map is not None else list(shapes)
        for key in keys:
            if key not in shapes:
                raise HFError(f"{index} lists tensor {key!r} in {file}, which does not hold it")
            stored[key] = (file, shapes[key])
    return stored


def _header_shapes(directory: Path, file: str, index: Path | None) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of one safetensors file (reads its header only)."""
    path = directory / file
    if Path(file).name != file or not path.is_file():
        raise HFError(f"{index} lists {file!r}, which is not a file in {directory}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors for damaged files
        raise HFError(f"{path}: not a readable safetensors file ({exc})") from None


def _existing_dir(directory: str | os.PathLike) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise HFError(f"{directory} is not a directory")
    return directory


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFError(f"{path}: not valid JSON ({exc})") from None
