"""Building a training run from its config: everything the loop needs, in the order it has to be made.

    plan = preflight(cfg, world_size)  # checks that need no process group (before any launch): a RunPlan
    run = build(plan, env, mesh)  # run directory, data, model, optimizer, sampler, guard, checkpoints

The preflight resolves the run once (its options' defaults, the run directory, the resume, the
layout, the model) into a frozen `RunPlan`, which every later stage reads; the config it was given
is never changed.

The order matters and is written once, here: the run directory is claimed before anything is
written into it; the data comes before the model (the tokenizer's vocabulary must fit); the
model and optimizer before the checkpoints that resume them; the resume before the metrics log
(it cuts the log back to the resumed step).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.snapshot import parse_buddies
from paratrain.comm import Comm
from paratrain.compat import fused_optimizer_devices
from paratrain.config import Config, ConfigError, DataSection, TrainSection, check_values, layout_spec, lora_options
from paratrain.data import DataSampler
from paratrain.data.chat import ChatOptions
from paratrain.data.mixture import TrainingData, load_training_data, parse_mixture
from paratrain.data.prepare import is_prepared_dir, source_format
from paratrain.distributed import DistEnv
from paratrain.errors import ParatrainError
from paratrain.faults import current_attempt
from paratrain.hardware import device_peak_flops, slow_bf16_matmuls
from paratrain.peak_memory import ProcessPeak
from paratrain.mesh import Mesh
from paratrain.metrics import MetricsLog, StragglerWatch, unigram_entropy
from paratrain.models import ModelConfig, Transformer, get_model_config
from paratrain.parallel.contract import TrainableModel
from paratrain.parallel.api import DataParallel, PipelineParallel, TensorParallel, parallelize_run
from paratrain.parallel.data.engine import GradReduction
from paratrain.parallel import rules
from paratrain.parallel.loss import head_name
from paratrain.parallel.rules import CheckedLayout
from paratrain.models.hf import HFCausalLM, HFModelConfig, is_model_dir
from paratrain.checkpoint.store import read_index
from paratrain.run.checkpoints import (
    LORA_BASE_KEY, TrainingCheckpoints, check_resume_option, check_resumed_schedule, explain_layout_error, resolve_resume,
)
from paratrain.run.carried import (MODEL_CONFIG_KEY, carried_model_config, carried_tokenizer, model_difference,
                                   model_directory, resumed_checkpoint, run_assets)
from paratrain.run.guard import StepGuard
from paratrain.run.hf_backend import (check_layout, initializer as hf_initializer, meta_model, reference_dir_config,
                                      run_name, transformers_dir, transformers_model_config)
from paratrain.run.inputs import check_paths, tokenizer_vocab
from paratrain.run.memory_budget import check_free_memory, check_memory_budget
from paratrain.run.profiling import MemorySnapshots, profile_steps
from paratrain.run.samples import SampleRecorder
from paratrain.run.rundir import METRICS_FILE, apply_claim, claim_run_dir, diagnostics_dir, read_run_id
from paratrain.trackers import check_clients, open_trackers, tracker_names


@dataclass
class Run:
    """One process's share of a training run, built and resumed, ready for the loop; each thing held once (what the
    preflight resolved is the plan's, the data sets and the tokenizer are the data's)."""

    plan: RunPlan  # the options, the layout and the model config, as the preflight resolved them
    env: DistEnv
    mesh: Mesh
    # The training set, every held-out set by name, a mixture's sources, the tokenizer
    # (`paratrain.data.mixture.TrainingData`).
    data: TrainingData
    model_cfg: ModelConfig  # the plan's, the documents ending at the tokenizer's end-of-text where they are masked
    model: TrainableModel
    optimizer: torch.optim.Optimizer
    sampler: DataSampler  # or a SampleRecorder around it (--log-samples)
    guard: StepGuard
    checkpoints: TrainingCheckpoints
    log: MetricsLog | None  # rank 0 only
    resumed_step: int  # the loop starts after it
    tokens_seen: int
    peak_flops: float | None  # of one device, for MFU: --peak-flops, else the device's (paratrain.hardware)
    # The run's communication layer, which the model communicates through: its byte counts and blocked seconds
    # are the metrics', its listeners the guard's. The run owns it (the model hands out none of its internals).
    comm: Comm
    # --memory-snapshot: CUDA's allocator history from before the model is built (`paratrain.run.profiling`).
    snapshots: MemorySnapshots
    # Each rank's compute time against the median, step by step (--straggler-threshold, --straggler-steps).
    stragglers: StragglerWatch
    # The process's memory peak, window by window: one per step (read at the step's agreement), the
    # first from process start (the build), the last to the end of the run (the sample and weights).
    memory: ProcessPeak = None

    def __post_init__(self):
        self.memory = self.memory or ProcessPeak(self.mesh.device)

    @property
    def cfg(self) -> Config:
        return self.plan.cfg

    @property
    def out(self) -> Path:
        return Path(self.plan.out)

    @property
    def train_set(self):
        return self.data.train

    @property
    def eval_set(self):
        """The first held-out set (--eval-data's first, else the held-out tail of the training data)."""
        return next(iter(self.data.held_out.values()))

    @property
    def tokenizer(self):
        return self.data.tokenizer

    @property
    def accumulation(self) -> int:
        """Micro-batches per data rank per step."""
        return self.plan.layout.accumulation

    @property
    def device(self) -> torch.device:
        return self.mesh.device


@dataclass(frozen=True)
class RunPlan:
    """A run as the preflight resolved it, once, before any process group: every later stage reads it.

    cfg: the options the run uses, every default resolved (the recipe's optimizer values, the batch for the
        layout's data ranks, --resume's step directory, the run directory): a copy of the given config, which
        stays as it was, and never changed after (config.json records it).
    layout: the layout's verdict, its rules decided with the model and the batch
        (`paratrain.parallel.rules.check_layout`), which `parallelize` takes as it is.
    model_cfg: the model, resolved once (a resumed checkpoint's, --init-from's, a directory's or the named config
        with the user's sizes); the tokenizer's vocabulary and the sequence length checked against it.
    """

    cfg: Config
    layout: CheckedLayout
    model_cfg: ModelConfig

    @property
    def out(self) -> str:
        """The run directory; '' when the ranks agree on one once their job's store exists (`with_out`)."""
        return self.cfg.run.out

    @property
    def resume(self) -> str:
        """What the run resumes: a checkpoint's step directory, or 'auto' (the run's own newest) or 'none'."""
        return self.cfg.checkpoint.resume

    def with_out(self, out: str) -> RunPlan:
        """The plan with the run directory the ranks agreed on (`shared_run_dir`)."""
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, run=dataclasses.replace(self.cfg.run,
                                                                                                   out=out)))


