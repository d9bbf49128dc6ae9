"""Run configuration: sectioned dataclasses, TOML files and command-line overrides.

Each section is a dataclass whose fields carry their own help text; the
command line is derived from them (``--steps``, ``--global-batch``, ...), so a
new option is one field here and nothing else. A TOML file has one table per
section (``[train]``, ``[data]``, ...); unknown sections or keys are errors.
The resolved configuration is written as JSON into every run directory.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.errors import ParatrainError
from paratrain.option_values import ConfigError, coerce, option
from paratrain.parallel import rules
from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE, SCHEDULES
from paratrain.parallel.rules import ZERO_STAGES, CheckedLayout, LayoutSpec


DEFAULT_GLOBAL_BATCH = 16
RECIPE_DEFAULT = "(default: the model's recipe, shown by `paratrain models`)"
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class ModelSection:
    name: str = option("tiny", "named model config (see `paratrain models`), or a Hugging Face model directory "
                               "(config.json: any causal LM transformers implements, trained from scratch)",
                       flag="--model")
    n_layers: int | None = option(None, "override the number of transformer blocks")
    dim: int | None = option(None, "override the hidden size")
    n_heads: int | None = option(None, "override the number of query heads")
    n_kv_heads: int | None = option(None, "override the number of key/value heads")
    ffn_dim: int | None = option(None, "override the feed-forward hidden size")
    vocab_size: int | None = option(None, "override the vocabulary size (must hold the tokenizer's)")
    tie_embeddings: bool | None = option(None, "override whether the output layer shares the embedding")
    init_from: str | None = option(
        None, "start from the weights of a Hugging Face directory (any causal LM transformers implements, e.g. written "
              "by save_pretrained or `paratrain export`); its config.json sets the model shape, --model only names the "
              "run, size overrides must agree",
        flag="--init-from")
    backend: str = option(
        "auto", "modeling code of a Hugging Face directory: 'transformers' (transformers' own, any causal LM), "
                "'reference' (paratrain's Llama/Mixtral), 'auto' (reference for llama and mixtral, else transformers)",
        choices=("auto", "reference", "transformers"))


@dataclass
class DataSection:
    path: str = option(
        "default",
        "corpus: 'default' (this Python's standard-library sources), a text, JSON Lines (.jsonl, .jsonl.gz, "
        ".jsonl.zst) or Parquet file, a directory or glob of them, a saved `datasets` dataset, hf:NAME[:SPLIT] (from "
        "the hub, streamed), a directory made by `paratrain prepare`, or Megatron's PREFIX.bin/.idx as PREFIX; "
        "or a mixture of them, 'W:SOURCE,W:SOURCE' (e.g. '0.7:web.jsonl.gz,0.3:code/'), W the share of samples",
        flag="--data",
    )
    tokenizer: str = option(
        "auto",
        "'byte', 'bpe:N' (train an N-token BPE locally), a tokenizer.json path, a model directory (tokenizer.json "
        "and tokenizer_config.json, whose chat template renders chat data), or 'auto' (the tokenizer stored with a "
        "prepared corpus, else --init-from's, else 'byte')")
    text_key: str = option("text", "the field of a JSON Lines record or Parquet/dataset column holding its text")
    seq_len: int = option(256, "tokens per training sequence")
    eval_fraction: float = option(0.02, "fraction of the token stream held out for evaluation")
    eval_data: str = option("", "a named held-out set NAME=PATH (any --data source), its loss logged as its own; "
                                "repeat the option for more", flag="--eval-data", repeat=True)
    document_mask: bool | None = option(
        None, "attention stays within each document of a packed sequence and positions restart per document (at "
              "each end-of-text token; under --cp the reference model only) (default: on for chat data, off for text)")
    format: str = option("auto", "'chat' (records of messages, conversations or prompt/completion, rendered by the "
                                 "tokenizer's chat template), 'text', or 'auto': from the first record of each source",
                         flag="--format", choices=("auto", "chat", "text"))
    chat_template: str = option("", "a Jinja chat template file, instead of the --tokenizer directory's "
                                    "(tokenizer_config.json's chat_template or chat_template.jinja)")
    loss_on: str = option("assistant", "chat data's targets: the assistant turns (their content and end-of-turn "
                                       "token), 'completion' (the last assistant turn), or 'all' tokens",
                          choices=("assistant", "all", "completion"))
    long: str = option("drop", "a conversation longer than --seq-len + 1 tokens: 'drop' it, or 'truncate' it to its "
                               "start", choices=("drop", "truncate"))


@dataclass
class TrainSection:
    steps: int = option(150, "optimizer steps")
    global_batch: int | None = option(None, "sequences per optimizer step, summed over all data ranks (default: "
                                            f"{DEFAULT_GLOBAL_BATCH}, or the nearest multiple of micro-batch × data "
                                            "ranks)")
    micro_batch: int | None = option(None, "sequences per forward/backward; accumulation = global / (micro * data "
                                           "ranks) (default: global / data ranks, one micro-batch per rank)")
    # The optimizer and schedule: None takes the named model's published recipe (`resolve_recipe`).
    optimizer: str = option("adamw", "adamw, or muon: torch.optim.Muon for the 2-D weights of the blocks (each expert's "
                                     "matrix of an MoE), AdamW (--lr, --weight-decay, --beta1/2, --eps) for the "
                                     "embeddings, head, norms and biases; one schedule scales both learning rates")
    muon_lr: float = option(0.02, "Muon's peak learning rate with --optimizer muon (default 0.02: Keller Jordan's Muon "
                                  "and modded-nanogpt, with torch's adjust_lr_fn 'original')")
    muon_momentum: float = option(0.95, "Muon's momentum (default 0.95: torch.optim.Muon's, Nesterov)")
    muon_weight_decay: float = option(0.1, "Muon's decoupled weight decay (default 0.1: torch.optim.Muon's)")
    muon_adjust_lr: str = option("original", "Muon's per-matrix learning-rate scale: original (√max(1, rows/cols), "
                                             "Keller Jordan) or match_rms_adamw (0.2·√max(rows, cols), Moonshot's: "
                                             "reuses AdamW's learning rate)")
    lr: float | None = option(None, f"peak learning rate (AdamW) {RECIPE_DEFAULT}")
    min_lr: float | None = option(None, "learning rate at the end of the cosine decay (default: the recipe's, or "
                                        "with --lr given the recipe's fraction of it)")
    warmup_steps: int | None = option(None, f"steps of linear warmup from 0 to --lr {RECIPE_DEFAULT}")
    weight_decay: float | None = option(None, f"AdamW decoupled weight decay (matrices only, not norms) "
                                              f"{RECIPE_DEFAULT}")
    beta1: float | None = option(None, f"AdamW beta1 {RECIPE_DEFAULT}")
    beta2: float | None = option(None, f"AdamW beta2 {RECIPE_DEFAULT}")
    eps: float | None = option(None, f"AdamW epsilon {RECIPE_DEFAULT}")
    grad_clip: float | None = option(None, f"clip the global gradient norm to this value (0 disables) "
                                           f"{RECIPE_DEFAULT}")
    seed: int = option(0, "seed for initialization and data order")
    eval_every: int = option(50, "evaluate every N steps (and at the end); 0 evaluates only at the end")
    log_every: int = option(1, "write the step record to metrics.jsonl every N steps (and at the last and "
                               "at each evaluation); the progress bar shows every step")
    eval_batches: int = option(8, "held-out batches of --global-batch sequences per evaluation")
    sample_tokens: int = option(200, "tokens to generate as a text sample at the end (0 disables)")
    peak_flops: float | None = option(None, "peak FLOP/s of one device, the denominator of MFU (default: the "
                                            "device's dense 16-bit peak from its name, paratrain.hardware; "
                                            "none on a CPU, then no MFU is logged)")


@dataclass
class ParallelSection:
    dp: int = option(0, "data-parallel degree (0: the world size divided by tp × cp × pp)")
    dp_shard: int = option(0, "hybrid sharding: ZeRO shards over groups of this many data ranks (a node) and "
                              "replicates over dp / dp_shard groups (0: shard over all data ranks)")
    tp: int = option(1, "tensor-parallel degree: each layer's weight matrices split over tp ranks "
                        "(must divide the heads, kv heads, ffn size and vocabulary)")
    sequence_parallel: bool = option(False, "with --tp > 1, split norms and residuals along the sequence "
                                            "(same communication, 1/tp of those activations)")
    pp: int = option(1, "pipeline-parallel degree: the layers split into pp stages on different ranks")
    cp: int = option(1, "context-parallel degree: each sequence split into 2·cp load-balanced chunks over cp "
                        "neighbouring ranks, attention as a ring (--seq-len divisible by 2·cp)")
    ep: int = option(1, "expert-parallel degree: the experts of each MoE layer split over ep neighbouring data "
                        "ranks, tokens sent to them by all-to-all (divides dp and the model's experts)")
    schedule: str = option(DEFAULT_SCHEDULE.value, "pipeline schedule (micro-batches per step = global batch / "
                                                   "(micro-batch × dp))", choices=SCHEDULES)
    virtual_stages: int = option(1, "model chunks per pipeline rank (> 1 with --schedule interleaved)")
    zero: int = option(0, "ZeRO stage: 0 DDP, 1 shard optimizer state, 2 + gradients, 3 + parameters",
                       choices=ZERO_STAGES)
    precision: str = option("fp32", "compute dtype; master weights and optimizer state stay fp32",
                            choices=("fp32", "bf16", "fp16"))
    reduce_dtype: str = option("fp32", "dtype of gradient communication", choices=("fp32", "bf16", "fp16"))
    fp8: str = option("", "FP8 matmuls in the blocks' linears: 'tensorwise' or 'rowwise' (with --precision bf16; "
                          "embeddings and the output head stay bf16)", choices=("", "tensorwise", "rowwise"))
    fp8_min_features: int = option(-1, "with --fp8, linears with fewer input or output features stay in the compute "
                                       "dtype (-1: 1024 on a GPU, whose smaller matmuls do not repay their casts; 0 "
                                       "on the CPU)")
    loss_chunk: int = option(rules.DEFAULT_LOSS_CHUNK,
                             "the loss takes the output head's matmul and the cross-entropy together in chunks of "
                             "this many tokens, never holding the whole logits (the head's matmul runs again in "
                             "backward); 0: whole logits")
    activation_checkpointing: int | str = option(
        0, "recompute activations in backward: 'full' (every block, from its input), 'selective' (every block "
           "keeps its matmuls' and attention's outputs, recomputes norms and element-wise ops), k (every k-th "
           "block, full), 0 or 'none' (off)")
    compile: bool = option(False, "torch.compile each block (paratrain's hooks and communication stay outside the "
                                  "compiled regions; the first step compiles)")
    bucket_mb: float = option(25.0, "gradient bucket size in MB (DDP, ZeRO-1/2)")
    offload: str = option("", "'optimizer': this rank's fp32 master weights and optimizer state in host memory, "
                              "stepped by the CPU (the device keeps the bf16 weights and gradients), every ZeRO "
                              "stage; 'params' (--zero 3): the parameter shards too", choices=("", "optimizer", "params"))


@dataclass
class LoraSection:
    rank: int | None = option(None, "train low-rank adapters of this rank on a frozen model (LoRA): only the adapters "
                                    "take gradients, masters and optimizer state (default: off, every parameter "
                                    "trains)", flag="--lora")
    alpha: float | None = option(None, "the adapters' output is scaled by alpha / rank (default: 2 × rank)",
                                 flag="--lora-alpha")
    dropout: float = option(0.0, "dropout on the adapters' input, in training", flag="--lora-dropout")
    targets: str = option("", "the linears that get adapters: comma-separated module-name patterns (fnmatch; a "
                              "pattern also matches a name's end after a dot, as PEFT's target_modules: 'wq,wv', "
                              "'layers.0.*') (default: every linear inside the blocks, not the head or embeddings)",
                          flag="--lora-targets")
    base_dtype: str = option("", "how the frozen base weights of the targets are stored: 'bf16', 'nf4' (QLoRA: 4-bit "
                                 "NormalFloat, blocks of 64 with double-quantized scales, decoded for each matmul) or "
                                 "'fp8' (float8 e4m3 bytes with one scale per output row, decoded for each matmul) "
                                 "(default: the compute dtype)", flag="--base-dtype",
                             choices=("", "bf16", "nf4", "fp8"))


@dataclass
class RunSection:
    out: str = option("", "run directory for config.json, metrics.jsonl and checkpoints "
                          "(default: a new runs/<model>-<time>)")
    overwrite: bool = option(False, "reuse --out even if it already holds a run (its metrics and checkpoints "
                                    "are deleted: a new run starts)")
    nproc: int = option(1, "local processes to launch (through torch's elastic launcher)")
    max_restarts: int = option(0, "restarts of the whole process group after a failure (with --nproc)")
    nnodes: int = option(1, "nodes of the job, one `paratrain train --nproc N` each, meeting at --rdzv-endpoint")
    rdzv_endpoint: str = option("", "HOST:PORT of the c10d rendezvous, the same on every node (required with "
                                    "--nnodes > 1; auto: a free port on 127.0.0.1)")
    rdzv_id: str = option("", "job id shared by the nodes' launchers (required with --nnodes > 1; auto: a "
                              "fresh one)")
    join_timeout_s: float = option(600.0, "seconds the launcher waits for every node to join the rendezvous",
                                   flag="--join-timeout")
    node_timeout_s: int = option(15, "seconds without a heartbeat from a node's launcher after which the rendezvous "
                                     "counts the node lost and goes on without it (a node started in its place "
                                     "joins then); heartbeats every third of it", flag="--node-timeout")
    mem_budget: str = option("auto", "memory one process may use, which the planner's estimate for this layout "
                                     "must fit: 'auto' (CUDA: the device's memory less the CUDA context and NCCL's "
                                     "buffers, then its free memory once the process groups exist; CPU: this "
                                     "machine's memory divided by the local processes) or a size such as 16GB or "
                                     "512MiB")
    mem_check: bool = option(True, "refuse to start when the planner's per-process memory estimate exceeds "
                                   "--mem-budget (--no-mem-check starts anyway)")
    log_samples: bool = option(False, "write the sample ids each rank reads at each step to "
                                      "<out>/samples/rank-R.jsonl (to check the data order)")
    progress: bool = option(True, "show a progress bar on the console")
    tensorboard: bool = option(False, "also write each metrics.jsonl step record as TensorBoard scalars to "
                                      "<out>/tensorboard (a spelling of --tracker tensorboard)")


@dataclass
class LoggingSection:
    trackers: str = option("", "also send every metrics.jsonl record to these trackers, comma-separated: tensorboard "
                               "(<out>/tensorboard), wandb (Weights & Biases; WANDB_MODE=offline writes <out>/wandb to "
                               "sync later), mlflow (MLFLOW_TRACKING_URI, default a file store in <out>/mlruns); rank 0 "
                               "sends them from a thread of its own, so a slow or failing service never stalls a step",
                           flag="--tracker")
    profile_steps: str = option("", "record torch.profiler traces (CPU and CUDA activity, shapes) of steps A to B, "
                                    "e.g. 4:5, one Chrome trace per rank: <out>/profile/rank-N-step-A-B.json.gz "
                                    "(open it in Perfetto)")
    memory_snapshot: bool = option(False, "CUDA: record the allocator's history from the start and dump a snapshot "
                                          "after the first optimizer step and when a step runs out of memory, "
                                          "<out>/memory/rank-N-*.pickle (PyTorch's memory visualizer reads it)")


@dataclass
class CheckpointSection:
    every: int | str = option(
        "30m", "save a sharded checkpoint under <out>/checkpoints every N steps, or by the clock every N minutes "
               "('30m'; also '90s', '2h'), and always at the last step and on SIGTERM; 0: never (a SIGTERM still "
               "saves one before the run stops)", flag="--checkpoint-every")
    keep_latest: int = option(2, "committed checkpoints to keep, the newest (at least 2, so that a damaged newest "
                                 "one leaves a fallback; 0 keeps all)", flag="--keep-latest")
    async_save: bool = option(False, "write checkpoints from a background thread; training pauses only while "
                                     "this rank's tensors are copied", flag="--checkpoint-async")
    resume: str = option("auto", "'auto': continue from the newest valid checkpoint of the run in --out (if "
                                 "any); 'none': start afresh; or the path of a step-* checkpoint directory, "
                                 "saved under any layout", flag="--resume")
    load_step: int = option(0, "with --resume auto, continue from this step's checkpoint instead of the newest "
                               "(0: the newest); newer checkpoints of the run are set aside", flag="--load-step")
    snapshot_every: int = option(
        0, "every N steps, each rank also writes its state to node-local memory (--snapshot-dir) in the background "
           "and sends a copy to a buddy rank on another node; a restart restores from the newest snapshot complete on "
           "every rank, reading no disk, unless a disk checkpoint is newer (0: off)", flag="--snapshot-every")
    snapshot_dir: str = option(
        "/dev/shm/paratrain", "node-local directory (memory: a tmpfs) of the --snapshot-every snapshots; the job's go "
                              "in a subdirectory named by its run id, removed when the run finishes",
        flag="--snapshot-dir")
    snapshot_buddy: str = option(
        "next-node", "which rank holds each rank's --snapshot-every copy: 'next-node' (the same local rank on the next "
                     "node; on one node the next local rank), 'next-rank' (rank r + 1), or a map of every rank to its "
                     "buddy, RANK:BUDDY comma-separated (e.g. 0:2,1:3,2:0,3:1; each rank holds one copy)",
        flag="--snapshot-buddy")
    reset: str = option("", "with --resume PATH, a new stage from its model and optimizer: 'data' (a new --data), 'lr' "
                            "(the schedule again over the steps left), 'step' (count from 0), comma-separated")


@dataclass
class ReliabilitySection:
    nan_policy: str = option("skip", "a step whose loss or gradients are not finite on some rank: 'skip' it on "
                                     "every rank (stopping after --max-bad-steps in a row) or 'abort' the run",
                             choices=("skip", "abort"))
    max_bad_steps: int = option(3, "with --nan-policy skip, stop the run after this many non-finite steps in a row")
    check_every: int = option(0, "every N steps, compare a hash of the replicated parameters across ranks and "
                                 "stop if the replicas diverged (0: never)")
    pg_timeout_s: float = option(600.0, "seconds a collective waits for its peers before the run fails with a "
                                        "diagnostic of which rank is where (process-group timeout)",
                                 flag="--pg-timeout")
    straggler_threshold: float = option(
        0.2, "a rank whose compute time of a step exceeds the median of all ranks' by more than this fraction is slow; "
             "slow for --straggler-steps steps in a row, it is named in a warning and in metrics.jsonl",
        flag="--straggler-threshold")
    straggler_steps: int = option(5, "steps in a row a rank must be slow (--straggler-threshold) to be named a "
                                     "straggler", flag="--straggler-steps")
    step_timeout_s: float = option(0.0, "seconds one training step (with the checkpoint and evaluation after it) "
                                        "may take before a watchdog kills the process, so that the launcher "
                                        "restarts the job (a hang outside collectives; 0: off)",
                                   flag="--step-timeout")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    run: RunSection = field(default_factory=RunSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    reliability: ReliabilitySection = field(default_factory=ReliabilitySection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        """Build a config from nested dicts; unknown sections or keys are errors."""
        sections = {}
        for section in dataclasses.fields(cls):
            values = data.get(section.name, {})
            if not isinstance(values, dict):  # e.g. `train = 3` in a TOML file
                raise ConfigError(f"[{section.name}] must be a table of options, got {values!r}")
            values = dict(values)
            sections[section.name] = _build_section(section.name, section.default_factory, values)
        unknown = sorted(set(data) - set(sections))
        if unknown:
            raise ConfigError(f"unknown config section(s) {unknown}; known: {sorted(sections)}")
        return cls(**sections)


def _build_section(name: str, section_cls: type, values: dict):
    known = {f.name: f for f in dataclasses.fields(section_cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{name}]; known: {sorted(known)}")
    return section_cls(**{k: coerce(f"{name}.{k}", section_cls, known[k], v) for k, v in values.items()})


def load_toml(path: str | Path) -> dict:
    """Read a TOML config file into nested dicts (validated later by Config.from_dict)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"--config {str(path)!r} {what}; pass a TOML file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: invalid TOML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    for name, value in data.items():
        if not isinstance(value, dict):
            raise ConfigError(f"--config {path}: {name} = {value!r} is not a table; options go in tables such "
                              f"as [train]")
    return data


