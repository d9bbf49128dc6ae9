"""Checkpoints of a training run: what the trainer saves beside the tensors, and how a launch resumes.

A checkpoint of ``paratrain train`` holds, besides the boxes of masters and
optimizer state (`paratrain.run.model_state`):

* shared state (rank 0's): step, tokens seen, run id, the resolved config
  and model config (``model_config``, which `paratrain export` reads), the
  layout (world size, degrees, ZeRO stage, precision, micro-batch), the loss
  scaler, the data sampler (a global stream position: it continues exactly
  under any number of data ranks) and the non-finite step counters;
* its assets (``assets/``: the tokenizer and the model directory's config.json, `paratrain.run.carried`), so
  that the checkpoint alone resumes and exports;
* per-rank state: each rank's RNG states (torch's CPU and its GPU's, Python, NumPy), restored to
  the same rank when the layout is unchanged.

With --snapshot-every, each rank also snapshots the same state (all the boxes it holds) into node-local
memory with a copy on a buddy rank (`paratrain.checkpoint.snapshot`). A launch that continues its run
(--resume auto, or a restart) restores, in this order, from: the snapshot of the newest step complete on
every rank (each rank's own, else the copy its buddy holds), unless a disk checkpoint is newer; then the
newest disk checkpoint. Its first line says which, and how many steps were lost.

Resuming is decided once, by rank 0, which alone touches the checkpoint root
before any save (quarantine of dead saves, `find_latest` with its full
checksum verification, setting aside checkpoints newer than the one resumed):
it broadcasts the path; every rank then reads the index itself and the ranks
compare the step they see and their compatibility verdicts before anyone
loads, so they fail or proceed together.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from paratrain.checkpoint.async_save import AsyncCheckpointer
from paratrain.checkpoint.coordinator import LocalCoordinator, dedicated_coordinator
from paratrain.checkpoint.format import (
    LATEST_FILE, MANIFEST_FILE, CheckpointError, CheckpointWarning, parse_step_dirname, step_dirname,
)
from paratrain.checkpoint.reader import CheckpointReader
from paratrain.checkpoint.snapshot import PeerSnapshots, plan_restore
from paratrain.run.rundir import (
    CHECKPOINT_DIR, RUN_FILE, last_logged_step, read_run_id, read_stored_config, set_aside_newer, truncate_metrics,
)
from paratrain.checkpoint.save import save_checkpoint
from paratrain.checkpoint.store import (
    check_free_space, find_latest, list_checkpoints, quarantine_incomplete, read_index, verify_checkpoint,
)
from paratrain.run.model_state import check_compatible, load_model_shards, master_boxes, model_shards
from paratrain.config import Config, ConfigError, checkpoint_policy
from paratrain.faults import SNAPSHOT_EVENTS, checkpoint_events, current_attempt

_SHARED_KEYS = ("step", "tokens_seen", "sampler", "scaler", "guard", "layout")
RESETS = ("data", "lr", "step")  # what a new stage (--resume PATH --reset ...) starts afresh
_clock = time.monotonic  # the wall-clock policy's (a module attribute, so that a test can move it)


# The shared-state key of a LoRA run's base fingerprint (`paratrain.parallel.lora.base_fingerprint`).
LORA_BASE_KEY = "lora_base"


class TrainingCheckpoints:
    """Save and resume of one run; every rank builds one, collectively, after the model and optimizer."""

    def __init__(self, cfg: Config, rank: int, out: Path, model, optimizer, sampler, guard, *,
                 extra_state: dict | None = None, assets: dict[str, bytes] | None = None,
                 log=functools.partial(print, flush=True), local_world_size: int = 1):
        self.cfg, self.rank, self.out, self.log = cfg, rank, Path(out), log
        self.extra_state = dict(extra_state or {})  # more shared state (the resolved model config)
        self.assets = assets  # rank 0's: the files each checkpoint carries (`paratrain.run.carried.run_assets`)
        self.model, self.optimizer, self.sampler, self.guard = model, optimizer, sampler, guard
        self.mesh = model.mesh
        self.lr_start = 0  # the step the learning-rate schedule started at (a stage's --reset lr moves it)
        self.resumed_lr = None  # the learning rate of the step this launch resumed after, if it continues the stage
        self.root = self.out / CHECKPOINT_DIR
        self.coordinator = self._coordinator()
        self.run_id = self.coordinator.broadcast_object(read_run_id(self.out) if rank == 0 else None)
        c = cfg.checkpoint
        self.keep_latest = c.keep_latest or None
        self.on_event = checkpoint_events(rank)  # the injected faults of a save (tests), or None
        self.saver = (AsyncCheckpointer(self.root, keep_latest=self.keep_latest, coordinator=self._coordinator(),
                                        on_event=self.on_event) if c.async_save else None)
        self.policy = checkpoint_policy(c.every)
        self.last_save = _clock()  # the wall-clock policy counts from the start, then from each save
        # --snapshot-every: this rank's snapshots in node memory, one directory per job (collective: a group)
        self.peers = (PeerSnapshots(Path(c.snapshot_dir) / (self.run_id or "run"), rank, self.mesh.shape.world_size,
                                    local_world_size, timeout_s=cfg.reliability.pg_timeout_s,
                                    on_event=checkpoint_events(rank, SNAPSHOT_EVENTS), buddy_rule=c.snapshot_buddy)
                      if c.snapshot_every else None)
        self.snapshot_s = 0.0  # what the last snapshot held the step up (the copy to host memory)
        self._finished = False  # the last step is done: the snapshots are of no more use
        if self.policy.enabled:
            self._check_free_space()

    def _coordinator(self):
        if self.mesh.shape.world_size == 1:
            return LocalCoordinator()
        return dedicated_coordinator(timeout=timedelta(seconds=self.cfg.reliability.pg_timeout_s))

    # -- resume ------------------------------------------------------------------------------
    def resume(self) -> tuple[int, int]:
        """Load the snapshot or checkpoint this launch continues from, if any; return (step, tokens seen) to start
        after. Snapshots newer than that step are discarded: the run continues from it.

        A new stage (--resume PATH --reset ...; not a restart, which continues the stage from the run's own
        checkpoints) keeps the model and optimizer and starts afresh what --reset names: the data stream
        ('data'), the learning-rate schedule from this step ('lr'), the step count and the schedule ('step').
        """
        self.resume_window = [time.time(), None]  # when the restore began and ended (`paratrain.metrics.LaunchTimes`)
        self.restored = {"source": "none"}  # what it restored from (the first step's record carries it)
        c = self.cfg.checkpoint
        own = not c.load_step and (c.resume == "auto" or current_attempt() > 0)  # the run continues itself
        resumed = self._resume_from_memory() if self.peers is not None and own else None
        if resumed is None:
            resumed = self._resume_from_disk()
        if self.peers is not None:
            self.peers.discard_newer(resumed[0])
        self.resume_window[1] = time.time()
        return resumed

    def _resume_from_memory(self) -> tuple[int, int] | None:
        """Restore from the snapshots when one step is complete on every rank and no disk checkpoint is newer
        (reading nothing of the disk's but the names of its checkpoint directories); None: resume from disk."""
        start = time.perf_counter()
        inventories = self.coordinator.gather_objects(self.peers.inventory())
        plan = None
        if self.rank == 0:
            committed = [p for p in list_checkpoints(self.root) if (p / MANIFEST_FILE).exists()]
            plan = plan_restore(inventories, parse_step_dirname(committed[-1].name) if committed else None)
        plan = self.coordinator.broadcast_object(plan)
        if plan["source"] != "memory":
            if plan["why"] and self.rank == 0:
                self.log(f"paratrain: {plan['why']}; resuming from the newest disk checkpoint")
            return None
        path = self.peers.fetch(plan)
        try:
            reader = self._open_agreed(str(path), snapshot=True)
        except CheckpointError as exc:
            if self.rank == 0:
                self.log(f"paratrain: the snapshot of step {plan['step']} cannot be restored ({exc}); resuming from "
                         f"the newest disk checkpoint")
            return None
        shared, _ = self._load(reader, [], state_rank=0)
        step, tokens_seen = reader.step, int(shared["tokens_seen"])
        self.lr_start, self.resumed_lr = int(shared.get("lr_start", 0)), shared.get("lr")
        self.restored = {"source": "snapshots", "step": step, "ranks": restored_ranks(plan["holders"])}
        if self.rank == 0:
            last = last_logged_step(self.out)
            truncate_metrics(self.out, step)
            lost = max(0, last - step)
            where = describe_sources(plan["holders"])
            self.log(f"paratrain: resumed from the snapshots in memory at step {step} ({where}; no disk read) in "
                     f"{time.perf_counter() - start:.2f} s: {lost} step(s) lost")
        return step, tokens_seen

    def _resume_from_disk(self) -> tuple[int, int]:
        decision = self.coordinator.broadcast_object(self._decide() if self.rank == 0 else None)
        if "error" in decision:
            raise CheckpointError(decision["error"])
        if "path" not in decision:
            if self.rank == 0:
                truncate_metrics(self.out, 0)
            self.restored = {"source": "none"}
            return 0, 0
        reader = self._open_agreed(decision["path"])
        stage = decision.get("reset", [])
        shared, restored = self._load(reader, stage, state_rank=self.rank)
        step, tokens_seen, self.lr_start = reader.step, int(shared["tokens_seen"]), int(shared.get("lr_start", 0))
        self.resumed_lr = None if {"lr", "step"} & set(stage) else shared.get("lr")  # a new schedule starts at 0
        self.restored = {"source": "disk", "step": reader.step, "path": str(reader.path)}
        if "step" in stage:
            step, tokens_seen, self.lr_start = 0, 0, 0
        elif "lr" in stage:
            self.lr_start = step
        if self.rank == 0:
            new_stage = f"; a new stage, {' and '.join(stage)} started afresh" if stage else ""
            dropped = truncate_metrics(self.out, step)
            rng = "" if restored else "; rank 0's RNG states restored on every rank (the layout changed)"
            saved = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime((Path(reader.path) / MANIFEST_FILE).stat().st_mtime))
            self.log(f"paratrain: resumed from {reader.path} at step {reader.step} (saved {saved} by "
                     f"{describe_layout(shared['layout'])})"
                     f"{f' ({dropped} metrics record(s) after it dropped)' if dropped else ''}"
                     f"{self._layout_change(shared['layout'])}{rng}{new_stage}")
        return step, tokens_seen

    def _load(self, reader: CheckpointReader, stage: list[str], state_rank: int) -> tuple[dict, bool]:
        """Load the model, optimizer, sampler (unless the stage resets 'data'), loss scale, guard and the RNG states
        (`_restore_rng`) from `reader`; return (its shared state, whether the layout was the saved one)."""
        shared = reader.shared_state()
        missing = [key for key in _SHARED_KEYS if key not in shared]
        if missing:
            raise CheckpointError(f"{reader.path} was not saved by `paratrain train`: its shared state lacks "
                                  f"{', '.join(missing)}")
        base = self.extra_state.get(LORA_BASE_KEY)
        if base is not None and shared.get(LORA_BASE_KEY, base) != base:
            raise CheckpointError(f"{reader.path} holds adapters trained on another base model (its frozen weights "
                                  f"differ from this run's: another --init-from, --seed or model); resume over the "
                                  f"base it was trained on")
        load_model_shards(self.model, self.optimizer, reader)
        if "data" not in stage:
            self.sampler.load_state_dict(shared["sampler"])
        self.model.load_loss_scale_state(shared["scaler"])
        self.guard.load_state_dict(shared["guard"])
        return shared, self._restore_rng(reader, shared["layout"], state_rank)

    def _decide(self) -> dict:
        """Rank 0: {"path": checkpoint to resume}, {} to start afresh, or {"error": message}."""
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CheckpointWarning)
                path = self._pick()
            for warning in caught:
                print(f"paratrain: warning: {warning.message}", file=sys.stderr, flush=True)
            step = read_index(path).step if path is not None else 0
            aside = set_aside_newer(self.root, step)
            if aside:
                self.log(f"paratrain: set aside checkpoint(s) newer than step {step}: {', '.join(aside)}")
        except (CheckpointError, OSError) as exc:  # every rank must hear it, or they wait in vain
            return {"error": str(exc)}
        if path is None:
            return {}
        c = self.cfg.checkpoint  # a new stage starts from the --resume checkpoint; a restart continues the stage
        stage = c.reset and c.resume not in ("auto", "none") and Path(path).resolve() == Path(c.resume).resolve()
        return {"path": str(path), "reset": reset_parts(c.reset) if stage else []}

    def _pick(self) -> Path | None:
        c = self.cfg.checkpoint
        quarantine_incomplete(self.root)  # rank 0 only, before any save: a save in flight would look dead
        if c.load_step:
            path = self.root / step_dirname(c.load_step)
            verify_checkpoint(path)
            return path
        if c.resume == "auto":
            return find_latest(self.root)
        own = find_latest(self.root) if current_attempt() > 0 else None
        if own is not None:  # a restart continues from this run's own newest checkpoint
            return own
        if c.resume == "none":
            return None
        verify_checkpoint(c.resume)
        return Path(c.resume)

    def _open_agreed(self, path: str, snapshot: bool = False) -> CheckpointReader:
        """Every rank opens the checkpoint and reads its index itself; the ranks compare steps and verdicts first.

        A `snapshot` is each rank's own (`path` differs between ranks): each verifies every checksum of its own
        (in memory: fast), and it must have the current layout (it holds the boxes of this rank alone).
        """
        reader = step = verdict = None
        try:
            # rank 0 verified the disk checkpoint's checksums all
            reader = CheckpointReader(path, verify=snapshot or self.rank != 0, checksums=snapshot)
            step = reader.step
            layout = with_layout_defaults(reader.shared_state().get("layout", {})) if snapshot else self.layout()
            if layout != self.layout():
                raise CheckpointError(f"it was saved by {describe_layout(layout)}, not this job's layout")
            check_compatible(self.model, reader)
        except CheckpointError as exc:
            verdict = f"rank {self.rank}: {exc}" if self.rank else str(exc)
        reports = self.coordinator.gather_objects({"step": step, "error": verdict})
        outcome = None
        if self.rank == 0:
            steps = sorted({r["step"] for r in reports if r["step"] is not None})
            errors = [r["error"] for r in reports if r["error"]]
            outcome = errors[0] if errors else (f"ranks disagree about the resume step ({steps}) in {path}"
                                                if len(steps) > 1 else None)
        outcome = self.coordinator.broadcast_object(outcome)
        if outcome:
            raise CheckpointError(outcome)
        return reader

    def _restore_rng(self, reader: CheckpointReader, saved_layout: dict, state_rank: int) -> bool:
        """Restore the RNG states that LoRA's dropout draws its masks from: under the saved layout each rank those
        `state_rank` saved; under another, rank 0's on every rank (the ranks' generators agree, as at a fresh
        start: a column-parallel adapter's input is the same on every tp rank and must get the same mask, and the
        stream goes on from where the run stopped). Whether the layout was the saved one."""
        same = with_layout_defaults(saved_layout) == self.layout()
        set_rng_state(reader.rank_state(state_rank if same else 0)["rng"])
        return same

    def _layout_change(self, saved: dict) -> str:
        now, saved = self.layout(), with_layout_defaults(saved)
        if saved == now:
            return ""
        return (f"; layout changed from {describe_layout(saved)} to {describe_layout(now)} "
                f"(global batch {now['global_batch']}, {now['accumulation']} micro-batch(es) per step now)")

    # -- save --------------------------------------------------------------------------------
    def clock_due(self) -> bool:
        """Whether this rank's clock says a wall-clock save is due (the ranks agree on rank 0's: `after_step`)."""
        return bool(self.policy.seconds) and _clock() - self.last_save >= self.policy.seconds

    def after_step(self, step: int, tokens_seen: int, last: bool, stopping: bool, clock_due: bool = False) -> None:
        """Save when due: every --checkpoint-every steps, or when the agreed clock says so (`clock_due`, the same on
        every rank), at the last step, and (synchronously) when stopping."""
        every, snapshot_every = self.policy.steps, self.cfg.checkpoint.snapshot_every
        self.snapshot_s = 0.0
        if self.peers is not None and not stopping and step % snapshot_every == 0:
            self.snapshot_s = self.peers.save(step, *self.state(step, tokens_seen, held=True))
        if stopping or (self.policy.enabled and (last or clock_due or (every and step % every == 0))):
            self.save(step, tokens_seen, wait=stopping or last)
        self._finished = last and not stopping

    def _schedule_lr(self) -> float:
        """The schedule's learning rate of the last step (a group with its own peak, Muon's, holds it scaled)."""
        group = self.optimizer.param_groups[0]
        return group["lr"] / group.get("lr_scale", 1.0)

    def state(self, step: int, tokens_seen: int, held: bool = False) -> tuple[dict, dict, dict]:
        """(shards, rank state, shared state) of a save after `step`: what this rank writes of the checkpoint, or
        with `held` all it holds (its snapshot)."""
        shards = model_shards(self.model, self.optimizer, held=held)
        shared = {"step": step, "tokens_seen": tokens_seen, "run_id": self.run_id, "config": self.cfg.to_dict(),
                  "layout": self.layout(), "scaler": self.model.loss_scale_state(),
                  "sampler": self.sampler.state_dict(), "guard": self.guard.state_dict(), "lr_start": self.lr_start,
                  "lr": self._schedule_lr(),  # the saved step's: a resume's first step compares
                  **self.extra_state}
        return shards, {"rng": rng_state()}, shared

    def save(self, step: int, tokens_seen: int, wait: bool = True) -> None:
        """Save checkpoint `step` (collective); CheckpointError on every rank if it fails."""
        start = time.perf_counter()
        shards, rank_state, shared = self.state(step, tokens_seen)
        if self.saver is not None:
            self.saver.save(step, shards, rank_state, shared, assets=self.assets)
            if wait:
                self.saver.wait()
        else:
            save_checkpoint(self.root, step, shards, rank_state, shared, coordinator=self.coordinator,
                            keep_latest=self.keep_latest, on_event=self.on_event, assets=self.assets)
        self.last_save = _clock()
        if self.rank == 0 and (wait or self.saver is None):
            self.log(f"paratrain: saved checkpoint {step_dirname(step)} ({time.perf_counter() - start:.2f} s)")

    def close(self) -> None:
        """Wait for a background save and a snapshot in flight (raising their errors); after the last step, delete
        this rank's snapshots."""
        if self.saver is not None:
            self.saver.close()
        if self.peers is not None:
            self.peers.wait()
            if self._finished:
                self.peers.remove()
            self.peers.close()

    def __enter__(self) -> TrainingCheckpoints:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        if self.peers is not None:
            self.peers.abandon()
        if self.saver is not None:
            # The loop failed: a save in flight is given up as a crash would leave it (never
            # waited for: it may wait on a rank that is gone; a leftover temporary directory is
            # quarantined at the next start).
            step = self.saver.abandon()
            if step is not None:
                self.log(f"paratrain: {step_dirname(step)} was being saved when the run failed: abandoned before "
                         f"its commit; `latest` stays at the newest committed checkpoint")

    def layout(self) -> dict:
        m, p, t = self.mesh, self.cfg.parallel, self.cfg.train
        dp = m.size("dp")
        return {"world_size": m.shape.world_size, "dp": dp, "dp_shard": m.shape.dp_shard, "tp": m.size("tp"),
                "pp": m.size("pp"), "cp": m.size("cp"), "ep": m.shape.ep, "zero": p.zero,
                "precision": p.precision, "global_batch": t.global_batch, "micro_batch": t.micro_batch,
                "accumulation": t.global_batch // (t.micro_batch * dp)}

    def _check_free_space(self) -> None:
        """Refuse to start when one checkpoint (masters and Adam's two moments: 3 × 4 bytes a weight) will not fit."""
        mine = sum(3 * b.master.numel() * b.master.element_size() for b in master_boxes(self.model) if b.writer)
        sizes = self.coordinator.gather_objects(mine)
        error = None
        if self.rank == 0:
            try:
                check_free_space(self.root, int(sum(sizes) * 1.1) + (1 << 20))
            except CheckpointError as exc:
                error = str(exc)
        error = self.coordinator.broadcast_object(error)
        if error:
            raise CheckpointError(error)


# Degrees the layout record gained after checkpoints were already saved without them: their value then.
_LAYOUT_DEFAULTS = {"cp": 1, "ep": 1}


def with_layout_defaults(layout: dict) -> dict:
    """A saved layout record with the degrees older checkpoints did not record filled in (they had none of them)."""
    return {**_LAYOUT_DEFAULTS, **layout}


def restored_ranks(holders: list) -> list[str]:
    """Where each rank's snapshot came from, by `plan_restore`'s holders: 'own' (its own directory), 'copy' (the
    copy a buddy held) or 'moved' (its own snapshot, held on another node: the ranks were renumbered)."""
    return ["copy" if kind == "copy" else "own" if holder == r else "moved" for r, (holder, kind) in enumerate(holders)]


def describe_sources(holders: list) -> str:
    """Where each rank's snapshot came from, by `plan_restore`'s holders: 'every rank from its own', or the ranks
    restored from a buddy's copy and those from their own snapshot held on another node (renumbered)."""
    copies = [r for r, (_, kind) in enumerate(holders) if kind == "copy"]
    moved = [r for r, (holder, kind) in enumerate(holders) if kind == "rank" and holder != r]
    parts = [f"rank(s) {', '.join(map(str, ranks))} {what}" for ranks, what in (
        (copies, "from the copy a buddy held"), (moved, "from their own held on another node")) if ranks]
    if not parts:
        return "every rank from its own"
    return ", ".join(parts) + (", the others from their own" if len(copies) + len(moved) < len(holders) else "")


def describe_layout(layout: dict) -> str:
    layout = with_layout_defaults(layout)
    extra = "".join(f" {axis}={layout[axis]}" for axis in ("cp", "ep") if layout[axis] > 1)
    return (f"dp={layout['dp']} tp={layout['tp']} pp={layout['pp']}{extra} zero={layout['zero']} {layout['precision']} "
            f"on {layout['world_size']} process(es)")


def resolve_resume(cfg: Config) -> tuple[Config, str]:
    """--resume as a user points at it (a run directory, its checkpoints/, its `latest`, its final/, or a step
    directory) made the step directory it means: the newest complete checkpoint, a torn newer one passed over.
    Without --out the run continues in its own directory. Returns (a new config with those two options resolved,
    `cfg` itself when --resume already named a step directory, or auto/none; what was found, '' then); ConfigError
    saying why there is none. `cfg` is left as it is."""
    resume = cfg.checkpoint.resume
    root = _checkpoint_root(Path(resume).expanduser()) if resume not in ("auto", "none") else None
    if root is None:
        return cfg, ""
    torn = []
    for candidate in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(candidate, checksums=False)  # rank 0 verifies the checksums when it resumes
        except CheckpointError as exc:
            torn.append(f"{candidate.name} is torn ({exc})")
            continue
        resolved = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(candidate)),
                                       run=dataclasses.replace(cfg.run, out=cfg.run.out or str(root.parent)))
        passed = f"; {', '.join(torn)}: the one before it is used" if torn else ""
        return resolved, f"--resume {resume}: its newest complete checkpoint is {candidate.name}{passed}"
    raise ConfigError(_why_no_checkpoint(resume, root, torn))