def preflight(cfg: Config, world_size: int) -> RunPlan:
    """Every check that needs neither a process group nor the tokenized data: run before launching processes.

    Returns the run's plan (`RunPlan`): the layout, its rules decided once here (with the model and the batch),
    which `build` hands on to `parallelize`; the model config; the options with their defaults resolved, among
    them the one every process must share, the run directory, when it can without the others: one process, or a
    launcher that gave the job a run id (else `shared_run_dir`). `cfg` itself is left as it was.
    """
    # a run directory, checkpoints/, latest: the step directory it means (and its --out), in a copy of the options
    cfg, note = resolve_resume(copy.deepcopy(cfg))
    if note:
        print(f"paratrain: {note}", flush=True)
    if not cfg.run.out:
        cfg.run = dataclasses.replace(cfg.run, out=default_run_dir(cfg))
    try:
        check_values(cfg)  # fills the recipe's values into the copy; `layout_spec` the batch for its data ranks
        model_cfg = resolve_model_config(cfg, tokenizer_vocab=0)
        spec = dataclasses.replace(layout_spec(cfg, world_size, model_cfg),
                                   chunked_document_mask=chunked_document_mask(cfg))
        layout = rules.check_layout(spec, ConfigError)
    except ParatrainError as e:  # after a relaunch on fewer processes: name the checkpoint's layout too
        raise explain_layout_error(cfg, e) from None
    check_resume_option(cfg)
    parse_buddies(cfg.checkpoint.snapshot_buddy, world_size)  # --snapshot-buddy pairs this job's ranks
    check_resumed_model(cfg, model_cfg)
    check_lora_targets(cfg, model_cfg)
    check_paths(cfg, tokenizer_spec(cfg))  # --out, --data, --tokenizer: each what the run needs of it
    check_vocab(cfg, model_cfg, tokenizer_vocab(cfg.data.path, tokenizer_spec(cfg)))  # the tokenizer fits the model
    if cfg.run.out:  # whether this launch may use --out, decided from the directory alone, before anything is written
        claim_run_dir(cfg, restarted=current_attempt() > 0)  # (every rank passes here before rank 0 writes)
    check_resumed_schedule(cfg)  # after the claim: another run's --out is refused first
    check_memory_budget(cfg, model_cfg, layout.dp)  # the planner's estimate against the memory of one process
    check_clients(tracker_names(cfg))  # a tracker whose client is missing refuses the run now, not after the build
    profile_steps(cfg)
    return RunPlan(cfg, layout, model_cfg)