def iter_options():
    """Yield (section name, section class, field, flag) for every configurable option."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            yield section.name, section.default_factory, f, flag


def validate(cfg: Config, world_size: int = 1, model_cfg=None) -> CheckedLayout:
    """Check every rule that can be checked before any process starts; raise ConfigError.

    The option values first (`check_values`), then the layout (`layout_spec`, decided by
    `paratrain.parallel.rules.check_layout`; without the model, the rules on its shape wait).
    """
    check_values(cfg)
    return rules.check_layout(layout_spec(cfg, world_size, model_cfg), ConfigError)


OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("original", "match_rms_adamw")


def _check_optimizer(t: TrainSection) -> None:
    if t.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}")
    if t.optimizer != "muon":
        return
    for name, value in [("--muon-lr", t.muon_lr), ("--muon-weight-decay", t.muon_weight_decay)]:
        if value < 0:
            raise ConfigError(f"{name} must not be negative, got {value}")
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"--muon-momentum must be in [0, 1), got {t.muon_momentum}")
    if t.muon_adjust_lr not in MUON_ADJUST_LR:
        raise ConfigError(f"--muon-adjust-lr must be one of {', '.join(MUON_ADJUST_LR)}, got {t.muon_adjust_lr!r}")
    from paratrain.parallel.muon import MuonConfigError, check_muon_options

    try:
        check_muon_options(muon_options(t))
    except MuonConfigError as e:
        raise ConfigError(str(e)) from None


def muon_options(t: TrainSection) -> dict:
    """torch.optim.Muon's keyword arguments from the train section (the learning rate the schedule's peak)."""
    return {"lr": t.muon_lr, "momentum": t.muon_momentum, "weight_decay": t.muon_weight_decay,
            "adjust_lr_fn": t.muon_adjust_lr}


def check_values(cfg: Config) -> None:
    """The rules of each option's own value (ranges, and the launcher's and reliability options); ConfigError.

    The named model's recipe first fills the options left unset (`resolve_recipe`), so that every path
    that checks the values (validate, the trainer's preflight) checks the values the run will use.
    """
    resolve_recipe(cfg)
    t, d, r = cfg.train, cfg.data, cfg.run
    for name, value in [("--steps", t.steps), ("--global-batch", t.global_batch),
                        ("--micro-batch", t.micro_batch), ("--seq-len", d.seq_len),
                        ("--nproc", r.nproc), ("--eval-batches", t.eval_batches), ("--log-every", t.log_every)]:
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    for name, value in [("--lr", t.lr), ("--min-lr", t.min_lr), ("--weight-decay", t.weight_decay),
                        ("--grad-clip", t.grad_clip), ("--warmup-steps", t.warmup_steps),
                        ("--eval-every", t.eval_every), ("--sample-tokens", t.sample_tokens),
                        ("--max-restarts", r.max_restarts)]:
        if value < 0:
            raise ConfigError(f"{name} must not be negative, got {value}")
    if not 0.0 < d.eval_fraction < 0.5:
        raise ConfigError(f"--eval-fraction must be in (0, 0.5), got {d.eval_fraction}")
    if t.peak_flops is not None and not t.peak_flops > 0:
        raise ConfigError(f"--peak-flops must be positive, got {t.peak_flops}")
    if t.seed < 0:
        raise ConfigError(f"--seed must not be negative, got {t.seed}")
    for name, value in [("--beta1", t.beta1), ("--beta2", t.beta2)]:
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value}")
    if not t.eps > 0:
        raise ConfigError(f"--eps must be positive, got {t.eps}")
    _check_optimizer(t)
    p = cfg.parallel
    for name, value in [("--dp", p.dp), ("--dp-shard", p.dp_shard)]:
        if value < 0:
            raise ConfigError(f"{name} must not be negative, got {value}")
    from paratrain.parallel.rules import Checkpointing, RecomputeError

    try:
        Checkpointing.parse(p.activation_checkpointing)
    except RecomputeError as e:
        raise ConfigError(str(e)) from None
    if p.bucket_mb <= 0:
        raise ConfigError(f"--bucket-mb must be positive, got {p.bucket_mb}")
    _check_lora(cfg)
    _check_reliability(cfg)
    _check_launch(cfg)


def _check_lora(cfg: Config) -> None:
    """The [lora] rules: its values (`paratrain.parallel.lora.LoRA` checks them) and the strategies it runs with."""
    lo, p = cfg.lora, cfg.parallel
    if lo.rank is None:
        given = [flag for flag, on in (("--base-dtype", lo.base_dtype), ("--lora-alpha", lo.alpha is not None),
                                       ("--lora-dropout", lo.dropout), ("--lora-targets", lo.targets)) if on]
        if given:
            raise ConfigError(f"{', '.join(given)} without --lora RANK: the base is frozen only under LoRA; pass "
                              f"--lora RANK or drop {', '.join(given)}")
        return
    from paratrain.parallel.lora import LoRAError
    from paratrain.parallel.rules import lora_refusal, unsupported_with_lora

    try:
        lora_options(cfg)
    except LoRAError as e:
        raise ConfigError(str(e).replace("the LoRA rank", "--lora").replace("the LoRA alpha", "--lora-alpha")
                          .replace("the LoRA dropout", "--lora-dropout")) from None
    unsupported = unsupported_with_lora(ep=p.ep, fp8=p.fp8)
    if unsupported:
        raise ConfigError(lora_refusal(unsupported))


def lora_options(cfg: Config):
    """The run's `paratrain.parallel.lora.LoRA` (None without --lora); LoRAError for a value it cannot take."""
    from paratrain.parallel.lora import LoRA

    lo = cfg.lora
    if lo.rank is None:
        return None
    targets = tuple(t.strip() for t in lo.targets.split(",") if t.strip()) or None
    return LoRA(lo.rank, lo.alpha, lo.dropout, targets, lo.base_dtype or None, seed=cfg.train.seed)


def resolve_recipe(cfg: Config) -> None:
    """Fill the [train] optimizer options left unset from the named model's recipe (`paratrain.models.RECIPES`), or
    with --init-from the fine-tuning recipe of a pretrained model (`paratrain.models.configs.FINE_TUNE`).

    A value from the TOML file or the command line wins; a peak learning rate given without
    --min-lr decays to the recipe's fraction of it. Every process resolves them alike, before
    validation, and the run's config.json records the values used.
    """
    from paratrain.models import Recipe, get_recipe
    from paratrain.models.configs import FINE_TUNE_WARMUP

    fine_tune = bool(cfg.model.init_from)
    t, recipe = cfg.train, get_recipe(cfg.model.name, fine_tune=fine_tune)
    if t.min_lr is None and t.lr is not None:
        t.min_lr = t.lr * (recipe.min_lr / recipe.lr)
    if fine_tune and t.warmup_steps is None:
        t.warmup_steps = round(FINE_TUNE_WARMUP * t.steps)
    for f in dataclasses.fields(Recipe):
        if f.name != "source" and getattr(t, f.name) is None:
            setattr(t, f.name, getattr(recipe, f.name))


def _check_reliability(cfg: Config) -> None:
    """The [checkpoint] and [reliability] rules (the resume path itself is checked by the trainer's preflight)."""
    c, r = cfg.checkpoint, cfg.reliability
    checkpoint_policy(c.every)
    for name, value in [("--load-step", c.load_step), ("--snapshot-every", c.snapshot_every),
                        ("--check-every", r.check_every)]:
        if value < 0:
            raise ConfigError(f"{name} must not be negative, got {value}")
    if c.keep_latest < 0 or c.keep_latest == 1:
        raise ConfigError(f"--keep-latest {c.keep_latest}: keep at least 2 checkpoints (a damaged newest one then "
                          f"has a fallback), or 0 to keep all")
    if not c.resume:
        raise ConfigError("--resume must be 'auto', 'none' or the path of a checkpoint directory")
    if c.load_step and c.resume != "auto":
        raise ConfigError(f"--load-step picks a checkpoint of the run in --out; it goes with --resume auto, "
                          f"not --resume {c.resume}")
    if r.straggler_steps < 1:
        raise ConfigError(f"--straggler-steps must be at least 1, got {r.straggler_steps}")
    if not r.straggler_threshold > 0:
        raise ConfigError(f"--straggler-threshold must be a positive fraction of the median (0.2: 20%), got "
                          f"{r.straggler_threshold}")
    if r.max_bad_steps < 1:
        raise ConfigError(f"--max-bad-steps must be at least 1, got {r.max_bad_steps}")
    _check_timeout("--pg-timeout", r.pg_timeout_s)
    if r.step_timeout_s:
        _check_timeout("--step-timeout", r.step_timeout_s, " (or 0: no watchdog)")


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a run saves, from --checkpoint-every: every `steps` steps, or every `seconds` of wall clock (at most
    one of them set), and at the last step; neither: never (only a SIGTERM's save)."""

    steps: int = 0
    seconds: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.steps or self.seconds)

    def __str__(self) -> str:
        if self.steps:
            return f"every {self.steps} steps"
        minutes = self.seconds / 60
        return f"every {minutes:g} min" if self.seconds >= 60 else f"every {self.seconds:g} s"


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|min|h)")
_SECONDS = {"s": 1, "m": 60, "min": 60, "h": 3600}


