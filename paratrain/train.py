"""The training loop: data -> forward -> loss -> backward -> reduce -> step, read top to bottom.

``train(config)`` is the whole program behind ``paratrain train``; a user can
call it from their own script. Every process of a job runs it: rank and world
size come from the launcher's environment (see ``paratrain.distributed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tqdm import tqdm

from paratrain.checkpoint.rundir import apply_claim, claim_run_dir, diagnostics_dir
from paratrain.checkpoint.trainer import TrainingCheckpoints, check_resume_option, explain_layout_error
from paratrain.config import Config, ConfigError, check_batch, data_ranks, validate
from paratrain.data import DataSampler, build_dataset, resolve_text_files
from paratrain.data.prepare import is_prepared_dir
from paratrain.distributed import DistEnv, default_device, detect_env, shutdown
from paratrain.faults import current_attempt
from paratrain.guard import StepGuard
from paratrain.metrics import MetricsLog, StepTimer, mfu, peak_memory_bytes, perplexity, unigram_entropy
from paratrain.mesh import Mesh, init_mesh
from paratrain.models import ModelConfig, Transformer, generate, get_model_config
from paratrain.parallel.api import ParallelModel, maybe_no_sync, parallelize
from paratrain.parallel.pipeline import PipelineModel

IGNORE_INDEX = -100


@dataclass
class RunResult:
    """What a finished run reports back to its caller."""

    out_dir: Path
    first_loss: float
    final_loss: float
    eval_loss: float
    unigram_entropy: float
    sample: str
    preempted: bool = False  # stopped by SIGTERM after saving a checkpoint; relaunch to continue


def train(cfg: Config) -> RunResult:
    """Train as configured; every process of the job calls this."""
    owns_group = not dist.is_initialized()
    env = detect_env()
    preflight(cfg, env.world_size)  # before any process group exists
    mesh = init_mesh(dp=cfg.parallel.dp or None, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                     timeout_s=cfg.reliability.pg_timeout_s)
    try:
        return _run(cfg, env, mesh, default_device(env))
    finally:
        if owns_group:
            shutdown()


def _run(cfg: Config, env: DistEnv, mesh: Mesh, device: torch.device) -> RunResult:
    t, p = cfg.train, cfg.parallel
    out = prepare_run_dir(cfg, env)
    train_set, eval_set, tokenizer = load_data(cfg, env, out)
    model_cfg = resolve_model_config(cfg, tokenizer.vocab_size)
    model, optimizer = build_parallel_model(model_cfg, cfg, mesh, device)
    dp, dp_rank = mesh.size("dp"), mesh.coord("dp")
    accumulation = check_batch(t.global_batch, t.micro_batch, dp)
    sampler = DataSampler(len(train_set), t.global_batch, dp_rank, dp, seed=t.seed)
    guard = StepGuard(cfg.reliability, model, optimizer, env.rank, diagnostics_dir(out))
    checkpoints = TrainingCheckpoints(cfg, env.rank, out, model, optimizer, sampler, guard,
                                      extra_state={"model_config": dataclasses.asdict(model_cfg)})
    resumed, tokens_seen = checkpoints.resume()  # model, optimizer, sampler, counters: all from the checkpoint
    entropy = unigram_entropy(train_set.stream.tokens, model_cfg.vocab_size)
    flops_per_token = model_cfg.flops_per_token(cfg.data.seq_len)
    log = MetricsLog(out / "metrics.jsonl") if env.is_main else None
    if env.is_main:
        print(f"paratrain: {cfg.model.name} ({model_cfg.num_params():,} parameters), "
              f"{env.world_size} process(es) on {device.type} (dp={dp}, tp={p.tp}{', sp' if p.sequence_parallel else ''}, "
              f"pp={p.pp}{f' {p.schedule}' if p.pp > 1 else ''}, "
              f"zero={p.zero}, {p.precision}), "
              f"{len(train_set):,} training sequences of {cfg.data.seq_len} tokens, "
              f"{accumulation} micro-batch(es) per step; unigram entropy of the data {entropy:.3f} nats",
              flush=True)

    bar = tqdm(total=t.steps, initial=resumed, desc="train", disable=not (env.is_main and cfg.run.progress),
               dynamic_ncols=True)
    first_loss = loss = eval_loss = float("nan")
    with guard.running(), checkpoints:  # a failed collective says which rank was where; saves are waited for
        last_save_s = 0.0
        for step in range(resumed + 1, t.steps + 1):
            guard.begin_step(step)
            start = time.perf_counter()
            model.comm.reset()
            timer = StepTimer(model.comm)
            lr = set_learning_rate(optimizer, step, cfg)
            with timer.phase("data"):
                ids = sampler.next_batch()
                batches = [train_set.get_batch(ids[i:i + t.micro_batch]) for i in range(0, len(ids), t.micro_batch)]
            loss, grad_norm, tokens = train_step(model, optimizer, batches, device, t.grad_clip, timer)
            elapsed = time.perf_counter() - start
            breakdown = timer.breakdown(elapsed)  # before evaluation's own communication
            first_loss = loss if step == resumed + 1 else first_loss
            tokens_seen += tokens
            peak = peak_memory_bytes(device)
            record = {
                "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "tokens_seen": tokens_seen, "step_time_s": elapsed, "tokens_per_s": tokens / elapsed,
                "mfu": mfu(flops_per_token, tokens / elapsed, t.peak_flops, env.world_size),
                "comm_bytes": model.comm.bytes_by_axis(),
                "peak_mem_bytes": peak, "peak_mem_bytes_per_rank": gather_per_rank(model.comm, peak, device),
                "skipped_steps": model.scaler.skipped_steps, "skipped_nonfinite": guard.bad_total,
            }
            if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                eval_loss = evaluate(model, eval_set, t.eval_batches * t.global_batch, t.micro_batch, dp_rank, dp, device)
                record.update(eval_loss=eval_loss, eval_ppl=perplexity(eval_loss))
                if env.is_main:
                    bar.write(f"step {step}: train loss {loss:.4f}, eval loss {eval_loss:.4f} "
                              f"(ppl {perplexity(eval_loss):.2f})")
            # The save that followed the previous step: a record is written before its own save.
            record["time_breakdown_s"] = {**breakdown, "checkpoint_s": last_save_s}
            if log:
                log.write(record)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", refresh=False)
            bar.update(1)
            guard.end_step(step)  # may stop the run: too many non-finite steps, diverged replicas
            with timer.phase("checkpoint"):
                checkpoints.after_step(step, tokens_seen, last=step == t.steps, stopping=guard.stopping)
            last_save_s = timer.seconds["checkpoint"]
            if guard.stopping:  # SIGTERM on some rank: checkpoint saved, leave now
                break
    bar.close()
    if guard.stopping:
        if log:
            log.close()
        return RunResult(out, first_loss, loss, eval_loss, entropy, "", preempted=True)

    weights = model.full_state_dict()  # collective under ZeRO-3: every rank takes part
    prompt, sample = sample_text(model, tokenizer, eval_set, t.sample_tokens, t.seed, device)
    if env.is_main:
        log.close()
        save_final(out, weights, model_cfg, tokenizer)
        if sample:
            print(f"--- prompt (held-out text) ---\n{prompt}\n--- the model's continuation ---\n{sample}\n---")
        print(f"train loss {first_loss:.3f} -> {loss:.3f}, eval loss {eval_loss:.3f} "
              f"(unigram entropy of the data: {entropy:.3f})\nrun written to {out}", flush=True)
    return RunResult(out, first_loss, loss, eval_loss, entropy, sample)


def build_parallel_model(model_cfg: ModelConfig, cfg: Config, mesh: Mesh, device: torch.device):
    """The reference model built on the meta device, materialized and wrapped for the mesh.

    parallelize() materializes only what the rank holds: its pipeline stages, its tensor-parallel
    slices, under ZeRO-3 its rows; each value is the slice of the same initialization
    (`weight_initializer`: seeded random, or the weights of --init-from).
    """
    p = cfg.parallel
    with torch.device("meta"):
        model = Transformer(model_cfg)
    return parallelize(model, mesh, optimizer=lambda params: make_optimizer(params, cfg), zero=p.zero,
                       precision=p.precision, reduce_dtype=p.reduce_dtype,
                       activation_checkpointing=p.activation_checkpointing, bucket_mb=p.bucket_mb,
                       grad_reduction="sum", sequence_parallel=p.sequence_parallel, schedule=p.schedule,
                       virtual_stages=p.virtual_stages, device=device,
                       init=weight_initializer(model, cfg))


def weight_initializer(model: Transformer, cfg: Config):
    """init(name, full_shape) -> full fp32 value: the weights of --init-from if given, else the seeded init."""
    if not cfg.model.init_from:
        return lambda name, shape: model.param_init(name, shape, cfg.train.seed)
    from paratrain.checkpoint.hf_dir import HFWeights

    weights = HFWeights(cfg.model.init_from)  # checked against the config in preflight; reads lazily
    return lambda name, shape: weights.read(name).float()


def train_step(model: ParallelModel, optimizer, batches, device, grad_clip: float,
               timer: StepTimer | None = None) -> tuple[float, float, int]:
    """One optimizer step over this rank's micro-batches; returns (loss, grad norm, global tokens).

    The loss is the mean over every target token of the global batch: each
    micro-batch contributes its token-loss *sum* divided by the token count of
    the whole step across all ranks, and the engine sums gradients over the
    data ranks, so accumulation and data parallelism give exactly the gradient
    of one process holding the whole batch, whatever the number of padded
    tokens in each micro-batch. Only the last micro-batch communicates.
    `timer` (optional) records the forward/backward and optimizer phases.
    """
    phase = timer.phase if timer else lambda name: contextlib.nullcontext()
    with phase("forward_backward"):
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
        global_tokens = int(model.comm_sum(torch.tensor(float(local_tokens), device=device)).item())
        if isinstance(model, PipelineModel):  # the schedule interleaves the micro-batches' passes
            loss_sum = model.train_step(batches, global_tokens)
        else:
            loss_sum = torch.zeros((), device=device)
            for i, (inputs, labels) in enumerate(batches):
                inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                with maybe_no_sync(model, enabled=i < len(batches) - 1):
                    token_losses = model.loss_fn(model(inputs), labels, ignore_index=IGNORE_INDEX)
                    model.scale_loss(token_losses / global_tokens).backward()
                loss_sum += token_losses.detach()
    with phase("optimizer"):
        grad_norm = model.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
        optimizer.step()  # skipped by every rank together if fp16 gradients overflowed
        optimizer.zero_grad(set_to_none=True)
        loss = model.comm_sum(loss_sum).item() / global_tokens
    return loss, grad_norm, global_tokens


@torch.no_grad()
def evaluate(model: ParallelModel, dataset, num_sequences: int, micro_batch: int, dp_rank: int, dp: int,
             device) -> float:
    """Mean token loss over the first `num_sequences` held-out sequences, split across data ranks.

    The sequences do not depend on the layout, so every layout reports the same eval loss.
    """
    model.eval()
    count = min(len(dataset), num_sequences)
    mine = list(range(dp_rank, count, dp))
    totals = torch.zeros(2, device=device)
    for i in range(0, len(mine), micro_batch):
        inputs, labels = dataset.get_batch(mine[i:i + micro_batch])
        labels = labels.to(device)
        if isinstance(model, PipelineModel):
            totals[0] += model.eval_loss_sum(inputs, labels, ignore_index=IGNORE_INDEX)
        else:
            totals[0] += model.loss_fn(model(inputs.to(device)), labels, ignore_index=IGNORE_INDEX)
        totals[1] += (labels != IGNORE_INDEX).sum()
    model.train()
    model.comm_sum(totals)
    return (totals[0] / totals[1]).item()


def load_data(cfg: Config, env: DistEnv, out: Path):
    """Train and held-out datasets and the tokenizer.

    A tokenizer trained here (bpe:N) is trained once, by rank 0, into the run's
    cache; the other ranks then memory-map what it wrote.
    """
    d = cfg.data
    spec = tokenizer_spec(cfg)
    cache = out / "data-cache" if spec.startswith("bpe:") else None
    progress = cfg.run.progress and env.is_main

    def build():
        return build_dataset(d.path, spec, d.seq_len, cache, eval_fraction=d.eval_fraction, progress=progress)

    if cache is None:
        return build()
    result = build() if env.is_main else None
    barrier()
    return result or build()


def preflight(cfg: Config, world_size: int) -> None:
    """Every check that needs neither a process group nor the data: run before launching processes."""
    try:
        validate(cfg, world_size)
        data_ranks(cfg, world_size, resolve_model_config(cfg, tokenizer_vocab=0))
    except ConfigError as e:  # after a relaunch on fewer processes: name the checkpoint's layout too
        raise explain_layout_error(cfg, e) from None
    check_resume_option(cfg)
    path = cfg.data.path
    if path != "default" and not is_prepared_dir(path):
        resolve_text_files(path)


def resolve_model_config(cfg: Config, tokenizer_vocab: int) -> ModelConfig:
    """The named model config with the user's overrides, or --init-from's; checks that the vocabulary fits."""
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items()
                 if k not in ("name", "init_from") and v is not None}
    if cfg.model.init_from:
        model_cfg = imported_model_config(cfg.model.init_from, overrides)
    else:
        model_cfg = dataclasses.replace(get_model_config(cfg.model.name), **overrides)
    if tokenizer_vocab > model_cfg.vocab_size:
        fix = ("a tokenizer that fits" if cfg.model.init_from
               else f"--vocab-size {tokenizer_vocab} or a smaller tokenizer")
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but model "
                          f"{cfg.model.init_from or cfg.model.name!r} only {model_cfg.vocab_size}; pass {fix}")
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.data.seq_len} exceeds the model's max_seq_len "
                          f"{model_cfg.max_seq_len}")
    return model_cfg


def imported_model_config(path: str, overrides: dict) -> ModelConfig:
    """The model of the Hugging Face directory `path` (--init-from), its weights checked against it.

    --model only names the run then; a size override must equal the imported value.
    """
    from paratrain.checkpoint.hf_dir import HFError, HFWeights

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
    """--tokenizer with 'auto' resolved: 'auto' for a prepared corpus (its own), else --init-from's, else 'byte'."""
    d, init_from = cfg.data, cfg.model.init_from
    if d.tokenizer != "auto":
        return d.tokenizer
    if d.path != "default" and is_prepared_dir(d.path):
        return "auto"
    if init_from and any((Path(init_from) / name).is_file() for name in ("tokenizer.json", "byte_tokenizer.json")):
        return init_from
    return "byte"