def build(plan: RunPlan, env: DistEnv, mesh: Mesh) -> Run:
    """Claim the run directory, load the data, build the model and resume; collective (every rank calls it).

    Everything is read from the preflight's `plan`: its options, its verdict on the layout (which `parallelize`
    takes as it is) and its model config.
    """
    cfg, t = plan.cfg, plan.cfg.train
    # The plan against what the GPUs have free now that the context exists, before anything is written.
    check_free_memory(cfg, plan.model_cfg, mesh)
    out = prepare_run_dir(cfg, env)
    snapshots = MemorySnapshots(cfg.logging.memory_snapshot, out, env.rank, mesh.device, say_once=env.is_main)
    data = load_data(cfg, env, out)
    check_vocab(cfg, plan.model_cfg, data.tokenizer.vocab_size)
    model_cfg = plan.model_cfg
    if document_mask(cfg.data, data.chat):  # the documents end at the tokenizer's end-of-text (`paratrain.models.llama`)
        model_cfg = dataclasses.replace(model_cfg, document_eos=data.tokenizer.eos_id)
    comm = Comm(mesh)
    model, optimizer = build_parallel_model(model_cfg, cfg, mesh, plan.layout, comm)
    sampler = data.sampler(t.global_batch, mesh.coord("dp"), mesh.size("dp"), seed=t.seed)
    guard = StepGuard(cfg.reliability, model, comm, env.rank, diagnostics_dir(out))
    extra_state = {MODEL_CONFIG_KEY: dataclasses.asdict(model_cfg)}
    if cfg.lora.rank is not None:  # a checkpoint of adapters names the base they were trained on
        from paratrain.parallel.lora import base_fingerprint

        extra_state[LORA_BASE_KEY] = base_fingerprint(model)
    checkpoints = TrainingCheckpoints(cfg, env.rank, out, model, optimizer, sampler, guard, extra_state=extra_state,
                                      assets=run_assets(cfg, data.tokenizer) if env.is_main else None,
                                      local_world_size=env.local_world_size)
    resumed, tokens_seen = checkpoints.resume()  # model, optimizer, sampler, counters: all from the checkpoint
    if cfg.run.log_samples:  # the loop's sampler writes down each step's sample ids (`paratrain.run.samples`)
        sampler = SampleRecorder(sampler, out, env.rank, resumed)
    log = MetricsLog(out / METRICS_FILE, open_trackers(tracker_names(cfg), out, read_run_id(out), cfg.to_dict(),
                                                       purge_step=resumed + 1 if resumed else None)) \
        if env.is_main else None
    hosts = checkpoints.coordinator.broadcast_object(checkpoints.coordinator.gather_objects(socket.gethostname()))
    stragglers = StragglerWatch(cfg.reliability.straggler_threshold, cfg.reliability.straggler_steps, hosts)
    run = Run(plan, env, mesh, data, model_cfg, model, optimizer, sampler, guard, checkpoints, log, resumed,
              tokens_seen, t.peak_flops or device_peak_flops(mesh.device), comm, snapshots, stragglers)
    if env.is_main:
        print(describe(run), flush=True)
    return run


