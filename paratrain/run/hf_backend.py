"""Which modeling code a run trains, and its model on the meta device: the reference `Transformer` of a named config
(or of a Llama/Mixtral directory), or transformers' own model of a Hugging Face directory (`paratrain.models.hf`).

    source = transformers_dir(cfg)            # the directory trained through transformers, or None
    model_cfg = transformers_model_config(cfg, source, overrides)
    model = meta_model(model_cfg)             # HFCausalLM or Transformer, on meta
    init = initializer(model, cfg)            # init(name, full_shape): the directory's weights or the seeded init
"""

from __future__ import annotations

from pathlib import Path

import torch

from paratrain.config import Config, ConfigError


def transformers_dir(cfg: Config) -> str | None:
    """The directory whose model trains on transformers' code: --init-from's, or --model's when it names a directory;
    None for the reference model (a named config, or a llama/mixtral directory under --backend auto/reference)."""
    from paratrain.models.hf import HFModelError, is_model_dir, uses_transformers

    source = cfg.model.init_from or (cfg.model.name if is_model_dir(cfg.model.name) else None)
    if source is None:
        if cfg.model.backend == "transformers":
            raise ConfigError(f"--backend transformers needs a Hugging Face directory (--init-from DIR or --model DIR), "
                              f"not the named config {cfg.model.name!r}")
        return None
    try:
        return source if uses_transformers(source, cfg.model.backend) else None
    except HFModelError as e:
        raise ConfigError(f"{'--init-from' if cfg.model.init_from else '--model'}: {e}") from None


def transformers_model_config(cfg: Config, source: str, overrides: dict):
    """The `HFModelConfig` of `source`, its weights checked against it when they are loaded (--init-from); a size
    override must equal the directory's value (the directory sets the shape)."""
    from paratrain.interop.hf_weights import check_weights
    from paratrain.models.hf import HFModelError, read_model_dir

    flag = "--init-from" if cfg.model.init_from else "--model"
    try:
        model_cfg = read_model_dir(source)
        if cfg.model.init_from:
            check_weights(model_cfg, source)  # the files' headers only
    except HFModelError as e:
        raise ConfigError(f"{flag}: {e}") from None
    check_layout(cfg, model_cfg, flag)
    for key, value in overrides.items():
        if getattr(model_cfg, key, None) != value:
            option = "--" + key.replace("_", "-")
            raise ConfigError(f"{option} {value} disagrees with {flag} {source} ({key}={getattr(model_cfg, key, None)}); "
                              f"drop {option}: the directory sets the model shape")
    return model_cfg


def check_layout(cfg: Config, model_cfg, flag: str) -> None:
    """What transformers' model cannot do under the layout, refused in one line rather than trained differently."""
    p, kind, window = cfg.parallel, model_cfg.model_type, model_cfg.sliding_window
    # A window shorter than the sequence: what the ring and the per-document mask do not keep (each refuses it).
    short_window = window is not None and window < cfg.data.seq_len
    if p.cp > 1 and model_cfg.attention != "sdpa":
        raise ConfigError(f"--cp {p.cp}: {kind} runs transformers' {model_cfg.attention} attention (it has no SDPA "
                          "path), which the context-parallel ring cannot answer; use --cp 1")
    if p.cp > 1 and short_window:
        raise ConfigError(f"--cp {p.cp}: {kind} attends over a sliding window of {window} tokens, "
                          f"shorter than --seq-len {cfg.data.seq_len}, and the ring attends causally over the whole "
                          f"sequence; use --cp 1 or --seq-len {window}")
    if p.tp > 1:  # the plan from the config, mapped now: a style paratrain has no counterpart for refuses here
        from paratrain.models.hf import HFCausalLM
        from paratrain.parallel.tensor import TensorParallelError

        model = HFCausalLM.build(model_cfg)
        try:
            model.tensor_parallel_plan(p.sequence_parallel)
        except TensorParallelError as e:
            raise ConfigError(f"--tp {p.tp}: {e}") from None
    if cfg.data.document_mask and short_window:
        raise ConfigError(f"--document-mask: {kind} attends over a sliding window of {window} tokens, shorter than "
                          f"--seq-len {cfg.data.seq_len}, which the per-document mask does not keep; use --seq-len "
                          f"{window} or drop --document-mask")
    if p.ep > 1:
        from paratrain.models.hf import HFCausalLM
        from paratrain.models.hf_experts import EXPERT_TENSORS, fused_moe_layers

        if not fused_moe_layers(HFCausalLM.build(model_cfg)):
            raise ConfigError(f"--ep {p.ep}: transformers' {kind} has no mixture of experts that expert parallelism "
                              f"splits (a router `gate` beside experts fused as {' and '.join(EXPERT_TENSORS)}); "
                              "use --ep 1")
    from paratrain.parallel.rules import pipeline_model_violations

    broken = pipeline_model_violations(model_cfg, p.pp)  # (before the shape rules: they read its fields)
    if broken:
        raise ConfigError(f"--pp {p.pp}: {broken[0].message}")


def reference_dir_config(path: str):
    """The reference `ModelConfig` of a Llama/Mixtral directory given as --model (config.json only: from scratch)."""
    from paratrain.interop.hf import HFError, read_hf_config

    try:
        return read_hf_config(path)
    except HFError as e:
        raise ConfigError(f"--model: {e}") from None


def meta_model(model_cfg, parallel=None):
    """The model of `model_cfg` on the meta device: transformers' for an `HFModelConfig`, else the reference one.
    Under `parallel` (the run's `ParallelSection`) transformers' model is made what its layout splits, under the
    same names: with --ep its fused mixtures routed as paratrain's (`paratrain.models.hf_experts`), with --pp laid
    out for pipeline stages (`paratrain.interop.hf_stages.LayeredCausalLM`)."""
    from paratrain.models import Transformer
    from paratrain.models.hf import HFCausalLM, HFModelConfig

    if isinstance(model_cfg, HFModelConfig):
        model = HFCausalLM.build(model_cfg)
        if parallel is not None and parallel.ep > 1:
            from paratrain.models.hf_experts import route_experts

            route_experts(model)
        if parallel is not None and parallel.pp > 1:
            from paratrain.interop.hf_stages import LayeredCausalLM

            return LayeredCausalLM(model)
        return model
    with torch.device("meta"):
        return Transformer(model_cfg)


def initializer(model, cfg: Config):
    """init(name, full_shape) -> full fp32 value of a transformers model: --init-from's weights or the seeded init."""
    from paratrain.interop.hf_weights import weight_initializer

    return weight_initializer(model, cfg.model.init_from, cfg.train.seed)


def run_name(cfg: Config) -> str:
    """The model's name in a run directory's name: a directory's last part (--model DIR)."""
    return Path(cfg.model.name).name or "model"
