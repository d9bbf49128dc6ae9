"""The training loop: data -> forward -> loss -> backward -> reduce -> agree -> clip -> step, read top to bottom.

``train(config)`` is the whole program behind ``paratrain train``; a user can call it from
their own script. Every process of a job runs it: rank and world size come from the
launcher's environment (see ``paratrain.distributed``). `paratrain.run.build` makes
everything the loop uses; `train_step` is one optimizer step, every stage of it in the open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from tqdm import tqdm

from paratrain.checkpoint.files import write_safetensors
from paratrain.config import Config
from paratrain.compat import default_store
from paratrain.distributed import detect_env, launcher_store, shutdown
from paratrain.faults import fault_requested, faulty, maybe_fault
from paratrain.mesh import PER_DATA_RANK, WORLD, init_mesh
from paratrain.metrics import (
    LaunchTimes, StepTimer, expert_load, mfu, moe_counts, moe_layers, perplexity, unigram_entropy,
)
from paratrain.models import ModelConfig, generate
from paratrain.parallel.contract import IGNORE_INDEX, TrainableModel, Verdict
from paratrain.peak_memory import ProcessPeak
from paratrain.run.build import Run, build, preflight, shared_run_dir
from paratrain.run.diagnose import flight_record_prefix
from paratrain.run.profiling import StepProfiler, profile_steps

__all__ = ["IGNORE_INDEX", "RunResult", "StepOutcome", "train", "train_step"]


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
    peak_mem_bytes: int = 0  # this process's peak over the whole run (CUDA: allocated; CPU: resident set)


@dataclass
class StepOutcome:
    """What one optimizer step measured."""

    loss: float  # mean token loss of the global batch
    grad_norm: float  # before clipping; nan for a skipped step
    tokens: int  # target tokens of the global batch
    verdict: Verdict


def train(cfg: Config) -> RunResult:
    """Train as configured; every process of the job calls this."""
    launch = LaunchTimes()  # where the time to the first step goes, carried by its record
    owns_group = not dist.is_initialized()
    env = detect_env()
    plan = preflight(cfg, env.world_size)  # before any process group exists; the run resolved once
    store = None
    if not plan.out:  # under torchrun without a run id: the ranks agree on one before the group exists, where
        # NCCL's flight recorder is told where to dump (into the run, where the failure summary reads)
        store = launcher_store(env, cfg.reliability.pg_timeout_s) if owns_group else default_store()
        plan = plan.with_out(shared_run_dir(plan.cfg, store))
    cfg = plan.cfg
    mesh = init_mesh(dp=cfg.parallel.dp or None, tp=cfg.parallel.tp, pp=cfg.parallel.pp, cp=cfg.parallel.cp,
                     ep=cfg.parallel.ep,
                     dp_shard=cfg.parallel.dp_shard or None, timeout_s=cfg.reliability.pg_timeout_s,
                     flight_records=flight_record_prefix(cfg), store=store)
    launch.mark("group")
    try:
        run = build(plan, env, mesh)
        for name, at in zip(("resume", "resumed"), run.checkpoints.resume_window):
            launch.mark(name, at)
        result = finish(run, *loop(run, launch))
    except BaseException:
        # A worker of a launcher that fails leaves without tearing the group down: that can wait on peers still
        # inside a collective, and the launcher names as the cause the rank whose error it records first.
        if owns_group and not env.distributed:
            shutdown()
        raise
    if owns_group:
        shutdown()
    return result


def loop(run: Run, launch: LaunchTimes | None = None) -> tuple[float, float, float]:
    """Every step from the one after the resumed one; returns (first loss, last loss, last eval loss). The first
    step's record carries `launch`'s times."""
    cfg, t, model, guard = run.cfg, run.cfg.train, run.model, run.guard
    bar = tqdm(total=t.steps, initial=run.resumed_step, desc="train", dynamic_ncols=True,
               disable=not (run.env.is_main and cfg.run.progress))
    first_loss = loss = eval_loss = float("nan")
    last_save_s = 0.0
    layers = moe_layers(model)  # a mixture of experts' layers on this rank, whose load each step's agreement carries
    moe = bool(layers or run.model_cfg.n_experts)

    def counts(timer: StepTimer) -> dict:  # this rank's numbers the step's agreement carries: the clock's save,
        # its compute time so far (the forward and backward, communication waits taken out), a MoE's load
        load = moe_counts(layers, run.model_cfg.n_layers, run.model_cfg.n_experts) if moe else {}
        return {**load, "save_due": float(run.checkpoints.clock_due()), "compute_s": timer.seconds["forward_backward"]}

    profiler = StepProfiler(profile_steps(cfg), run.out, run.env.rank, run.device)  # --profile-steps
    previous_lr = run.checkpoints.resumed_lr  # the step before this one's (the saved step's, after a resume)
    # A failed collective says which rank was where; saves are waited for; a profile cut short still ends.
    with guard.running(), run.checkpoints, contextlib.closing(profiler):
        for step in range(run.resumed_step + 1, t.steps + 1):
            guard.begin_step(step)
            run.comm.reset()
            timer, start = StepTimer(run.comm), time.perf_counter()
            lr = set_learning_rate(run.optimizer, step, cfg, run.checkpoints.lr_start)
            jump = lr_jump(previous_lr, lr, step, cfg, run.checkpoints.lr_start)
            if jump and run.env.is_main:
                print(f"paratrain: warning: {jump}", flush=True)
            previous_lr = lr
            # The profiler's range and the memory snapshots (--memory-snapshot) cover the step proper.
            with profiler.step(step) as trace, run.snapshots.around_step(step):
                with timer.phase("data"):
                    maybe_fault("hang_data", run.env.rank, step)  # a rank stuck before its step's first collective
                    position = run.sampler.samples_consumed  # where this step's global batch starts in the stream
                    batches = next_batches(run)
                step_fn = faulty(train_step, run.comm, run.env.rank, step)  # train_step itself when no fault is due
                outcome = step_fn(model, run.optimizer, batches, t.grad_clip, timer=timer, stop=guard.stop_requested,
                                  peak=run.memory, more_counts=functools.partial(counts, timer))
            guard.judge(outcome.verdict)
            record = step_record(run, step, lr, outcome, time.perf_counter() - start, timer, last_save_s)
            record.update(straggler_record(run, step, outcome.verdict.per_rank["compute_s"]))
            record.update(source_record(run, position))
            if launch is not None and step == run.resumed_step + 1:  # and what the launch restored from
                record.update(launch.record(), restored_from=run.checkpoints.restored)
            if trace:  # the last profiled step: where this rank's trace of the range is
                record["profile_trace"] = trace[0]
            loss, first_loss = outcome.loss, outcome.loss if step == run.resumed_step + 1 else first_loss
            if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                eval_loss, named = evaluate(run)
                record.update(eval_loss=eval_loss, eval_ppl=perplexity(eval_loss))
                record.update({"eval_losses": named} if named else {})
            log_step(run, bar, record, write=step % t.log_every == 0 or step == t.steps or "eval_loss" in record)
            if fault_requested("perturb", run.env.rank, step):
                guard.perturb()
            guard.end_step(step)  # may stop the run: too many non-finite steps, diverged replicas
            with timer.phase("checkpoint"):
                # Rank 0's clock decides, so that every rank saves at the same step.
                run.checkpoints.after_step(step, run.tokens_seen, last=step == t.steps, stopping=guard.stopping,
                                           clock_due=outcome.verdict.per_rank["save_due"][0] > 0)
            last_save_s = timer.seconds["checkpoint"]
            if guard.stopping:  # SIGTERM on some rank: checkpoint saved, leave now
                break
    bar.close()
    return first_loss, loss, eval_loss


def lr_jump(previous: float | None, lr: float, step: int, cfg: Config, start: int = 0) -> str:
    """What is wrong when the learning rate moves from the previous step's (`previous`; None: no step before
    this one in the schedule) to `lr` by more than 10% of `previous` beyond the schedule's own move between the
    two steps: the previous step ran another schedule (one changed under a checkpoint, or set by hand); '' when
    it did not. Every step of every run is checked; a warm-up or a short cosine moving fast is the schedule's."""
    if not previous or step - 1 <= start:
        return ""
    own_move = lr - learning_rate(step - 1, cfg, start)
    if abs((lr - previous) - own_move) <= 0.1 * previous:
        return ""
    return (f"the learning rate jumps from {previous:.3g} at step {step - 1} to {lr:.3g} at step {step} (more than "
            f"10% beyond the schedule's own step): the step before ran another schedule, such as the one a "
            f"checkpoint was saved in")