def chunked_document_mask(cfg: Config) -> bool:
    """Whether, under --cp, the documents would be masked by transformers' model, which masks the chunks a rank holds
    (the layout rule `paratrain.parallel.rules.document_mask_violations` refuses it): --document-mask given, or on by
    default for chat data (`document_mask`)."""
    if cfg.parallel.cp == 1 or cfg.data.document_mask is False or transformers_dir(cfg) is None:
        return False
    paths = [s.path for s in parse_mixture(cfg.data.path) or ()] or [cfg.data.path]
    return bool(cfg.data.document_mask) or any(source_format(p, chat_options(cfg.data)) == "chat" for p in paths)


def document_mask(d: DataSection, chat: bool) -> bool:
    """--document-mask as given, else on for chat data (a conversation sees only itself, as alone) and off for
    text. (Under --pp every stage masks, and under --cp every rank: each holds the whole micro-batch's token ids.)"""
    if d.document_mask is not None:
        return d.document_mask
    return chat


def describe(run: Run) -> str:
    """The one line a run starts with: model, processes, layout, data."""
    cfg, p, mesh = run.cfg, run.cfg.parallel, run.mesh
    entropy = unigram_entropy(run.train_set.stream.tokens, run.model_cfg.vocab_size)
    return (f"paratrain: {model_name(cfg, run.model_cfg)} ({run.model_cfg.num_params():,} parameters), "
            f"{run.env.world_size} process(es) on {run.device.type} (dp={mesh.size('dp')}, "
            f"tp={p.tp}{', sp' if p.sequence_parallel else ''}{f', cp={p.cp}' if p.cp > 1 else ''}{f', ep={p.ep}' if p.ep > 1 else ''}, pp={p.pp}{f' {p.schedule}' if p.pp > 1 else ''}, "
            f"zero={p.zero}, {p.precision}), {len(run.train_set):,} training sequences of {cfg.data.seq_len} "
            f"tokens, {run.accumulation} micro-batch(es) per step; {run.data.describe(cfg.data.loss_on)}"
            f"{'; document mask on' if run.model_cfg.document_eos is not None else ''}; unigram entropy of the "
            f"data {entropy:.3f} nats"
            + f"; {describe_recipe(cfg)}"
            + (f"; checkpoints {run.checkpoints.policy} and at the end" if run.checkpoints.policy.enabled else
               "; checkpoints off (--checkpoint-every 0): only a SIGTERM saves one, a crash loses the run")
            + (f"; {len(run.model.fp8_linears)} linears compute in FP8 ({p.fp8})" if p.fp8 else "")
            + (f"; LoRA rank {cfg.lora.rank} on {len(run.model.lora_targets)} linears "
               f"({sum(m.numel() for m in run.model.masters()):,} parameters train), the rest frozen"
               f"{', base in NF4' if cfg.lora.base_dtype == 'nf4' else ''}" if cfg.lora.rank else "")
            + ("; this CPU has no bf16 matrix instructions (AVX512-BF16, AMX): its bf16 matmuls run about 20x slower "
               "than fp32's (--precision fp32 trains faster here)"
               if p.precision == "bf16" and slow_bf16_matmuls(run.device) else "")
            + (f"; {'parameters and ' if p.offload == 'params' else ''}optimizer offloaded to host memory "
               f"({run.model.offload.host_bytes() / 1e9:.3g} GB per process before the optimizer's state)"
               if p.offload else ""))


def model_name(cfg: Config, model_cfg: ModelConfig) -> str:
    """What the model is: the named config, or --init-from's architecture and size (never the config --model
    defaulted to, which only names the run then)."""
    if not cfg.model.init_from:
        return cfg.model.name
    directory = model_directory(cfg)  # a resumed checkpoint's copy of config.json, else --init-from's
    try:  # config.json was read and checked in preflight (`imported_model_config`): here only its name
        doc = json.loads((directory / "config.json").read_text()) if directory is not None else {}
    except (OSError, ValueError):
        doc = {}
    architecture = (doc.get("architectures") or [None])[0] or doc.get("model_type") or "model"
    n = model_cfg.num_params()
    size = next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
                if n >= scale or scale == 1)
    return f"{architecture} {size} from {cfg.model.init_from}"


