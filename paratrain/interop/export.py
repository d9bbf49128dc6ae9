"""Hugging Face Llama (or Mixtral) directories: written from a model's weights, and read back.

    files, tokenizer_file = write_hf_directory(out, model_cfg, shapes, read, dtype=torch.bfloat16)
    config, state = import_hf("hf/tiny")           # ModelConfig + state dict under our parameter names

The directory is one that `LlamaForCausalLM.from_pretrained` loads (`MixtralForCausalLM` for a
mixture of experts, each stacked expert tensor written as its E per-expert tensors, `paratrain.interop.hf`):
``config.json``, the weights under Hugging Face names in ``model.safetensors``
(or, with `max_shard_bytes`, in ``model-0000i-of-0000n.safetensors`` files
listed by ``model.safetensors.index.json``), and a tokenizer when one is given
(``tokenizer.json`` + ``tokenizer_config.json`` for BPE; our
``byte_tokenizer.json`` for the byte tokenizer, which Hugging Face cannot
load). A tied embedding is written once, as ``model.embed_tokens.weight``.
It is written under a temporary name and renamed into place.

Where the weights come from (a run, one of its checkpoints, its final/ directory) is the run's
side: `paratrain.run.export.export_hf`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

import torch

from paratrain.checkpoint.files import write_safetensors
from paratrain.interop.hf import (
    CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, HFError, HFWeights, hf_config, hf_name, hf_names, is_stacked_experts,
)
from paratrain.models import ModelConfig

TOKENIZER_CONFIG = "tokenizer_config.json"
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_hf(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and the weights (our names, stored dtype, CPU) of a Hugging Face Llama directory.

    Reads ``config.json`` and one or more safetensors files (the sharded
    layout through ``model.safetensors.index.json``). Raises HFError naming
    the tensor and both shapes when a shape disagrees with the config, and
    naming the field for configs `Transformer` cannot compute (rope_scaling,
    biases, an activation other than silu). A tied model's state dict holds
    ``output.weight`` as the same tensor as ``tok_embeddings.weight``.
    """
    weights = HFWeights(directory)
    try:
        return weights.config, weights.state_dict()
    finally:
        weights.close()