def build_model(model_cfg: ModelConfig, device: torch.device, seed: int) -> Transformer:
    """Construct without allocating (meta device), then materialize and initialize on `device`."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def make_optimizer(params, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (embeddings included), not on norm gains."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2))


def learning_rate(step: int, cfg: Config) -> float:
    """Linear warmup to lr over warmup_steps, then cosine decay to min_lr at the last step."""
    t = cfg.train
    if step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, step: int, cfg: Config) -> float:
    lr = learning_rate(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def default_run_dir(cfg: Config, environ=os.environ) -> str:
    """A fresh run directory name, the same on every rank of one job."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        if run_id == "none":
            raise ConfigError("--out is required when the launcher gives no run id (torchrun --rdzv-id)")
        return f"runs/{cfg.model.name}-{run_id}"
    return f"runs/{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(cfg: Config, env: DistEnv) -> Path:
    """Create the run directory and write config.json; never silently mix two runs (`paratrain.checkpoint.rundir`)."""
    if not cfg.run.out:
        cfg.run.out = default_run_dir(cfg)
    claim = claim_run_dir(cfg, restarted=current_attempt() > 0)  # a fresh run, or this run continued
    barrier()  # every rank has checked before rank 0 writes
    if env.is_main:
        apply_claim(claim, cfg)
    barrier()  # nobody writes into the run directory before rank 0 has cleared it
    return claim.path