def describe_recipe(cfg: Config) -> str:
    """The optimizer and schedule the run uses and where each value came from: the recipe (named with its source)
    or the user (a value other than the recipe's)."""
    from paratrain.models import get_recipe
    from paratrain.models.configs import FINE_TUNE_WARMUP

    t, fine_tune = cfg.train, bool(cfg.model.init_from)
    recipe = get_recipe(cfg.model.name, fine_tune=fine_tune)
    ours = {"lr": recipe.lr, "min_lr": t.lr * recipe.min_lr / recipe.lr, "weight_decay": recipe.weight_decay,
            "warmup_steps": round(FINE_TUNE_WARMUP * t.steps) if fine_tune else recipe.warmup_steps}
    values = {"lr": f"lr {t.lr:.3g}", "warmup_steps": f"warm-up {t.warmup_steps} steps",
              "min_lr": f"cosine to {t.min_lr:.3g}", "weight_decay": f"weight decay {t.weight_decay:g}"}
    given = [key for key in values if not math.isclose(getattr(t, key), ours[key], rel_tol=1e-9)]
    whose = f"{'fine-tuning' if fine_tune else cfg.model.name} recipe: {recipe.source}"
    return (f"{', '.join(values.values())} (" + (f"{', '.join('--' + k.replace('_', '-') for k in given)} given, "
                                                 f"the rest from the " if given else "from the ") + f"{whose})")


def build_parallel_model(model_cfg: ModelConfig, cfg: Config, mesh: Mesh, layout: CheckedLayout | None = None,
                         comm: Comm | None = None):
    """The reference model built on the meta device, materialized and wrapped for the mesh.

    parallelize() materializes only what the rank holds: its pipeline stages, its tensor-parallel
    slices, under ZeRO-3 its rows; each value is the slice of the same initialization
    (`weight_initializer`: seeded random, or the weights of --init-from). `layout`: the preflight's
    verdict on the layout (None: parallelize decides the rules its mesh and options tell). `comm`: the
    run's communication layer (None: the model makes its own).
    """
    p = cfg.parallel
    model = meta_model(model_cfg, p)  # the reference Transformer, or transformers' model of a directory
    # The trainer knows its model: it names the plan, so that no strategy has to.
    plan = model.tensor_parallel_plan(p.sequence_parallel) if p.tp > 1 else None
    return parallelize_run(model, mesh, optimizer=optimizer_factory(cfg.train),
                           # The trainer's loss is already normalized by the global token count.
                           data=DataParallel(zero=p.zero, bucket_mb=p.bucket_mb, grad_reduction=GradReduction.SUM,
                                             offload=p.offload or None),
                           tensor=TensorParallel(plan=plan, sequence_parallel=p.sequence_parallel),
                           pipeline=PipelineParallel(schedule=p.schedule, virtual_stages=p.virtual_stages),
                           precision=p.precision, reduce_dtype=p.reduce_dtype,
                           activation_checkpointing=p.activation_checkpointing, compile=p.compile,
                           init=weight_initializer(model, cfg), checked=layout, comm=comm, fp8=p.fp8 or None,
                           fp8_min_features=None if p.fp8_min_features < 0 else p.fp8_min_features,
                           loss_chunk=trainer_loss_chunk(model, p.loss_chunk), lora=lora_options(cfg))