def checkpoint_policy(every: int | str) -> CheckpointPolicy:
    """--checkpoint-every's value as a policy: N steps, or a duration such as '30m' (ConfigError otherwise)."""
    text = str(every).strip().lower()
    if re.fullmatch(r"-?\d+", text):
        if int(text) < 0:
            raise ConfigError(f"--checkpoint-every must not be negative, got {text}")
        return CheckpointPolicy(steps=int(text))
    match = _DURATION.fullmatch(text)
    if match is None or not float(match.group(1)) > 0:
        raise ConfigError(f"--checkpoint-every {every!r}: give a number of steps (0: never) or a duration such as "
                          f"'30m', '90s' or '2h'")
    return CheckpointPolicy(seconds=float(match.group(1)) * _SECONDS[match.group(2)])


def _check_timeout(flag: str, seconds: float, alternative: str = "") -> None:
    # torch keeps a timeout as a C integer of milliseconds: a week is far below its limit and far above any wait.
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ConfigError(f"{flag} must be positive seconds up to {MAX_TIMEOUT_S:g} (a week){alternative}, "
                          f"got {seconds}")


def _check_launch(cfg: Config) -> None:
    """The [run] rules of the launcher: nodes and rendezvous."""
    r = cfg.run
    if r.nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1, got {r.nnodes}")
    if r.nnodes > 1 and not (r.rdzv_endpoint and r.rdzv_id):
        raise ConfigError(f"--nnodes {r.nnodes} needs --rdzv-endpoint HOST:PORT and --rdzv-id ID, the same on "
                          f"every node")
    if r.rdzv_endpoint and not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", r.rdzv_endpoint):
        raise ConfigError(f"--rdzv-endpoint {r.rdzv_endpoint!r} is not HOST:PORT")
    _check_timeout("--join-timeout", r.join_timeout_s)
    if not 3 <= r.node_timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"--node-timeout must be whole seconds from 3 (a heartbeat a second) up to "
                          f"{MAX_TIMEOUT_S:g}, got {r.node_timeout_s}")


