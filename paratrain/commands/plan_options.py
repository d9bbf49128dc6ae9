"""`paratrain plan`'s options and what they make: the workload, the hardware, one layout or a search space.

The model, batch and layout options are `paratrain train`'s (`paratrain.commands.options`: the
same names, types, choices and help, from the config dataclasses); the planner keeps its older
spellings as aliases (`--seq` for `--seq-len`, `--layers` for `--n-layers`, ...) and says in each
option's help what it does without it. `--recompute none|selective|full` says what `--activation-checkpointing
none|selective|full` (or 0|1) says; the planner models no other k.
"""

from __future__ import annotations

import dataclasses
import os

from paratrain.commands.options import add_config_options
from paratrain.models.configs import ModelConfig, get_model_config
from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE, ScheduleName
from paratrain.parallel.rules import DEFAULT_LOSS_CHUNK, ZERO_STAGES
from paratrain.plan.budget import DEFAULT_BATCH_TOKENS
from paratrain.plan.hardware import GemmCurve, Hardware, get_hardware
from paratrain.parallel.rules import Checkpointing
from paratrain.plan.memory import Layout, PlanError, Recompute, Workload
from paratrain.plan.search import SearchSpace
from paratrain.plan.sizes import parse_bytes, parse_count

# The options `paratrain plan` shares with `paratrain train` (`paratrain.commands.options`): train's
# names, types, choices and help. Each with the planner's older spellings, kept as aliases, and what
# the planner does without it where that differs from train's default.
MODEL_OPTIONS = {
    "model.name": ((), "none: give --params or --n-layers/--dim/--n-heads"),
    "model.n_layers": (("--layers",), "--model's"),
    "model.dim": (("--hidden",), "--model's"),
    "model.n_heads": (("--heads",), "--model's"),
    "model.n_kv_heads": (("--kv-heads",), "--model's, else --n-heads"),
    "model.vocab_size": (("--vocab",), "--model's, else 32000"),
    "model.ffn_dim": (("--ffn",), "--model's, else 8/3 × --dim rounded up to 256"),
}
BATCH_OPTIONS = {
    "data.seq_len": (("--seq",), "the model's pretraining length (8,192 for Llama 3.x, 4,096 for Llama 2; "
                                 "ModelConfig.pretraining_seq_len), else 2048"),
    "train.global_batch": ((), "dp × micro-batch; with --gpus or --tokens, 4M tokens per step (Llama 2's)"),
    "train.micro_batch": ((), f"1; --gpus searches {', '.join(map(str, SearchSpace.micro_batch))}"),
    "parallel.precision": ((), "bf16: mixed precision, K = 12 bytes of optimizer state per parameter; fp32: K = 8"),
    "parallel.reduce_dtype": ((), "the --precision dtype"),
    "parallel.fp8": ((), "none: the blocks' linears in --precision; tensorwise or rowwise: at the hardware's FP8 "
                         "rate (h100-80gb, h200: twice bf16's peak) plus their casts"),
    "train.optimizer": ((), "adamw; muon: the blocks' matrices keep one momentum buffer (4 bytes, not Adam's 8) "
                            "and the step adds their Newton-Schulz matmuls and the exchange of their pieces"),
    "parallel.fp8_min_features": ((), "1024, parallelize's on CUDA: the linears a GPU run keeps in --precision "
                                      "(fewer whole-layer in or out features) are priced there; 0: every block "
                                      "linear in FP8"),
    "parallel.loss_chunk": ((), "train's: one chunk's logits at a time and the head's matmul once more in backward; "
                                "0: the whole fp32 logits kept, and twice that in the loss's backward"),
}
LAYOUT_OPTIONS = {
    "parallel.dp": ((), "1, or what --gpus leaves"),
    "parallel.dp_shard": ((), "the whole data axis; --gpus searches every divisor of dp"),
    "parallel.tp": ((), "1; --gpus searches"),
    "parallel.pp": ((), "1; --gpus searches"),
    "parallel.cp": ((), "1; --gpus searches it where each rank keeps at least 8192 tokens of a sequence"),
    "parallel.zero": ((), "0; --gpus searches"),
    "parallel.virtual_stages": ((), "2 with --schedule interleaved, else 1"),
    "parallel.sequence_parallel": ((), "off; --gpus searches both"),
    "parallel.activation_checkpointing": ((), "none; the planner models none, selective and full (1), see --recompute"),
    "parallel.compile": ((), "off: eager, one kernel per element-wise operator; on: the compiled stack's fused "
                             "kernels (the step time only)"),
    "parallel.schedule": ((), f"{DEFAULT_SCHEDULE.value}; gpipe holds m micro-batches, 1f1b and zb-h1 "
                              "min(p, m), interleaved p + (p-1)/v"),
    "parallel.ep": ((), "1; --gpus searches the divisors of dp that divide the experts"),
    "parallel.offload": ((), "none: the optimizer on the device; optimizer: its masters and state in host memory "
                             "(host bytes per rank shown), its step priced at the host's memory and PCIe rates; "
                             "params (--zero 3): the parameter shards too, copied to the device for each gather"),
}
LORA_OPTIONS = {
    "lora.rank": ((), "off: every parameter trains; a rank: adapters on every block linear, the rest frozen "
                      "(`paratrain.plan.lora`)"),
    "lora.base_dtype": ((), ""),  # (train's help says it: the compute dtype by default)
}
PLAN_DEFAULTS = {"parallel.precision": "bf16"}  # (its help says so: OPTIONS' note)
SIZES = ("n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim")