def check_export_options(out: Path, overwrite: bool, dtype: torch.dtype, max_shard_bytes: int | None) -> Path:
    """`out` if a directory can be written there with these options; else HFError naming the option."""
    if dtype not in EXPORT_DTYPES.values():
        raise HFError(f"dtype {dtype} is not supported; use one of {', '.join(EXPORT_DTYPES)}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise HFError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if out.exists() and not out.is_dir():
        raise HFError(f"{out} is a file; pass a directory to export into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise HFError(f"{out} already exists and is not empty; choose a new directory or pass --overwrite")
    return out


def write_hf_directory(out: Path, model_cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                       read: Callable[[str], torch.Tensor], *, dtype: torch.dtype = torch.float32,
                       max_shard_bytes: int | None = None, tokenizer=None) -> tuple[list[str], str | None]:
    """Write the parameters `shapes` names (each read by `read(name)`, one at a time) as the Hugging Face
    directory `out` (replacing what is there), with config.json and the tokenizer if one is given;
    return (the weight files, the tokenizer's file or None).

    `dtype` is the stored dtype; `max_shard_bytes` splits the weights into files of at most that size
    (a larger tensor gets a file of its own; None: one file).
    """
    from paratrain.models.hf import HFModelConfig

    if isinstance(model_cfg, HFModelConfig):  # transformers' own model: its names, its config
        entries, tensors = _own_entries, _own_tensors
        configs = _transformers_configs(model_cfg, dtype, _token_ids(tokenizer))
    else:
        entries, tensors = _hf_entries, _hf_tensors
        configs = {CONFIG_FILE: hf_config(model_cfg, dtype, _token_ids(tokenizer))}
    with _replacing(out) as tmp:
        files = _write_weights(tmp, shapes, read, dtype, max_shard_bytes, entries, tensors)
        tokenizer_file = _write_tokenizer(tmp, tokenizer, model_cfg) if tokenizer is not None else None
        for name, doc in configs.items():  # after the tokenizer: the model's configs replace what it states beside it
            (tmp / name).write_text(json.dumps(doc, indent=2) + "\n")
    return files, tokenizer_file


@contextlib.contextmanager
def _replacing(out: Path):
    """A fresh directory beside `out` to write into; once the body is done it replaces `out` whole (a failed write
    leaves `out` as it was and no partial directory behind; an OSError becomes one line naming `out`)."""
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError as exc:
        raise HFError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _transformers_configs(model_cfg, dtype: torch.dtype, token_ids: dict) -> dict[str, dict]:
    """config.json and generation_config.json of a transformers model (`paratrain.models.hf.HFModelConfig`)."""
    from transformers import GenerationConfig

    from paratrain.models.hf import transformers_config

    config = transformers_config(model_cfg)
    for key, value in token_ids.items():
        if value is not None:
            setattr(config, key, value)
    config.dtype = dtype
    config.use_cache = True  # the exported model generates: its cache back on
    config.architectures = [config.architectures[0]] if config.architectures else None
    generation = GenerationConfig.from_model_config(config)
    return {CONFIG_FILE: json.loads(config.to_json_string()),
            "generation_config.json": json.loads(generation.to_json_string())}


# ---- the tokenizer ----


def _token_ids(tokenizer) -> dict:
    if tokenizer is None:
        return {}
    return {f"{kind}_token_id": getattr(tokenizer, f"{kind}_id", None) for kind in ("bos", "eos", "pad")}


def _write_tokenizer(directory: Path, tokenizer, model_cfg: ModelConfig) -> str:
    """Save the tokenizer; a BPE one also gets the tokenizer_config.json that lets AutoTokenizer load it (with the
    chat template the tokenizer carries, if any)."""
    path = tokenizer.save(directory)
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        doc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_cfg.max_seq_len}
        for kind in ("bos", "eos", "pad"):
            token_id = getattr(tokenizer, f"{kind}_id", None)
            if token_id is not None:
                doc[f"{kind}_token"] = backend.id_to_token(token_id)
        # the chat template the data was rendered with, and the special tokens it was rendered with, so that
        # transformers renders a chat as the training data was rendered
        doc.update(tokenizer.chat_config() if hasattr(tokenizer, "chat_config") else {})
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    return path.name


# ---- the weights ----


def _write_weights(directory: Path, shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor],
                   dtype: torch.dtype, max_shard_bytes: int | None, entries_of=None, tensors_of=None) -> list[str]:
    """Write the parameters under HF names (`entries_of`/`tensors_of`: the reference model's, by default), in model
    order, in one file or in shards of bounded size.

    Tensor by tensor: each is read, cast, written and dropped, so memory holds one tensor, not a shard.
    """
    entries_of, tensors_of = entries_of or _hf_entries, tensors_of or _hf_tensors
    groups = _shard_groups(shapes, torch.empty((), dtype=dtype).element_size(), max_shard_bytes)
    if len(groups) == 1:
        files = [WEIGHTS_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for file, group in zip(files, groups):
        entries = [entry for name in group for entry in entries_of(name, shapes[name], dtype)]
        write_safetensors(directory / file, entries, (item for name in group for item in tensors_of(name, read)))
        weight_map.update({key: file for key, _, _ in entries})
        total += sum(math.prod(shape) * dtype.itemsize for _, _, shape in entries)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def _hf_entries(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
    """(HF key, dtype, shape) of each tensor our parameter `name` is written as: one, or a stacked expert
    tensor's E rows (Mixtral's experts.{j}.w1.weight, ...)."""
    if is_stacked_experts(name):
        return [(key, dtype, tuple(shape[1:])) for key in hf_names(name, shape[0])]
    return [(hf_name(name), dtype, tuple(shape))]


def _hf_tensors(name: str, read: Callable[[str], torch.Tensor]):
    """(HF key, tensor) of each tensor our parameter `name` is written as, read once."""
    tensor = read(name)
    if is_stacked_experts(name):
        yield from zip(hf_names(name, tensor.shape[0]), tensor.unbind(0))
    else:
        yield hf_name(name), tensor


def _own_entries(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
    """A transformers model's parameter is written under its own name, as it is (fused experts stay fused: the
    layout transformers holds them in)."""
    return [(name, dtype, tuple(shape))]


def _own_tensors(name: str, read: Callable[[str], torch.Tensor]):
    yield name, read(name)


def _shard_groups(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int | None) -> list[list[str]]:
    """Consecutive parameters packed into groups of at most `max_bytes` (a larger tensor alone); one group if None."""
    if max_bytes is None:
        return [list(shapes)]
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


# ---- LoRA adapters in PEFT's format ----

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's LoraModel wraps the base model: its keys start here


def peft_module_name(module: str, transformers_model: bool) -> str:
    """PEFT's name of an adapted linear: a transformers model's own module name; the reference model's Hugging Face
    Llama name (layers.0.attention.wq → model.layers.0.self_attn.q_proj)."""
    return module if transformers_model else hf_name(module + ".weight").removesuffix(".weight")


def write_peft_adapter(out: Path, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], *, alpha: float,
                       dropout: float, base: str | None, dtype: torch.dtype = torch.float32) -> list[str]:
    """Write LoRA adapters as the directory `peft.PeftModel.from_pretrained(base_model, out)` loads (replacing what
    is there): `adapters` maps PEFT's module name to its (A [r, in], B [out, r]); one rank for all. adapter_config.json
    names each adapted module in full in `target_modules` (PEFT matches a full name exactly), and
    adapter_model.safetensors holds `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`. The files written."""
    ranks = {a.shape[0] for a, _ in adapters.values()}
    if len(ranks) != 1:
        raise HFError(f"the adapters have ranks {sorted(ranks)}; one adapter directory holds one rank")
    rank = ranks.pop()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
              "target_modules": sorted(adapters), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
              "base_model_name_or_path": base, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    keys = [(f"{PEFT_PREFIX}{module}.lora_{which}.weight", tensor) for module, pair in adapters.items()
            for which, tensor in zip("AB", pair)]
    with _replacing(out) as tmp:
        write_safetensors(tmp / ADAPTER_WEIGHTS, [(k, dtype, tuple(t.shape)) for k, t in keys], keys)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
