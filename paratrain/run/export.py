"""A run's weights as a Hugging Face Llama (or Mixtral) directory: which weights, which model, which tokenizer.

    result = export_hf("runs/tiny-1", "hf/tiny")   # newest committed checkpoint of the run, else its final/

Where the weights come from (`resolve_source`):

* a committed checkpoint ``step-XXXXXXXX/``: the fp32 master weights, stored
  as ``model/<parameter name>``; the model config is the shared state's
  ``model_config`` (the fields of `ModelConfig`), else its ``config`` (the
  run's resolved configuration, which `paratrain train` stores), else the
  run's ``final/model_config.json``, else the run's ``config.json``;
* a ``final/`` directory: ``model.safetensors`` and ``model_config.json``;
* a run directory: its newest committed checkpoint under ``checkpoints/``
  that verifies, else its ``final/``.

The tokenizer is the run's: the checkpoint's own copy (``assets/``, `paratrain.run.carried`), else final/'s
file, else what the run's config names. Writing the
directory is the format's business: `paratrain.interop.export.write_hf_directory`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from paratrain.checkpoint.format import ASSETS_DIR, MANIFEST_FILE, parse_step_dirname
from paratrain.checkpoint.reader import CheckpointReader
from paratrain.checkpoint.store import find_latest, list_checkpoints
from paratrain.interop.export import check_export_options, peft_module_name, write_hf_directory, write_peft_adapter
from paratrain.interop.hf import HFError, expected_shapes
from paratrain.models import ModelConfig, ModelConfigError
from paratrain.models.hf import HFModelError, is_hf_model_config
from paratrain.parallel.lora import is_adapter
from paratrain.run.carried import MODEL_CONFIG_KEY, TOKENIZER_FILES, stored_model_config

MODEL_PREFIX = "model/"
FINAL_WEIGHTS = "model.safetensors"
FINAL_CONFIG = "model_config.json"


class SourceKind(enum.Enum):
    CHECKPOINT = "checkpoint"
    FINAL = "final"


@dataclass(frozen=True)
class ExportSource:
    """Where exported weights come from; `run_dir` is the run holding it, if any; `verified`: checksums checked."""

    kind: SourceKind
    path: Path
    run_dir: Path | None
    verified: bool = False


@dataclass(frozen=True)
class ExportResult:
    """What `export_hf` wrote: the directory, its source, the model, the weight files and the tokenizer file."""

    out_dir: Path
    source: ExportSource
    model_config: ModelConfig
    step: int | None
    weight_files: tuple[str, ...]
    tokenizer_file: str | None


def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int | None = None, overwrite: bool = False, merge: bool = False) -> ExportResult:
    """Write the weights of `source` (a run, a checkpoint or a final/ directory) as a Hugging Face directory.

    `merge`: the source holds LoRA adapters (a `--lora` run): write the whole model, each adapted weight its base
    as the run stored it (in the compute dtype, bf16 or NF4, rebuilt from the run's seed or --init-from) plus
    alpha / rank · B · A, as PEFT's `merge_and_unload` computes it (`merged_weights`).

    `dtype` is the stored dtype (float32, bfloat16 or float16); `max_shard_bytes`
    splits the weights into files of at most that size (a larger tensor gets a
    file of its own; None: one file). `out_dir` must not exist or be empty,
    unless `overwrite`. Raises HFError (or CheckpointError for a damaged
    checkpoint) with one line naming the problem.
    """
    out = check_export_options(Path(out_dir), overwrite, dtype, max_shard_bytes)
    src = resolve_source(source)
    if out.exists() and (out.resolve() == src.path.resolve() or out.resolve() in src.path.resolve().parents):
        raise HFError(f"{out} holds the source {src.path}; export into another directory")
    model_cfg, step, shapes, read = _open_weights(src, merge)
    files, tokenizer_file = write_hf_directory(out, model_cfg, shapes, read, dtype=dtype,
                                               max_shard_bytes=max_shard_bytes, tokenizer=find_tokenizer(src))
    return ExportResult(out, src, model_cfg, step, tuple(files), tokenizer_file)


def resolve_source(source: str | os.PathLike) -> ExportSource:
    """The checkpoint or final/ directory `source` names (see the module docstring for the order)."""
    path = Path(source)
    if not path.is_dir():
        raise HFError(f"{path} is not a directory; pass a run directory, a checkpoint (step-*) or a final/ directory")
    if (path / MANIFEST_FILE).is_file() or parse_step_dirname(path.name) is not None:
        run = path.parent.parent if path.parent.name == "checkpoints" else None
        return ExportSource(SourceKind.CHECKPOINT, path, run)
    if _is_final(path):
        return ExportSource(SourceKind.FINAL, path, path.parent if path.name == "final" else None)
    for root, run in ((path / "checkpoints", path), (path, path.parent if path.name == "checkpoints" else None)):
        if list_checkpoints(root):
            latest = find_latest(root)
            if latest is not None:
                return ExportSource(SourceKind.CHECKPOINT, latest, run, verified=True)
            if not _is_final(path / "final"):
                raise HFError(f"no checkpoint under {root} verifies, and {path} has no final/ directory")
    if _is_final(path / "final"):
        return ExportSource(SourceKind.FINAL, path / "final", path)
    raise HFError(f"{path} is neither a run directory (with checkpoints/ or final/), a checkpoint (step-*) "
                  f"nor a final/ directory")


def _is_final(path: Path) -> bool:
    return (path / FINAL_WEIGHTS).is_file() and (path / FINAL_CONFIG).is_file()


# ---- reading the source ----


def _open_weights(src: ExportSource, merge: bool = False) -> tuple[ModelConfig, int | None, dict, Callable]:
    """(model config, step, parameter name → shape, read(name)) of a source, tensors checked against the config;
    `merge`: a LoRA source's adapters merged into its base."""
    model_cfg, step, stored, read = _open_stored(src)
    if any(is_adapter(name) for name in stored):
        if not merge:
            raise HFError(f"{src.path} holds LoRA adapters over a frozen base (a --lora run): export them with "
                          f"--adapter (PEFT's format) or the merged model with --merge")
        return model_cfg, step, *merged_weights(src, model_cfg, stored, read)
    if merge:
        raise HFError(f"{src.path} holds no LoRA adapters (it was not trained with --lora); export it without --merge")
    return model_cfg, step, _check_stored(src, model_cfg, stored), read


def _open_stored(src: ExportSource) -> tuple[ModelConfig, int | None, dict[str, tuple[int, ...]], Callable]:
    """(model config, step, stored name → shape, read(name)) of a source, as stored."""
    if src.kind is SourceKind.FINAL:
        model_cfg = _config_from_json(src.path / FINAL_CONFIG)
        handle = safe_open(str(src.path / FINAL_WEIGHTS), framework="pt", device="cpu")
        stored = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        step, read = None, handle.get_tensor
    else:
        reader = CheckpointReader(src.path, checksums=not src.verified)
        model_cfg = _checkpoint_model_config(reader, src)
        stored = {n.removeprefix(MODEL_PREFIX): reader.global_shape(n) for n in reader.names()
                  if n.startswith(MODEL_PREFIX)}
        if not stored:
            raise HFError(f"{src.path} holds no {MODEL_PREFIX}* tensors (model weights); it cannot be exported")
        step = reader.step
        read = lambda name: reader.read(MODEL_PREFIX + name)  # noqa: E731
    return model_cfg, step, stored, read


def _expected(model_cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(the parameters an export writes, name → shape; the names a source may store) of the model `model_cfg`."""
    if is_hf_model_config(dataclasses.asdict(model_cfg)):  # transformers' model: its own names
        from paratrain.models.hf import HFCausalLM

        expected = {n: tuple(p.shape) for n, p in HFCausalLM.build(model_cfg).named_parameters()}
        return expected, set(expected)
    expected = expected_shapes(model_cfg)
    return expected, set(expected) | ({"output.weight"} if model_cfg.tie_embeddings else set())


def _check_stored(src: ExportSource, model_cfg: ModelConfig, stored: dict[str, tuple[int, ...]]) -> dict:
    """The parameters to export (name → shape), after checking names and shapes against `Transformer(model_cfg)`."""
    prefix = MODEL_PREFIX if src.kind is SourceKind.CHECKPOINT else ""
    expected, allowed = _expected(model_cfg)
    for name, shape in stored.items():
        if name not in allowed:
            raise HFError(f"{src.path}: tensor {prefix + name!r} is not a parameter of the model its config describes")
        want = expected[name] if name in expected else expected["tok_embeddings.weight"]
        if tuple(shape) != want:
            raise HFError(f"{src.path}: tensor {prefix + name!r} has shape {list(shape)} but the model config "
                          f"implies {list(want)}")
    missing = [name for name in expected if name not in stored]
    if missing:
        raise HFError(f"{src.path}: tensor {prefix + missing[0]!r} is missing"
                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return expected


def _checkpoint_model_config(reader: CheckpointReader, src: ExportSource) -> ModelConfig:
    """The model config of a checkpoint, from the first of these that exists.

    The shared state's ``model_config`` (the fields of `ModelConfig`); its ``config`` (the run's
    resolved `Config`, as `paratrain train` saves it); the run's final/model_config.json; the run's
    config.json. The two `Config` forms are resolved as the trainer resolves them.
    """
    shared = reader.shared_state()
    stored = shared.get(MODEL_CONFIG_KEY)
    if isinstance(stored, dict):
        try:
            return stored_model_config(stored)
        except (TypeError, ModelConfigError, HFModelError) as exc:
            raise HFError(f"{src.path}: the stored {MODEL_CONFIG_KEY} is invalid ({exc})") from None
    if isinstance(shared.get("config"), dict):
        return _resolve(shared["config"], f"{src.path}: the stored config")
    run = src.run_dir
    if run is not None and (run / "final" / FINAL_CONFIG).is_file():
        return _config_from_json(run / "final" / FINAL_CONFIG)
    if run is not None and (run / "config.json").is_file():
        return _resolve(_run_config_doc(run), str(run / "config.json"))
    raise HFError(f"{src.path} stores no {MODEL_CONFIG_KEY} or config in its shared state and is not inside a run "
                  f"directory (<run>/checkpoints/step-*) with final/{FINAL_CONFIG} or config.json")


def _resolve(doc: dict, where: str) -> ModelConfig:
    """The model config a run's resolved `Config` (as a dict) trained."""
    from paratrain.config import Config, ConfigError
    from paratrain.run.build import resolve_model_config

    try:
        return resolve_model_config(Config.from_dict(doc), tokenizer_vocab=0)
    except (ConfigError, ModelConfigError, TypeError) as exc:
        raise HFError(f"{where} does not give the model ({exc})") from None


def _config_from_json(path: Path) -> ModelConfig:
    try:
        return stored_model_config(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, TypeError, ModelConfigError, HFModelError) as exc:
        raise HFError(f"{path}: not a valid model config ({exc})") from None


def _run_config_doc(run: Path) -> dict:
    try:
        doc = json.loads((run / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HFError(f"{run / 'config.json'}: not a valid run config ({exc})") from None
    if not isinstance(doc, dict):
        raise HFError(f"{run / 'config.json'}: not a valid run config (expected a JSON object)")
    return doc


def _run_config(run: Path):
    from paratrain.config import Config, ConfigError

    try:
        return Config.from_dict(_run_config_doc(run))
    except (ConfigError, TypeError) as exc:
        raise HFError(f"{run / 'config.json'}: not a valid run config ({exc})") from None


# ---- LoRA adapters ----


def _adapter_pairs(src: ExportSource, model_cfg, stored: dict, read: Callable) -> dict[str, tuple]:
    """{adapted module (ours): (A, B)} of a LoRA source, each checked against the module's base shape."""
    expected, _ = _expected(model_cfg)
    pairs = {}
    for name in stored:
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            a, b = read(name), read(f"{module}.lora_B.weight")
            base = expected.get(f"{module}.weight")
            if base is None or (b.shape[0], a.shape[1]) != tuple(base) or a.shape[0] != b.shape[1]:
                raise HFError(f"{src.path}: the adapters of {module} ({list(a.shape)}, {list(b.shape)}) do not fit "
                              f"the model's {f'weight {list(base)}' if base else 'modules (no such linear)'}")
            pairs[module] = (a, b)
    return pairs


def _lora_options(src: ExportSource):
    """The run's config and its `LoRA` (alpha, dropout, base dtype) from the checkpoint's stored config or the
    run's config.json."""
    from paratrain.config import Config, ConfigError, lora_options

    doc = None
    if src.kind is SourceKind.CHECKPOINT:
        doc = CheckpointReader(src.path, checksums=False).shared_state().get("config")
    if not isinstance(doc, dict) and src.run_dir is not None and (src.run_dir / "config.json").is_file():
        doc = _run_config_doc(src.run_dir)
    if not isinstance(doc, dict):
        raise HFError(f"{src.path} holds LoRA adapters but no run config says their alpha and base (export a run "
                      f"directory or one of its checkpoints)")
    try:
        cfg = Config.from_dict(doc)
        return cfg, lora_options(cfg)
    except (ConfigError, ValueError) as exc:
        raise HFError(f"{src.path}: the run's config does not give its LoRA options ({exc})") from None


def export_adapter(source: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                   overwrite: bool = False) -> ExportResult:
    """Write the LoRA adapters of `source` (a `--lora` run, one of its checkpoints or its final/) in PEFT's format
    (`paratrain.interop.export.write_peft_adapter`), under the names PEFT gives the modules of transformers' model
    of the same architecture (the reference model's: its Hugging Face Llama names)."""
    out = check_export_options(Path(out_dir), overwrite, dtype, None)
    src = resolve_source(source)
    model_cfg, step, stored, read = _open_stored(src)
    if not any(is_adapter(name) for name in stored):
        raise HFError(f"{src.path} holds no LoRA adapters (it was not trained with --lora); export it without "
                      f"--adapter")
    cfg, lora = _lora_options(src)
    transformers_model = is_hf_model_config(dataclasses.asdict(model_cfg))
    pairs = {peft_module_name(module, transformers_model): pair
             for module, pair in _adapter_pairs(src, model_cfg, stored, read).items()}
    files = write_peft_adapter(out, pairs, alpha=lora.alpha, dropout=lora.dropout, base=cfg.model.init_from,
                               dtype=dtype)
    return ExportResult(out, src, model_cfg, step, tuple(files), None)


def merged_weights(src: ExportSource, model_cfg, stored: dict, read: Callable) -> tuple[dict, Callable]:
    """(name → shape, read(name)) of a LoRA source's whole model merged: each parameter its base value as the run
    held it (the run's initializer: its seed or --init-from; cast to the compute dtype, a target's to its base
    dtype, NF4 or FP8 decoded) in fp32, an adapted weight plus (B · A) · alpha / rank."""
    from paratrain.parallel.lora import decode_fp8, encode_fp8
    from paratrain.parallel.nf4 import NF4
    from paratrain.precision import precision_policy
    from paratrain.run.build import meta_model, weight_initializer

    cfg, lora = _lora_options(src)
    pairs = _adapter_pairs(src, model_cfg, stored, read)
    init = weight_initializer(meta_model(model_cfg), cfg)
    compute = precision_policy(cfg.parallel.precision, None).param_dtype
    expected, _ = _expected(model_cfg)

    def value(name: str) -> torch.Tensor:
        base = init(name, expected[name]).to(compute)
        module = name.removesuffix(".weight")
        if module not in pairs:
            return base.float()
        if lora.base_dtype == "nf4":
            base = NF4.encode(base).decode()
        elif lora.base_dtype == "fp8":
            base = decode_fp8(*encode_fp8(base, compute), compute)
        elif lora.base_dtype == "bf16":
            base = base.to(torch.bfloat16)
        a, b = pairs[module]
        return base.float() + (b.float() @ a.float()) * lora.scaling

    return expected, value


# ---- the tokenizer ----


def find_tokenizer(src: ExportSource):
    """The tokenizer of the run `src` belongs to, or None: a checkpoint's own copy, else final/'s file, else what the
    run's config names."""
    from paratrain.data import DataError
    from paratrain.data.tokenizer import ByteTokenizer, tokenizer_from_file

    copies = [src.path / ASSETS_DIR] if src.kind is SourceKind.CHECKPOINT else [src.path]
    copies += [src.run_dir / "final"] if src.run_dir is not None else []
    for directory in copies:
        if any((directory / name).is_file() for name in TOKENIZER_FILES):
            return tokenizer_from_file(directory)
    if src.run_dir is None or not (src.run_dir / "config.json").is_file():
        return None
    from paratrain.run.build import tokenizer_spec

    cfg = _run_config(src.run_dir)
    spec = tokenizer_spec(cfg)
    try:
        if spec == "byte":
            return ByteTokenizer()
        if spec == "auto":  # a prepared corpus, which stores its tokenizer
            return tokenizer_from_file(cfg.data.path)
        if spec.startswith("bpe:"):  # trained by the run into its data cache
            cached = sorted((src.run_dir / "data-cache").glob(f"*/{BPE_FILE}"), key=lambda p: p.stat().st_mtime)
            return tokenizer_from_file(cached[-1]) if cached else None
        return tokenizer_from_file(spec)
    except DataError:
        return None