def _checkpoint_root(path: Path) -> Path | None:
    """The checkpoint root that `path` points into, or None for a step directory (or a path that is none of these,
    which verifying it explains)."""
    if path.name == LATEST_FILE and path.is_file():
        return path.parent
    if (path / MANIFEST_FILE).exists() or parse_step_dirname(path.name) is not None:
        return None
    if path.name == "final" and (path.parent / RUN_FILE).is_file():  # the last step's weights: its checkpoint
        return path.parent / CHECKPOINT_DIR
    if (path / CHECKPOINT_DIR).is_dir() or (path / RUN_FILE).is_file():
        return path / CHECKPOINT_DIR
    if path.name == CHECKPOINT_DIR or list_checkpoints(path):
        return path
    return None


def _why_no_checkpoint(resume: str, root: Path, torn: list[str]) -> str:
    if torn:
        return f"--resume {resume}: no complete checkpoint in {root} ({'; '.join(torn)}); resume from another run"
    stored = read_stored_config(root.parent)
    never = stored and not checkpoint_policy(stored.get("checkpoint", {}).get("every", 0)).enabled
    why = ("checkpoints were off in that run (--checkpoint-every 0) and no SIGTERM saved one" if never else
           "the run stopped before its first save")
    final = root.parent / "final"
    instead = (f"; to start from its final weights, `paratrain export {root.parent} DIR` and train with --init-from DIR"
               if final.is_dir() else "")
    return f"--resume {resume}: no checkpoint was written in {root}: {why}{instead}"


