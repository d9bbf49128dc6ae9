"""What a checkpoint of `paratrain train` carries so that it resumes, and exports, with nothing but itself.

Every checkpoint holds, besides its tensors (`paratrain.run.model_state`) and its shared state
(`paratrain.run.checkpoints`: the resolved config, with the data sources and the recipe's values):

* ``model_config`` in the shared state: the model's full config, a reference `ModelConfig` (shapes, rope and its
  scaling, tied embeddings, experts) or a transformers model's `HFModelConfig`, whose ``hf_config`` is
  transformers' whole config (architecture, rope, dtype, every family field);
* ``assets/`` (`paratrain.checkpoint.format.ASSETS_DIR`): the run's tokenizer as the run loaded it
  (`Tokenizer.save`: ``tokenizer.json`` and a ``tokenizer_config.json`` of its special tokens and chat template;
  ``byte_tokenizer.json`` for the byte tokenizer) and, for a model read from a directory (``--init-from``,
  ``--model DIR``), that directory's ``config.json`` as it was.

These are a few megabytes at most (a tokenizer.json) beside gigabytes of weights, so every checkpoint carries its
own copy rather than pointing at a file of the run: a checkpoint copied elsewhere alone still resumes. A launch
that resumes a checkpoint (`--resume`, or a restart under it) takes the model's config, its architecture's name and
a tokenizer read from files from there, never from the ``--init-from`` directory (which may have moved), and builds
the model without reading the weights the checkpoint replaces: every weight but a LoRA run's frozen base, which
the checkpoint does not hold and the directory still gives.

    assets = run_assets(cfg, tokenizer)       # at the start of a run: what each of its checkpoints carries
    checkpoint = resumed_checkpoint(cfg)      # the step directory this launch resumes, or None
    model_cfg = carried_model_config(cfg)     # its model (None: a fresh run, or a checkpoint older than these)
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from paratrain.checkpoint.format import ASSETS_DIR, MANIFEST_FILE, CheckpointError
from paratrain.checkpoint.store import list_checkpoints, read_index
from paratrain.config import Config
from paratrain.faults import current_attempt
from paratrain.models import ModelConfig
from paratrain.models.hf import CONFIG_FILE, HFModelConfig, is_hf_model_config, is_model_dir, model_config_from_dict
from paratrain.run.rundir import CHECKPOINT_DIR

MODEL_CONFIG_KEY = "model_config"  # the shared-state key of the model's config
TOKENIZER_FILES = ("tokenizer.json", "byte_tokenizer.json")  # what `tokenizer_from_file` looks for in a directory


def run_assets(cfg: Config, tokenizer) -> dict[str, bytes]:
    """The files each checkpoint of the run carries: the tokenizer as `Tokenizer.save` writes it and the model
    directory's config.json (read once, when the run is built)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        assets = {path.name: path.read_bytes() for path in sorted(Path(tmp).iterdir()) if path.is_file()}
    directory = model_directory(cfg)
    if directory is not None:
        assets[CONFIG_FILE] = (Path(directory) / CONFIG_FILE).read_bytes()
    return assets


def model_directory(cfg: Config) -> Path | None:
    """Where the model's config.json is: the resumed checkpoint's assets, else --init-from's or --model's directory."""
    carried = carried_assets(cfg)
    if carried is not None and (carried / CONFIG_FILE).is_file():
        return carried
    source = cfg.model.init_from or (cfg.model.name if is_model_dir(cfg.model.name) else None)
    return Path(source) if source and is_model_dir(source) else None


def resumed_checkpoint(cfg: Config) -> Path | None:
    """The committed checkpoint this launch resumes, as every process knows it before rank 0 decides: --resume's
    step directory (`resolve_resume` made it one), after a restart the run's own newest (`TrainingCheckpoints`
    resumes that one); None for a fresh run, --resume auto or none. (All checkpoints of a run carry the same model.)"""
    resume = cfg.checkpoint.resume
    if resume in ("auto", "none"):
        return None
    if current_attempt() > 0 and cfg.run.out:
        own = list_checkpoints(Path(cfg.run.out) / CHECKPOINT_DIR)
        if own:
            return own[-1]
    path = Path(resume)
    return path if (path / MANIFEST_FILE).is_file() else None


def carried_assets(cfg: Config) -> Path | None:
    """The assets directory of the resumed checkpoint, where it has one (checkpoints saved before assets did not)."""
    checkpoint = resumed_checkpoint(cfg)
    directory = checkpoint / ASSETS_DIR if checkpoint is not None else None
    return directory if directory is not None and directory.is_dir() else None


def carried_tokenizer(cfg: Config) -> str | None:
    """The resumed checkpoint's copy of the run's tokenizer (a directory `tokenizer_from_file` reads), or None."""
    directory = carried_assets(cfg)
    if directory is None or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    return str(directory)


def carried_model_config(cfg: Config) -> ModelConfig | HFModelConfig | None:
    """The model config the resumed checkpoint was saved with (the document mask off: the run sets it from its
    data), or None for a fresh run or a checkpoint that stores none."""
    checkpoint = resumed_checkpoint(cfg)
    if checkpoint is None:
        return None
    doc = read_index(checkpoint).shared_state.get(MODEL_CONFIG_KEY)
    if not isinstance(doc, dict):
        return None
    try:
        model_cfg = stored_model_config(doc)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}: the stored {MODEL_CONFIG_KEY} is invalid ({exc})") from None
    return dataclasses.replace(model_cfg, document_eos=None)


def stored_model_config(doc: dict) -> ModelConfig | HFModelConfig:
    """A model config stored as a dict (`dataclasses.asdict`): a reference `ModelConfig` or an `HFModelConfig`."""
    if is_hf_model_config(doc):
        return model_config_from_dict(doc)
    return ModelConfig(**doc)


def model_difference(saved, other) -> str | None:
    """The first field in which two model configs differ ('n_layers is 2 there, 4 here'), or None when they are
    the same model (where it was read from and the document mask aside)."""
    if type(saved) is not type(other):
        kinds = {ModelConfig: "the reference model", HFModelConfig: "a transformers model"}
        return f"{kinds.get(type(saved), type(saved).__name__)} there, {kinds.get(type(other), type(other).__name__)} here"
    ignored = {"directory", "document_eos", "hf_config"}
    theirs, mine = dataclasses.asdict(saved), dataclasses.asdict(other)
    for key in theirs:
        if key not in ignored and theirs[key] != mine.get(key):
            return f"{key} is {theirs[key]!r} there, {mine.get(key)!r} here"
    if isinstance(saved, HFModelConfig):
        keep = lambda doc: {k: v for k, v in doc.items() if not k.startswith("_") and k != "transformers_version"}  # noqa: E731
        theirs, mine = keep(saved.hf_config), keep(other.hf_config)
        for key in sorted(set(theirs) | set(mine)):
            if theirs.get(key) != mine.get(key):
                return f"config.json's {key} is {json.dumps(theirs.get(key))} there, {json.dumps(mine.get(key))} here"
    return None