def check_lora_targets(cfg: Config, model_cfg: ModelConfig) -> None:
    """--lora-targets against the model built on the meta device (no memory), before any process starts: a pattern
    that matches no linear, or an NF4 base of a weight that is not whole blocks (or that tp splits across blocks),
    refused in one line."""
    lora = lora_options(cfg)
    if lora is None:
        return
    from paratrain.parallel.lora import LoRAError, target_names
    from paratrain.parallel.nf4 import NF4Error, check_encodable
    from paratrain.parallel.tensor.collectives import TensorParallelError
    from paratrain.parallel.tensor.plan import PlannedModel, check_nf4_bases

    model = meta_model(model_cfg)
    try:
        names = target_names(model, lora.targets)
        if lora.base_dtype == "nf4":
            for name in names:
                check_encodable(model.get_submodule(name).weight.shape, torch.bfloat16)
            if cfg.parallel.tp > 1 and isinstance(model, PlannedModel):  # split on whole blocks
                plan = model.tensor_parallel_plan(cfg.parallel.sequence_parallel)
                check_nf4_bases(model, plan, cfg.parallel.tp, names)
    except (LoRAError, NF4Error, TensorParallelError) as e:
        raise ConfigError(f"--lora-targets: {e}" if lora.targets and isinstance(e, LoRAError) else str(e)) from None


def trainer_loss_chunk(model: nn.Module, loss_chunk: int) -> int:
    """The trainer's --loss-chunk for `model`: the default fuses the loss into the head where the model allows
    (a head transformers scales or soft-caps after it, as Gemma 2's, keeps the whole logits, said once); another
    value is the user's, refused in one line by `parallelize` where it cannot be honoured."""
    if loss_chunk != rules.DEFAULT_LOSS_CHUNK:
        return loss_chunk
    name, why = head_name(model)
    if name is None:
        print(f"paratrain: the loss takes the whole logits: {why}", file=sys.stderr, flush=True)
        return 0
    return loss_chunk


def weight_initializer(model: Transformer, cfg: Config):
    """init(name, full_shape) -> full fp32 value: the weights of --init-from if given, else the seeded init.

    Resuming an explicit checkpoint, which holds every weight (all but a LoRA run's frozen base, read as above),
    nothing is read or drawn: zeros, each replaced by the checkpoint's value before the first step (the resume
    loads every master or fails)."""
    if resumed_checkpoint(cfg) is not None and cfg.lora.rank is None:
        return lambda name, shape: torch.zeros(shape)
    if isinstance(model, HFCausalLM):
        return hf_initializer(model, cfg)
    if not cfg.model.init_from:
        return lambda name, shape: model.param_init(name, shape, cfg.train.seed)
    from paratrain.interop.hf import HFWeights

    weights = HFWeights(cfg.model.init_from)  # checked against the config in preflight; reads lazily
    return lambda name, shape: weights.read(name).float()


def optimizer_factory(t: TrainSection):
    """What parallelize builds the optimizer from: `make_optimizer` (AdamW), or with --optimizer muon the Muon recipe
    (`paratrain.parallel.muon.MuonRecipe`: Muon for the blocks' matrices, this AdamW for the rest). The schedule sets
    every group's learning rate to the AdamW one times the group's `lr_scale` (Muon's: --muon-lr / --lr)."""
    if t.optimizer != "muon":
        return lambda params: make_optimizer(params, t)
    from paratrain.config import muon_options
    from paratrain.parallel.muon import MuonRecipe

    muon = muon_options(t)
    adamw = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps, "weight_decay": t.weight_decay}
    return MuonRecipe(muon=muon, adamw=adamw, lr_scale=muon["lr"] / t.lr if t.lr else 1.0)


def make_optimizer(params, t: TrainSection) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (embeddings included), not on norm gains."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # One fused kernel for the whole step where torch has one for the device: CUDA, and the CPU too (there
    # 17 ms for 27M parameters on one thread, against 77 for the default loop and 105 for foreach). Elsewhere
    # torch's default.
    fused = bool(params) and all(p.device.type in fused_optimizer_devices() for p in params) or None
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused)


# -- the run directory --------------------------------------------------------------------------------

# The run directory's key in the job's store; torch's own keys are apart (its group's under "default_pg/").
RUN_DIR_KEY = "paratrain/run_dir"


def default_run_dir(cfg: Config, environ=os.environ) -> str:
    """A fresh run directory name, the same on every rank of one job; '' when the ranks must agree on one.

    Under torchrun with a run id (`--rdzv-id`, `--standalone`) the id names it; with none (plain
    `torchrun --nproc-per-node N`, srun) the ranks agree on one through the job's store (`shared_run_dir`).
    """
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        return f"runs/{run_name(cfg)}-{run_id}" if run_id != "none" else ""
    return f"runs/{run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"