def gather_per_rank(comm, value: int, device) -> list[int]:
    """One integer from every data rank, in rank order."""
    n = comm.mesh.size("dp")
    out = torch.zeros(n, dtype=torch.float64, device=device)
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    comm.all_gather(out, mine, "dp")
    return [int(v) for v in out.tolist()]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_final(out: Path, weights: dict[str, torch.Tensor], model_cfg: ModelConfig, tokenizer) -> Path:
    """Weights (safetensors), model config and tokenizer, written to a temporary name then renamed."""
    final, tmp = out / "final", out / "final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # A tied table is stored once, as tok_embeddings.weight (ZeRO-3 hands back both names).
    tensors = {name: w.detach().to("cpu", torch.float32).contiguous() for name, w in weights.items()
               if not (model_cfg.tie_embeddings and name == "output.weight")}
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "paratrain"})
    (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2) + "\n")
    tokenizer.save(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def sample_text(model, tokenizer, eval_set, num_tokens: int, seed: int, device) -> tuple[str, str]:
    """(prompt, continuation): the model continues the start of the held-out text."""
    if num_tokens == 0:
        return "", ""
    prompt = eval_set.get_batch([0])[0][:, :64].to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = generate(model.causal_logits, prompt, num_tokens, temperature=0.8, top_k=40,
                      generator=generator, max_context=model.module.config.max_seq_len)
    return tokenizer.decode(prompt[0].tolist()), tokenizer.decode(tokens[0, prompt.shape[1]:].tolist())