def layout_spec(cfg: Config, world_size: int, model_cfg=None) -> LayoutSpec:
    """The layout of `cfg` on `world_size` ranks as the rules read it (`paratrain.parallel.rules.check_layout`
    decides it: the planner's rules too, so `train` refuses exactly the layouts `plan` calls infeasible,
    naming the nearest valid ones). ConfigError for a degree that describes no layout at all.

    The data-parallel degree is --dp, or what --tp × --pp leave of the world; the batch defaults
    are resolved for it (`resolve_batch`). Without the model (`model_cfg` None), the rules on its shape wait.
    """
    from paratrain.mesh import MeshShape

    p, t = cfg.parallel, cfg.train
    for name, value in [("--tp", p.tp), ("--pp", p.pp), ("--cp", p.cp), ("--virtual-stages", p.virtual_stages)]:
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    try:
        dp = MeshShape.for_world(world_size, dp=p.dp or None, tp=p.tp, pp=p.pp, cp=p.cp).dp
    except ParatrainError as e:  # the mesh's: a config error here, naming the options
        raise ConfigError(str(e)) from None
    defaulted = t.global_batch is None and t.micro_batch is None
    resolve_batch(cfg, dp)
    return LayoutSpec(
        dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, activation_checkpointing=p.activation_checkpointing,
        dp_shard=p.dp_shard, ep=p.ep, zero=p.zero, sequence_parallel=p.sequence_parallel,
        schedule=p.schedule, virtual_stages=p.virtual_stages, world_size=world_size, model=model_cfg,
        global_batch=t.global_batch, micro_batch=t.micro_batch, seq_len=cfg.data.seq_len, batch_defaulted=defaulted,
        precision=p.precision, fp8=p.fp8 or None, offload=p.offload or None, compile=p.compile)


def resolve_batch(cfg: Config, dp: int) -> None:
    """Fill the batch sizes left to their defaults for `dp` data ranks (every process resolves them alike).

    The global batch defaults to DEFAULT_GLOBAL_BATCH, rounded up to a multiple of micro-batch × data
    ranks so that it divides on any number of GPUs; the micro-batch to one per data rank.
    """
    t = cfg.train
    if t.global_batch is None:
        per_step = (t.micro_batch or 1) * dp
        t.global_batch = per_step * max(1, -(-DEFAULT_GLOBAL_BATCH // per_step))
    if t.micro_batch is None:
        t.micro_batch = max(1, t.global_batch // dp)