# Options a resumed run does not take from its checkpoint's config: what says where to resume from and how, and
# the rendezvous of one launch.
_NOT_INHERITED = {"checkpoint.resume", "checkpoint.load_step", "checkpoint.reset", "run.overwrite", "run.out",
                  "run.rdzv_id", "run.rdzv_endpoint"}
# The options that shape the learning-rate schedule a checkpoint is in the middle of.
_SCHEDULE = ("steps", "warmup_steps", "lr", "min_lr")


def continue_config(cfg: Config, given: set[str]) -> Config:
    """The config of `--resume PATH`: the checkpoint's own (model, data, recipe, layout, processes) with the options
    the user gave (`given`, "section.field") over it, so that `--resume RUN` alone continues the run as it was."""
    cfg, note = resolve_resume(cfg)
    if note:
        print(f"paratrain: {note}", flush=True)
    # Verified first, as preflight does: a damaged checkpoint is refused for what verifying finds (a file's size
    # against the manifest), not for whatever reading its config trips over.
    verify_checkpoint(cfg.checkpoint.resume, checksums=False)
    stored = read_index(cfg.checkpoint.resume).shared_state.get("config") or {}
    merged = cfg.to_dict()
    for section, values in stored.items():
        for key, value in values.items() if isinstance(values, dict) and section in merged else ():
            name = f"{section}.{key}"
            if key in merged[section] and name not in given and name not in _NOT_INHERITED:
                merged[section][key] = value
    return Config.from_dict(merged)