def add_shared_options(group, options: dict) -> None:
    """`options` (config key: (aliases, the planner's default)) as train's flags, into `group`."""
    add_config_options(group, options, aliases={key: spellings for key, (spellings, _) in options.items()},
                       # The planner's own defaults are filled where read (`workload_from_args`), so that its first
                       # line can say which it assumed.
                       notes={key: note for key, (_, note) in options.items() if note})


def model_from_args(args, opts: dict) -> tuple[ModelConfig | None, str]:
    """The model config and a display name; (None, 'model states only') for --params."""
    sizes = {name: opts[f"model.{name}"] for name in SIZES if opts.get(f"model.{name}") is not None}
    name = opts.get("model.name")
    if args.params is not None:
        if name or sizes:
            raise PlanError("--params gives the parameter count only; do not combine it with --model or sizes")
        return None, "model states only"
    if name and os.path.isfile(os.path.join(name, "config.json")):  # a Hugging Face directory: its exact shapes
        if sizes:
            raise PlanError(f"--model {name} sets the model's shape; drop the size options")
        return directory_model(name), os.path.basename(os.path.normpath(name))
    if name:
        cfg = get_model_config(name)
        return (dataclasses.replace(cfg, **sizes) if sizes else cfg), name
    missing = [flag for flag, key in (("--layers", "n_layers"), ("--hidden", "dim"), ("--heads", "n_heads"))
               if key not in sizes]
    if missing:
        raise PlanError(f"missing {', '.join(missing)}: give --model NAME, --params N or --layers/--hidden/--heads")
    dim = sizes["dim"]
    sizes.setdefault("n_kv_heads", sizes["n_heads"])
    sizes.setdefault("vocab_size", 32000)
    sizes.setdefault("ffn_dim", -(-(8 * dim // 3) // 256) * 256)
    return ModelConfig(**sizes, max_seq_len=max(opts.get("data.seq_len") or 2048, 2048)), "custom"


def directory_model(path: str):
    """The model of a Hugging Face directory as `paratrain train` would build it (`--backend auto`): the reference
    model's `ModelConfig` for llama and mixtral, else transformers' model counted on the meta device."""
    from paratrain.models.hf import HFModelError, read_model_dir, uses_transformers

    try:
        if uses_transformers(path, "auto"):
            return read_model_dir(path)
        from paratrain.interop.hf import HFError, read_hf_config

        try:
            return read_hf_config(path)
        except HFError as e:
            raise PlanError(f"--model {path}: {e}") from None
    except HFModelError as e:
        raise PlanError(f"--model {path}: {e}") from None


def workload_from_args(args, opts: dict) -> tuple[Workload, str]:
    model, name = model_from_args(args, opts)
    seq = opts.get("data.seq_len") or (model.pretraining_seq_len if model is not None else 2048)
    batch = opts.get("train.global_batch")
    if batch is None and (args.tokens is not None or args.gpus is not None):
        batch = max(1, round(DEFAULT_BATCH_TOKENS / seq))
    common = dict(seq_len=seq, global_batch=batch, precision=opts.get("parallel.precision") or PLAN_DEFAULTS[
                      "parallel.precision"],
                  reduce_dtype=opts.get("parallel.reduce_dtype"), fp8=opts.get("parallel.fp8") or None,
                  loss_chunk=opts.get("parallel.loss_chunk", DEFAULT_LOSS_CHUNK),
                  optimizer=opts.get("train.optimizer") or "adamw", lora=opts.get("lora.rank"),
                  base_dtype=opts.get("lora.base_dtype") or None)
    minimum = opts.get("parallel.fp8_min_features")
    if minimum is not None and minimum >= 0:  # (-1: the default, as `paratrain train` reads it)
        common["fp8_min_features"] = minimum
    if model is not None:
        common["moe_imbalance"] = getattr(args, "moe_imbalance", Workload.moe_imbalance)
        common["flash_attention"] = getattr(args, "attention", "flash") == "flash"
    if model is None:
        return Workload.for_params(parse_count(args.params), **common), name
    return Workload.for_model(model, **common), name


def hardware_from_args(args, precision: str) -> Hardware:
    overrides = {"gpus_per_node": args.gpus_per_node,
                 "memory_bytes": parse_bytes(args.gpu_memory) if args.gpu_memory else None,
                 "intra_node_bytes_per_s": args.intra_node_gbps * 1e9 if args.intra_node_gbps else None,
                 "inter_node_bytes_per_s": args.inter_node_gbps * 1e9 if args.inter_node_gbps else None}
    if args.peak_tflops is not None:
        overrides[f"peak_{precision}"] = args.peak_tflops * 1e12
    if args.efficiency is not None:
        curve = get_hardware(args.hardware).gemm(precision)
        overrides[f"gemm_{precision}"] = GemmCurve(args.efficiency, curve.half_size)
    return get_hardware(args.hardware, **overrides)


def recompute_from_args(args, opts: dict) -> Recompute | None:
    """--recompute, or --activation-checkpointing in the planner's terms (none, selective, full); None: not given."""
    setting = opts.get("parallel.activation_checkpointing")
    if setting is None:
        return Recompute(args.recompute) if args.recompute else None
    if args.recompute is not None:
        raise PlanError("--recompute and --activation-checkpointing say the same thing; give one of them")
    checkpointing = Checkpointing.parse(setting)
    if checkpointing.every > 1:  # checkpointing every k-th block: the planner recomputes all blocks or none
        raise PlanError(f"--activation-checkpointing {setting}: the planner models none, selective and full "
                        f"(every block); use one of them")
    return checkpointing.mode


def _virtual_stages(opts: dict) -> int:
    if opts.get("parallel.virtual_stages") is not None:
        return opts["parallel.virtual_stages"]
    return 2 if opts.get("parallel.schedule") == ScheduleName.INTERLEAVED.value else 1


def layout_from_args(args, opts: dict) -> Layout:
    def given(name, default):
        value = opts.get(f"parallel.{name}")
        return default if value is None else value

    return Layout(dp=given("dp", 1), tp=given("tp", 1), pp=given("pp", 1), cp=given("cp", 1), zero=given("zero", 0),
                  dp_shard=given("dp_shard", 0), micro_batch=opts.get("train.micro_batch", 1),
                  virtual_stages=_virtual_stages(opts), sequence_parallel=given("sequence_parallel", False),
                  recompute=recompute_from_args(args, opts) or Recompute.NONE,
                  schedule=given("schedule", DEFAULT_SCHEDULE), compile=given("compile", False),
                  ep=given("ep", 1), offload=given("offload", None) or None)


def space_from_args(args, opts: dict) -> SearchSpace:
    def one(value, default):
        return (value,) if value is not None else default

    return SearchSpace(
        dp=opts.get("parallel.dp"), tp=opts.get("parallel.tp"), pp=opts.get("parallel.pp"), cp=opts.get("parallel.cp"),
        # offloaded parameters are ZeRO-3's shards
        zero=one(opts.get("parallel.zero"), (3,) if opts.get("parallel.offload") == "params" else ZERO_STAGES),
        dp_shard=opts.get("parallel.dp_shard"),
        micro_batch=one(opts.get("train.micro_batch"), SearchSpace.micro_batch),
        recompute=one(recompute_from_args(args, opts), tuple(Recompute)),
        sequence_parallel=one(opts.get("parallel.sequence_parallel"), (False, True)),
        schedule=ScheduleName(opts.get("parallel.schedule", DEFAULT_SCHEDULE)), virtual_stages=_virtual_stages(opts),
        compile=bool(opts.get("parallel.compile", False)), ep=opts.get("parallel.ep"),
        offload=opts.get("parallel.offload") or None)