def shared_run_dir(cfg: Config, store) -> str:
    """A fresh run directory name, the same on every rank: the first proposal to reach the job's key-value store.

    No collective: it runs before the process group exists (`paratrain.distributed.launcher_store`), so that
    NCCL's flight recorder can be told to dump into the run. A store that outlives a restart (torchrun's
    agent's) keeps the first attempt's name, and the restarted job continues that run.
    """
    proposal = f"runs/{run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"
    return store.compare_set(RUN_DIR_KEY, "", proposal).decode()


def prepare_run_dir(cfg: Config, env: DistEnv) -> Path:
    """Create the run directory and write config.json; never silently mix two runs (`paratrain.run.rundir`)."""
    claim = claim_run_dir(cfg, restarted=current_attempt() > 0)  # a fresh run, or this run continued
    barrier()  # every rank has checked before rank 0 writes
    if env.is_main:
        apply_claim(claim, cfg)
    barrier()  # nobody writes into the run directory before rank 0 has cleared it
    return claim.path


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# -- data and model config ------------------------------------------------------------------------------

def load_data(cfg: Config, env: DistEnv, out: Path) -> TrainingData:
    """Train and held-out datasets (of a mixture's every source, and --eval-data's) and the tokenizer.

    A tokenizer trained here (bpe:N) is trained once, by rank 0, into the run's
    cache; the other ranks then memory-map what it wrote.
    """
    d = cfg.data
    spec = tokenizer_spec(cfg)
    cache = out / "data-cache" if spec.startswith("bpe:") else None
    progress = cfg.run.progress and env.is_main

    def load():
        return load_training_data(d.path, d.eval_data, spec, d.seq_len, cache, eval_fraction=d.eval_fraction,
                                  progress=progress, text_key=d.text_key, chat=chat_options(d))

    if cache is None:
        return load()
    result = load() if env.is_main else None
    barrier()
    return result or load()


def chat_options(d: DataSection) -> ChatOptions:
    """How the run reads chat data (`paratrain.data.chat`): --format, --chat-template, --loss-on, --long."""
    return ChatOptions(format=d.format, chat_template=d.chat_template, loss_on=d.loss_on, long=d.long)


def resolve_model_config(cfg: Config, tokenizer_vocab: int) -> ModelConfig:
    """The model a resumed checkpoint carries (`paratrain.run.carried`), else the named model config with the user's
    overrides, or --init-from's; checks that the vocabulary fits."""
    model_cfg = carried_model_config(cfg)  # the size options are checked against it in `check_resumed_model`
    if isinstance(model_cfg, HFModelConfig):
        check_layout(cfg, model_cfg, "--resume")
    elif model_cfg is None:
        model_cfg = source_model_config(cfg, model_overrides(cfg))
    check_vocab(cfg, model_cfg, tokenizer_vocab)
    return model_cfg


def check_vocab(cfg: Config, model_cfg: ModelConfig, tokenizer_vocab: int) -> None:
    """ConfigError unless the tokenizer's vocabulary (0: not known yet) and --seq-len fit the model."""
    if tokenizer_vocab > model_cfg.vocab_size:
        fix = ("a tokenizer that fits" if cfg.model.init_from
               else f"--vocab-size {tokenizer_vocab} or a smaller tokenizer")
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but model "
                          f"{cfg.model.init_from or cfg.model.name!r} only {model_cfg.vocab_size}; pass {fix}")
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.data.seq_len} exceeds the model's max_seq_len "
                          f"{model_cfg.max_seq_len}")


def model_overrides(cfg: Config) -> dict:
    """The model options the user set (sizes of a named config): field -> value."""
    return {k: v for k, v in dataclasses.asdict(cfg.model).items()
            if k not in ("name", "init_from", "backend") and v is not None}