def check_resume_option(cfg: Config) -> None:
    """Preflight: an explicit --resume must be a committed checkpoint with every file of the right size (whether
    the continued stage keeps its schedule is `check_resumed_schedule`'s, after the run directory's claim).

    (Checksums are verified once, by rank 0, when the run resumes: here every rank would read
    every file.)
    """
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none"):
        verify_checkpoint(resume, checksums=False)
    if cfg.checkpoint.reset and resume in ("auto", "none"):
        raise ConfigError(f"--reset {cfg.checkpoint.reset} starts a new stage from a checkpoint: give it as --resume "
                          f"PATH (a step-* directory of the earlier run)")
    reset_parts(cfg.checkpoint.reset)


def check_resumed_schedule(cfg: Config) -> None:
    """Preflight, after the run directory's claim (resuming into another run's --out is the more fundamental
    refusal): an explicit --resume continues the learning-rate schedule its checkpoint is in, or --reset lr."""
    if cfg.checkpoint.resume not in ("auto", "none"):
        check_schedule(cfg, read_index(cfg.checkpoint.resume))


def check_schedule(cfg: Config, index) -> None:
    """ConfigError when the run would continue the checkpoint's schedule with other steps, warm-up or rates: the
    cosine would be stretched under the checkpoint's step and its learning rate jump (--reset lr starts a new one)."""
    parts = reset_parts(cfg.checkpoint.reset)
    saved = (index.shared_state.get("config") or {}).get("train", {})
    if "lr" in parts or "step" in parts or not saved:
        return
    for key in _SCHEDULE:
        now = getattr(cfg.train, key)
        if key in saved and saved[key] is not None and now is not None and saved[key] != now:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} {now} changes the learning-rate schedule that checkpoint step {index.step} is in "
                              f"({flag} {saved[key]} there): its learning rate would jump at step {index.step + 1}; "
                              f"pass --reset lr to run a new schedule over the steps left, or keep {flag} {saved[key]}")