def log_step(run: Run, bar: tqdm, record: dict, write: bool = True) -> None:
    """The step's record into metrics.jsonl (rank 0; when `write`), the progress bar, and the evaluation line if
    there was one."""
    if run.log and write:
        run.log.write(record)
    if "eval_loss" in record and run.env.is_main:
        named = "".join(f", {name} {value:.4f}" for name, value in record.get("eval_losses", {}).items())
        bar.write(f"step {record['step']}: train loss {record['loss']:.4f}, eval loss {record['eval_loss']:.4f} "
                  f"(ppl {record['eval_ppl']:.2f}){named}")
    bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", refresh=False)
    bar.update(1)


def next_batches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data rank's micro-batches of the next global batch (the sampler's order: any layout, any resume)."""
    ids, micro = run.sampler.next_batch(), run.cfg.train.micro_batch
    return [run.train_set.get_batch(ids[i:i + micro]) for i in range(0, len(ids), micro)]


def train_step(model: TrainableModel, optimizer, batches, grad_clip: float, *, timer: StepTimer | None = None,
               stop: bool = False, peak: ProcessPeak | None = None, loss_fn=None,
               more_counts: Callable[[], dict] | None = None) -> StepOutcome:
    """One optimizer step over this rank's micro-batches, every stage in the order it runs.

    The loss is the mean over every target token of the global batch: each micro-batch
    contributes its token-loss *sum* divided by the token count of the whole step across all
    ranks, and the engine sums gradients over the data ranks, so accumulation and data
    parallelism give exactly the gradient of one process holding the whole batch, whatever the
    number of padded tokens in each micro-batch. Only the last micro-batch communicates.
    `timer`: times each phase (None: untimed); `stop`: this rank asks every rank to stop after the
    step (SIGTERM); `peak`: this rank's memory meter, read and restarted at the agreement (so a
    step's peak covers the previous optimizer step and this forward and backward; on CUDA
    reserved bytes beside it), reported per rank; `loss_fn(output, labels)`: a token-loss sum
    (default: the model's cross-entropy). The agreement is the step's one host read: the loss,
    the token count and the gradient norm come back with it, and `more_counts()`'s numbers of this
    rank, read once the backward has run (a MoE's expert load, `paratrain.metrics.moe_counts`).
    Injected faults wrap the step from outside (`paratrain.faults.faulty`): the step holds no fault hook.
    """
    phase = timer.phase if timer is not None else _untimed
    # Counted where the labels are, read by nobody: the agreement carries it to the host with the rest.
    local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in batches).to(model.device, torch.float64)
    with phase("forward_backward"):
        # The step's global token count, summed over the data ranks on the device (no host sync).
        normalizer = model.comm_sum(local_tokens.to(torch.float32))
        result = model.train_step(batches, normalizer, loss_fn or model.loss_fn)
    with phase("optimizer"):
        model.finish_gradients()
        memory = peak.take() if peak is not None else None
        verdict = model.agree(result, stop=stop, counts={
            "tokens": local_tokens, "peak_mem": memory.peak_bytes if memory else 0,
            "reserved_mem": (memory.reserved_bytes or 0) if memory else 0, **(more_counts() if more_counts else {})})
        if not verdict.skip:  # by the agreed norm: no collective, no host read
            model.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
        optimizer.step()  # a skipped step has no gradients: no parameter moves
        optimizer.zero_grad(set_to_none=True)
    tokens = int(verdict.sums["tokens"])
    return StepOutcome(verdict.loss_sum / tokens, math.nan if verdict.skip else verdict.grad_norm, tokens, verdict)


def _untimed(name: str):
    """A step phase that nobody times (`train_step` without a timer)."""
    return contextlib.nullcontext()


def step_record(run: Run, step: int, lr: float, outcome: StepOutcome, elapsed: float, timer: StepTimer,
                last_save_s: float) -> dict:
    """The metrics record of one step (before any evaluation's own communication)."""
    run.tokens_seen += outcome.tokens
    peaks = [int(v) for v in outcome.verdict.per_rank["peak_mem"]]
    reserved = int(outcome.verdict.per_rank["reserved_mem"][run.mesh.rank])
    data_ranks = [r for r in range(run.mesh.size(WORLD)) if run.mesh.shape.owns(r, PER_DATA_RANK)]
    return {
        "step": step, "loss": outcome.loss, "lr": lr, "grad_norm": outcome.grad_norm, "tokens": outcome.tokens,
        "tokens_seen": run.tokens_seen, "step_time_s": elapsed, "tokens_per_s": outcome.tokens / elapsed,
        "mfu": None if run.peak_flops is None else mfu(run.model_cfg.flops_per_token(run.cfg.data.seq_len),
                                                         outcome.tokens / elapsed, run.peak_flops, run.env.world_size),
        "comm_bytes": run.comm.bytes_by_axis(),
        "peak_mem_bytes": peaks[run.mesh.rank], "peak_mem_bytes_per_rank": [peaks[r] for r in data_ranks],
        "reserved_mem_bytes": reserved or None,  # CUDA's caching allocator; none on the CPU
        "skipped_steps": run.model.skipped_steps, "skipped_nonfinite": run.guard.bad_total,
        # The save that followed the previous step: a record is written before its own save.
        "time_breakdown_s": {**timer.breakdown(elapsed), "checkpoint_s": last_save_s,
                             # of which the --snapshot-every snapshot's stall: the copy to host memory
                             **({"snapshot_s": run.checkpoints.snapshot_s} if run.checkpoints.peers else {})},
        **moe_record(run, outcome.verdict),
    }


def straggler_record(run: Run, step: int, compute_s) -> dict:
    """{"compute_s_per_rank": every rank's compute seconds of the step, "stragglers": the ranks slow for
    --straggler-steps in a row (`paratrain.metrics.StragglerWatch`), if any}; rank 0 warns once per straggler."""
    stragglers, named = run.stragglers.observe(compute_s)
    if run.env.is_main:
        for straggler in named:
            print(f"paratrain: warning: {run.stragglers.describe(straggler, step)}", file=sys.stderr, flush=True)
    return {"compute_s_per_rank": [float(t) for t in compute_s], **({"stragglers": stragglers} if stragglers else {})}


def moe_record(run: Run, verdict: Verdict) -> dict:
    """{"moe": the expert load and aux loss of the step (`paratrain.metrics.expert_load`)}, or {} for a dense model.

    A data rank's tokens are seen alike by its tensor- and context-parallel ranks: the rows of each data
    rank's tp = cp = 0 ranks count, one per pipeline stage.
    """
    owners = [r for r in range(run.mesh.size(WORLD)) if run.mesh.shape.owns(r, ("tp", "cp"))]
    load = expert_load(verdict.per_rank, owners, run.mesh.size("dp"))
    return {"moe": load} if load is not None else {}


def source_record(run: Run, position: int) -> dict:
    """{"tokens_by_source": {source: tokens}} of the step's global batch for a mixture, {} for one corpus: the
    tokens the loss counts (a chat source's targets), which add up to the step's `tokens`.

    A function of the batch's stream position alone (`paratrain.data.mixture`): the same on every layout.
    """
    if not run.data or not run.data.sources:
        return {}
    counts = run.train_set.targets_by_source(run.sampler.ids(position, run.cfg.train.global_batch))
    return {"tokens_by_source": {name: int(n) for name, n in zip(run.data.sources, counts)}}


def evaluate(run: Run) -> tuple[float, dict[str, float]]:
    """(the eval loss, {name: loss} of each named held-out set): a mixture's sources' tails (whose loss is their
    weighted mean) and the --eval-data sets; a single corpus's tail alone gives the eval loss and no names."""
    losses = {name: eval_loss(run, held) for name, held in run.data.eval_sets.items()}
    return sum(w * losses[name] for name, w in run.data.weights.items()), {k: v for k, v in losses.items() if k}


@torch.no_grad()
def eval_loss(run: Run, eval_set) -> float:
    """Mean token loss over the first eval-batches × global-batch sequences of `eval_set`, split across data ranks.

    The sequences do not depend on the layout, so every layout reports the same eval loss.
    """
    model, t, dp, dp_rank = run.model, run.cfg.train, run.mesh.size("dp"), run.mesh.coord("dp")
    model.eval()
    count = min(len(eval_set), t.eval_batches * t.global_batch)
    totals = torch.zeros(2, device=run.device)
    for inputs, labels in eval_batches(eval_set, count, dp, dp_rank, t.micro_batch):
        totals[0] += model.eval_loss_sum(inputs, labels)
        totals[1] += (labels != IGNORE_INDEX).sum()
    model.train()
    model.comm_sum(totals)
    return (totals[0] / totals[1]).item()


def eval_batches(eval_set, count: int, dp: int, dp_rank: int, micro_batch: int):
    """This data rank's held-out micro-batches: sequences dp_rank, dp_rank + dp, ... below `count`, then batches
    whose labels are all ignored until every data rank has run the same number of forwards.

    A forward is collective beyond its tensor and pipeline groups (ZeRO-3 all-gathers each unit's
    parameters over the data ranks): with `count` not a multiple of dp × micro-batch, a rank with a
    forward fewer would meet its peers' all-gather with the loss's all-reduce and wait out the
    process-group timeout. A padded batch adds nothing to the loss sum or the token count. The
    ranks of one pipeline (and of one tensor group) share their data rank, so they pad alike.
    """
    mine = list(range(dp_rank, count, dp))
    forwards = math.ceil(math.ceil(count / dp) / micro_batch)  # data rank 0's: it holds the most sequences
    for i in range(forwards):
        ids = mine[i * micro_batch:(i + 1) * micro_batch]
        if ids:
            yield eval_set.get_batch(ids)
        else:
            inputs, labels = eval_set.get_batch([0])
            yield inputs, torch.full_like(labels, IGNORE_INDEX)


def finish(run: Run, first_loss: float, loss: float, eval_loss: float) -> RunResult:
    """After the last step: the final weights and a text sample (rank 0 writes them); a preempted run just returns."""
    entropy = unigram_entropy(run.train_set.stream.tokens, run.model_cfg.vocab_size)
    run.snapshots.close()
    if run.guard.stopping:
        if run.log:
            run.log.close()
        return RunResult(run.out, first_loss, loss, eval_loss, entropy, "", preempted=True)
    # Both collective, both on the sharded model: the sample's forward gathers what it uses as training
    # does, and the weights travel one tensor at a time to rank 0's file.
    prompt, sample = sample_text(run.model, run.tokenizer, run.eval_set, run.cfg.train.sample_tokens,
                                 run.cfg.train.seed, run.device)
    save_final(run.out, run.model_cfg, run.tokenizer, run.model.full_shapes(), run.model.full_parameters(),
               write=run.env.is_main)
    run.memory.take()
    if run.env.is_main:
        run.log.close()
        if sample:
            print(f"--- prompt (held-out text) ---\n{prompt}\n--- the model's continuation ---\n{sample}\n---")
        print(f"train loss {first_loss:.3f} -> {loss:.3f}, eval loss {eval_loss:.3f} "
              f"(unigram entropy of the data: {entropy:.3f})\nrun written to {run.out}", flush=True)
    return RunResult(run.out, first_loss, loss, eval_loss, entropy, sample, peak_mem_bytes=run.memory.highest)


def build_model(model_cfg: ModelConfig, device: torch.device, seed: int):
    """The reference model, constructed without allocating (meta device), then materialized and initialized on `device`."""
    from paratrain.models import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def learning_rate(step: int, cfg: Config, start: int = 0) -> float:
    """Linear warmup to lr over warmup_steps, then cosine decay to min_lr at the last step; the schedule begins
    at step `start` (a stage's --reset lr: warmup and decay again over the steps left)."""
    t = cfg.train
    step, steps = step - start, t.steps - start
    if step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, step: int, cfg: Config, start: int = 0) -> float:
    lr = learning_rate(step, cfg, start)
    for group in optimizer.param_groups:  # one schedule: a group with its own peak (Muon's) scales it
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def save_final(out: Path, model_cfg: ModelConfig, tokenizer, shapes: dict[str, tuple[int, ...]],
               weights: Iterable[tuple[str, torch.Tensor]], write: bool = True) -> Path:
    """Weights (safetensors, fp32), model config and tokenizer under out/final, written to a temporary name
    then renamed.

    `weights` yields (name, whole tensor) in `shapes` order, one at a time (`ParallelModel.full_parameters`,
    collective): each is written and dropped, so the whole model is never in memory. A rank with
    `write=False` takes part in the iteration and writes nothing.
    """
    final, tmp = out / "final", out / "final.tmp"
    # A tied table is stored once, as tok_embeddings.weight.
    keep = [name for name in shapes if not (model_cfg.tie_embeddings and name == "output.weight")]
    stream = ((name, w.detach().to("cpu")) for name, w in weights if name in keep)
    try:
        if write:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_safetensors(tmp / "model.safetensors", [(name, torch.float32, shapes[name]) for name in keep],
                              stream, metadata={"format": "paratrain"})
            (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2) + "\n")
            tokenizer.save(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    finally:
        for _ in stream:  # the other ranks' collectives go on to the end whatever happened here
            pass
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