def source_model_config(cfg: Config, overrides: dict) -> ModelConfig:
    """The model config of the run's own options: --init-from's directory, --model's (directory or named config)."""
    source = transformers_dir(cfg)
    if source is not None:
        return transformers_model_config(cfg, source, overrides)
    if is_model_dir(cfg.model.name) and not cfg.model.init_from:
        return dataclasses.replace(reference_dir_config(cfg.model.name), **overrides)
    if cfg.model.init_from:
        return imported_model_config(cfg.model.init_from, overrides)
    return dataclasses.replace(get_model_config(cfg.model.name), **overrides)


def check_resumed_model(cfg: Config, model_cfg) -> None:
    """Preflight of a resume, against the model the checkpoint carries: a size option must equal its value; an
    --init-from that is not the directory the checkpoint's run started from must hold that model (read once, here;
    the run then reads nothing of it); a LoRA run's frozen base, which its checkpoints do not hold, must still be in
    --init-from's directory."""
    checkpoint = resumed_checkpoint(cfg)
    if checkpoint is None or carried_model_config(cfg) is None:
        return
    for key, value in model_overrides(cfg).items():
        if getattr(model_cfg, key, None) != value:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} {value} disagrees with the model {checkpoint.name} was saved with "
                              f"({key}={getattr(model_cfg, key, None)}); drop {flag}: the checkpoint sets the shape")
    if not cfg.model.init_from:
        return
    if cfg.lora.rank is not None and not Path(cfg.model.init_from).is_dir():
        raise ConfigError(f"--init-from {cfg.model.init_from} does not exist: a LoRA checkpoint ({checkpoint.name}) "
                          f"holds the adapters, not the frozen base, which is read from there; pass --init-from with "
                          f"the base model's directory")
    saved = (read_index(checkpoint).shared_state.get("config") or {}).get("model", {})
    if saved.get("init_from") == cfg.model.init_from:
        return
    difference = model_difference(model_cfg, source_model_config(cfg, model_overrides(cfg)))
    if difference:
        raise ConfigError(f"--init-from {cfg.model.init_from} is not the model {checkpoint.name} was saved with "
                          f"({difference}); drop --init-from: the checkpoint carries its model and tokenizer")


def imported_model_config(path: str, overrides: dict) -> ModelConfig:
    """The model of the Hugging Face directory `path` (--init-from), its weights checked against it.

    --model only names the run then; a size override must equal the imported value.
    """
    from paratrain.interop.hf import HFError, HFWeights

    try:
        model_cfg = HFWeights(path).config  # reads config.json and the weight files' headers only
    except HFError as e:
        raise ConfigError(f"--init-from: {e}") from None
    for key, value in overrides.items():
        if getattr(model_cfg, key) != value:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} {value} disagrees with --init-from {path} ({key}={getattr(model_cfg, key)}); "
                              f"drop {flag}: the imported model sets the shape")
    return model_cfg


def tokenizer_spec(cfg: Config) -> str:
    """--tokenizer with 'auto' resolved: 'auto' for a prepared corpus (its own), else --init-from's, else 'byte'.
    Resuming raw text, a tokenizer read from files (--tokenizer PATH, the directory's) is the checkpoint's copy."""
    d, init_from = cfg.data, cfg.model.init_from
    if d.tokenizer == "byte" or d.tokenizer.startswith("bpe:"):
        return d.tokenizer
    paths = [s.path for s in parse_mixture(d.path) or ()] or [d.path]
    prepared = [d.path != "default" and is_prepared_dir(p) for p in paths]
    if d.tokenizer == "auto" and all(prepared):
        return "auto"
    # What the run loaded, saved whole: the same tokenizer (the byte one, if it was). A prepared source holds its
    # own, which the run's must stay the file it was prepared with.
    carried = carried_tokenizer(cfg) if not any(prepared) else None
    if carried is not None:
        return carried
    if d.tokenizer != "auto":
        return d.tokenizer
    source = init_from or (cfg.model.name if is_model_dir(cfg.model.name) else None)  # --model DIR: its tokenizer
    if source and any((Path(source) / name).is_file() for name in ("tokenizer.json", "byte_tokenizer.json")):
        return source
    return "byte"
