"""Any causal language model transformers implements, trained as transformers defines it.

    config = read_model_dir("Qwen2.5-0.5B/")          # HFModelConfig: the shape the planner and trainer read
    model = HFCausalLM.build(config)                    # on the meta device, transformers' own modules
    init = weight_initializer(model, "Qwen2.5-0.5B/")   # (paratrain.interop.hf_weights) one tensor read at a time

The model is `AutoModelForCausalLM.from_config` of the directory's ``config.json``: paratrain
re-implements no family. `HFCausalLM` holds it and registers its top-level modules as its own,
so that its parameters carry transformers' names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``): checkpoints and the exported directory use them. Its forward takes token ids
(and `position_ids`, as context parallelism passes them) and returns the logits.

Loading is lazy: the model is built on the meta device, its buffers (rotary frequencies) computed
by transformers' own `_init_weights`, and each parameter filled when the rank materializes it (its
tensor-parallel slice, under ZeRO-3 its rows): read from the directory's safetensors one tensor at a
time (`paratrain.interop.hf_weights`), or seeded from the model's own initialization
(`seeded_initializer`: `--model DIR`, from scratch).

Nothing is executed from the directory: a config that needs remote code (``auto_map``) is refused
in one line, as is a model_type this transformers does not implement as a causal LM.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from paratrain.errors import ParatrainError
from paratrain.models.configs import ExpertShape

CONFIG_FILE = "config.json"
# model_type values paratrain's reference model computes (`paratrain.interop.hf`): the fast path unless
# --backend transformers asks otherwise.
REFERENCE_TYPES = ("llama", "mixtral")
BACKENDS = ("auto", "reference", "transformers")
# Stored by some converters, recomputed by the model: not a weight.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFModelError(ParatrainError, ValueError):
    """A model directory transformers cannot build, or whose weights contradict its config; one line saying why."""


def is_model_dir(path: str | None) -> bool:
    """Whether `path` names a directory with a config.json (--model DIR, --init-from DIR)."""
    return bool(path) and (Path(path) / CONFIG_FILE).is_file()


def model_type(directory: str | Path) -> str:
    """The model_type of the directory's config.json (read as JSON only)."""
    return str(_config_doc(Path(directory)).get("model_type", ""))


def uses_transformers(directory: str | Path, backend: str) -> bool:
    """Whether the directory trains on transformers' modeling code: asked for, or a family the reference model is not."""
    if backend not in BACKENDS:
        raise HFModelError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return model_type(directory) not in REFERENCE_TYPES
    return backend == "transformers"


def _config_doc(directory: Path) -> dict:
    if not directory.is_dir():
        raise HFModelError(f"{directory} is not a directory")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise HFModelError(f"{directory} has no {CONFIG_FILE}; pass a directory written by save_pretrained or "
                           "`paratrain export`")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise HFModelError(f"{path}: expected a JSON object")
    return doc