def reset_parts(reset: str) -> list[str]:
    """The parts of --reset, each one of `RESETS` (ConfigError otherwise)."""
    parts = [part.strip() for part in reset.split(",") if part.strip()]
    unknown = [part for part in parts if part not in RESETS]
    if unknown:
        raise ConfigError(f"--reset {reset}: {unknown[0]!r} is not one of {', '.join(RESETS)}")
    return parts


def explain_layout_error(cfg: Config, error: Exception) -> Exception:
    """A layout refused for this world, with the layout of the checkpoint it would resume (if any) named too."""
    root = Path(cfg.run.out) / CHECKPOINT_DIR if cfg.run.out else None
    resume = cfg.checkpoint.resume
    path = Path(resume) if resume not in ("auto", "none") else (list_checkpoints(root) or [None])[-1] if root else None
    try:
        saved = read_index(path).shared_state.get("layout") if path is not None else None
    except CheckpointError:
        saved = None
    if not saved:
        return error
    return ConfigError(f"{error} (the checkpoint to resume, {path.name}, was saved with {describe_layout(saved)}; "
                       f"set --tp/--pp/--dp to fit this job's processes, or launch as many processes again)")


def rng_state() -> dict:
    """This process's RNG states: torch's CPU generator, on a GPU this rank's device's (the current device,
    set by `init_distributed`), Python's `random`, NumPy's global.

    One device only: the other visible GPUs belong to other ranks, and a relaunch may see fewer of
    them (one per process), where restoring every saved device's state would fail.
    """
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
             "numpy": {"keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (after a JSON round trip: lists instead of tuples); the CUDA state to
    this rank's device (the current one)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    cuda = state.get("cuda") if torch.cuda.is_available() else None
    if isinstance(cuda, list):  # saved before one device's state was: every visible GPU's, this one's at its index
        index = torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