def load_hf_config(directory: str | Path):
    """transformers' config of the directory, refused in one line when it needs remote code or names no causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory = Path(directory)
    doc = _config_doc(directory)
    where = directory / CONFIG_FILE
    if "auto_map" in doc:
        raise HFModelError(f"{where} asks for remote code (auto_map); paratrain runs no code from a model directory: "
                           "use a model_type transformers implements")
    kind = doc.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise HFModelError(f"{where}: model_type {kind!r} is not one transformers {_version()} implements; upgrade "
                           "transformers or convert the model")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFModelError(f"{where}: model_type {kind!r} has no causal language model in transformers {_version()}; "
                           "only AutoModelForCausalLM families train")
    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise HFModelError(f"{where}: transformers cannot read it ({str(exc).splitlines()[0]})") from None
    config.use_cache = False  # training: no key/value cache
    return config


def _version() -> str:
    import transformers

    return transformers.__version__


@dataclass(frozen=True)
class HFModelConfig(ExpertShape):
    """What the trainer and the planner read of a transformers model: its shapes and exact parameter counts.

    Fields (the reference `ModelConfig`'s names where they mean the same): directory, model_type,
    vocab_size, dim (hidden_size), n_layers, n_heads, n_kv_heads, head_dim, ffn_dim (intermediate_size;
    one expert's for a mixture of experts), max_seq_len, tie_embeddings, n_experts, top_k, sliding_window
    (None: full attention), params and active_params (counted on the meta-built model), tp_plan (whether
    the config declares `base_model_tp_plan`), document_eos (--document-mask).
    """

    directory: str
    model_type: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool
    params: int
    active_params: int
    n_experts: int = 0
    top_k: int = 1
    sliding_window: int | None = None
    tp_plan: bool = False
    document_eos: int | None = None
    shared_expert: bool = False  # the reference config's field, read by the planner
    expert_ffn_dim: int = 0
    # transformers' config as a dict (`PretrainedConfig.to_dict`): a checkpoint's or final/'s model_config then
    # rebuilds the model, and `export` writes its config.json, without the directory it came from.
    hf_config: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    attention: str = "sdpa"  # transformers' attention implementation the model runs ("eager" where it has no SDPA)
    # Why pipeline stages cannot lay the model out (`check_layable`), None when they can:
    # the one rule the trainer and the planner read (`paratrain.parallel.rules.pipeline_model_violations`).
    pipeline_refusal: str | None = None

    def num_params(self) -> int:
        """Exact parameter count of the model (a tied table once)."""
        return self.params

    def num_active_params(self) -> int:
        """Parameters one token uses (all but the routed experts it is not sent to)."""
        return self.active_params

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, as `ModelConfig.flops_per_token` counts them (PaLM's 6·N + 12·L·H·Q·T), with
        H·Q the attention width n_heads·head_dim."""
        matmul = self.active_params - self.vocab_size * self.dim * (not self.tie_embeddings)
        return 6 * matmul + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def read_model_dir(directory: str | Path) -> HFModelConfig:
    """The `HFModelConfig` of a model directory, its parameters counted on the meta-built model."""
    config = load_hf_config(directory)
    model = build_meta(config)
    return summarize(config, model, str(directory))


def is_hf_model_config(doc) -> bool:
    """Whether a stored model config (a dict) is an `HFModelConfig`'s rather than a reference `ModelConfig`'s."""
    return isinstance(doc, dict) and "hf_config" in doc and "model_type" in doc


def model_config_from_dict(doc: dict) -> HFModelConfig:
    """The `HFModelConfig` stored as `doc` (dataclasses.asdict of one)."""
    names = {f.name for f in dataclasses.fields(HFModelConfig)}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise HFModelError(f"the stored model config has no field {unknown[0]!r}")
    return HFModelConfig(**doc)


def transformers_config(model_cfg: HFModelConfig):
    """transformers' config of `model_cfg`, from the dict it carries (no file read, no remote code)."""
    from transformers import AutoConfig

    doc = dict(model_cfg.hf_config)
    kind = doc.pop("model_type", model_cfg.model_type)
    if "auto_map" in doc:
        raise HFModelError("the stored config asks for remote code (auto_map); paratrain runs none")
    config = AutoConfig.for_model(kind, **doc)
    config.use_cache = False
    return config


def summarize(config, model: nn.Module, directory: str) -> HFModelConfig:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def get(*keys, default=None):
        return next((getattr(text, k) for k in keys if getattr(text, k, None) is not None), default)

    dim, heads = get("hidden_size"), get("num_attention_heads")
    params = sum(p.numel() for p in model.parameters())
    n_experts = int(get("num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    top_k = int(get("num_experts_per_tok", "moe_topk", default=1) or 1)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = params - (expert_params * (n_experts - top_k) // n_experts if n_experts else 0)
    window = get("sliding_window")
    try:
        check_layable(model.config)  # as built: its attention implementation set
        refusal = None
    except SequentialError as e:
        refusal = str(e)
    return HFModelConfig(
        directory=directory, model_type=config.model_type, vocab_size=get("vocab_size"), dim=dim,
        n_layers=get("num_hidden_layers"), n_heads=heads, n_kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=dim // heads),
        ffn_dim=get("moe_intermediate_size", "intermediate_size") if n_experts else get("intermediate_size"),
        max_seq_len=get("max_position_embeddings", default=2048),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)), params=params, active_params=active,
        n_experts=n_experts, top_k=top_k, sliding_window=window if window and _uses_window(text) else None,
        tp_plan=bool(getattr(text, "base_model_tp_plan", None)), hf_config=json.loads(config.to_json_string()),
        attention=model.config._attn_implementation, pipeline_refusal=refusal)


# The families pipeline stages lay out (`paratrain.interop.hf_stages.LayeredCausalLM`), read from transformers' config
# alone, so that the config the trainer and the planner read says it (`HFModelConfig.pipeline_refusal`):
# model_type values whose forward is embed → layers(positions, mask) → norm → lm_head (→ soft-cap), each checked
# against transformers' logits (tests/parallel/test_hf_layouts.py)
PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "phi3")
_MASKS = ("full_attention", "sliding_attention")  # the layer kinds transformers makes a mask for here


class SequentialError(ParatrainError, ValueError):
    """A model that cannot be laid out for pipeline stages; the message names why."""


def check_layable(config) -> tuple[str, str, str]:
    """(embedding, layers, final norm): the inner model's module names from transformers' `config`'s
    `base_model_pp_plan`, or one line saying why the family cannot be laid out for pipeline stages."""
    kind = config.model_type
    if kind not in PIPELINE_FAMILIES:
        raise SequentialError(f"pipeline stages lay out transformers' {', '.join(PIPELINE_FAMILIES)} models, whose "
                              f"forward is embed → decoder layers → norm → head; {kind}'s is not known to be")
    plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    embed = next((name for name, (inputs, _) in plan.items() if list(inputs) == ["input_ids"]), None)
    rest = [name for name in plan if name != embed]
    if embed is None or len(rest) != 2:
        raise SequentialError(f"{kind} declares no base_model_pp_plan of an embedding, the decoder layers and a "
                              f"norm (it has {sorted(plan) or 'none'})")
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ("sdpa", "eager"):
        raise SequentialError(f"pipeline stages need attn_implementation 'sdpa' or 'eager', not {attention!r}")
    kinds = set(layer_kinds(config))
    if not kinds <= set(_MASKS):
        raise SequentialError(f"{kind} has layers of kind {sorted(kinds - set(_MASKS))[0]!r}, which pipeline stages "
                              "make no mask for")
    return embed, rest[0], rest[1]


def layer_kinds(config) -> list[str]:
    """Each decoder layer's attention kind, as the family's forward picks its mask: `layer_types`, else the sliding
    window for every layer when the config sets one."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types[:config.num_hidden_layers])
    window = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers


def _uses_window(text) -> bool:
    """Whether any layer attends over a sliding window (Qwen2's use_sliding_window false turns it off)."""
    if getattr(text, "use_sliding_window", True) is False:
        return False
    types = getattr(text, "layer_types", None)
    return types is None or any("sliding" in t for t in types)


def build_meta(config) -> nn.Module:
    """transformers' causal LM of `config` on the meta device (fp32, SDPA attention where the family has it, else
    eager), its buffers computed on the CPU."""
    from transformers import AutoModelForCausalLM

    error = None
    for attention in ("sdpa", "eager"):
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
            break
        except ValueError as exc:  # the family has no SDPA attention (Gemma 2's soft-capped scores)
            error = exc
    else:
        raise HFModelError(f"transformers cannot build {config.model_type}: {str(error).splitlines()[0]}")
    _materialize_buffers(model)
    return model


@torch.no_grad()
def _materialize_buffers(model: nn.Module) -> None:
    """Buffers (rotary frequencies, Gemma's embedding scale) on the CPU, as transformers' `_init_weights` computes
    them; the parameters stay on the meta device (initializing one there does nothing)."""
    for module in model.modules():
        meta = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
        if meta:
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            model._init_weights(module)


class HFCausalLM(nn.Module):
    """A transformers causal LM under its own parameter names: token ids (and position_ids) in, logits out.

    `hf` is the transformers model; its top-level modules (``model``, ``lm_head``) are this module's,
    shared: a strategy that replaces one here (tensor parallelism's head) replaces it there too.
    `config` is the `HFModelConfig`.
    """

    def __init__(self, hf: nn.Module, config: HFModelConfig):
        super().__init__()
        object.__setattr__(self, "hf", hf)  # not a child: its modules are registered below, under its names
        self.config = config
        for name, child in hf.named_children():
            setattr(self, name, child)

    @classmethod
    def build(cls, config: HFModelConfig, hf_config=None) -> HFCausalLM:
        """The model of `config`'s directory on the meta device (buffers materialized)."""
        hf_config = hf_config or transformers_config(config)
        return cls(build_meta(hf_config), config)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        hf = self.__dict__.get("hf")
        if hf is not None and isinstance(value, nn.Module) and name in hf._modules:
            hf._modules[name] = value

    def get_output_embeddings(self) -> nn.Module | None:
        """The output head (transformers' own answer): the module the fused loss folds the cross-entropy into."""
        return self.hf.get_output_embeddings()

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `tokens` [B, S]. With `config.document_eos` (--document-mask) the documents packed in each
        sequence are kept apart: positions restart after each end-of-text token and a 4-D mask keeps each query
        within its document (`paratrain.models.llama.document_layout`), as running each document alone.
        `attention_mask` ([B, S], 1 = a token to attend to) is transformers' own: context parallelism passes one of
        all ones with each rank's chunk positions, so that transformers reads the jump between the two chunks'
        positions as one sequence (not two packed ones, which it would mask apart) and calls causal SDPA."""
        mask = attention_mask
        if self.config.document_eos is not None:
            positions, mask = self.document_layout(tokens)
            position_ids = positions if position_ids is None else position_ids
        return self.hf(input_ids=tokens, position_ids=position_ids, attention_mask=mask, use_cache=False,
                       return_dict=True).logits

    def document_layout(self, ids: torch.Tensor, rows: torch.Tensor | None = None):
        """(position_ids, attention mask) of the documents packed in `ids` [B, S], ended by `config.document_eos`,
        for the queries at `rows` (None: every token; `paratrain.models.llama.document_layout`): the mask as
        transformers' attention takes it, boolean for SDPA, added to the scores for eager attention."""
        from paratrain.models.llama import document_layout

        positions, keep = document_layout(ids, self.config.document_eos, rows)
        if self.config.attention == "sdpa":
            return positions, keep
        return positions, torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))

    @property
    def hf_config(self):
        return self.hf.config

    def tensor_parallel_plan(self, sequence_parallel: bool = False):
        """Tensor (and sequence) parallelism from the config's `base_model_tp_plan` (`tp_plans.hf_plan`)."""
        from paratrain.models.tp_plans import hf_plan

        return hf_plan(self, sequence_parallel)



@torch.no_grad()
def seeded_init(hf: nn.Module, name: str, shape, seed: int) -> torch.Tensor:
    """Parameter `name` of the (meta, untouched by any strategy) transformers model `hf`, initialized by transformers'
    `_init_weights` on a CPU copy of the module that holds it, under a generator seeded by (seed, name): every rank
    and every layout gets the same value, one module at a time."""
    owner_name, _, attr = name.rpartition(".")
    owner = hf.get_submodule(owner_name) if owner_name else hf
    clone = copy.deepcopy(owner)
    for child in list(clone.children()):  # `_init_weights` initializes the module's own parameters only
        child.to("meta")
    clone.to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
        hf._init_weights(clone)
    value = getattr(clone, attr).float()
    assert tuple(value.shape) == tuple(shape), (name, value.shape, shape)
    return value


def seeded_initializer(model: HFCausalLM, seed: int):
    """init(name, full_shape) -> fp32 value: transformers' own initialization of each parameter (`seeded_init`), on
    a pristine meta copy (the strategies replace the model's own modules as they apply)."""
    pristine = build_meta(model.hf.config)
    return lambda name, shape: seeded_init(pristine, name, shape, seed)
