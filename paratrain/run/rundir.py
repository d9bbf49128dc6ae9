"""The run directory: one run per --out, identified by a run id; what a relaunch may continue, what it must not touch.

    <out>/run.json          {"run_id": ...}: written when the run starts afresh
    <out>/config.json       the resolved config of the latest launch
    <out>/metrics.jsonl     one record per step; cut back to the resumed step on resume
    <out>/tensorboard/      with --tracker tensorboard, the same records as TensorBoard scalars (paratrain.trackers)
    <out>/wandb/            with --tracker wandb, W&B's files of the run (offline: to sync later)
    <out>/mlruns/           with --tracker mlflow and no MLFLOW_TRACKING_URI, the MLflow file store
    <out>/trackers.json     the run ids trackers gave this run (MLflow's), so that a resumed run continues them
    <out>/profile/          with --profile-steps, a torch.profiler Chrome trace per rank (paratrain.run.profiling)
    <out>/memory/           with --memory-snapshot, CUDA memory snapshots per rank (paratrain.run.profiling)
    <out>/checkpoints/      sharded checkpoints (paratrain.checkpoint)
    <out>/diagnostics/      per attempt, each rank's collective fingerprints (paratrain.run.diagnose)
    <out>/samples/          with --log-samples, each rank's sample ids per step (paratrain.run.samples)

A launch into an --out that already holds a run continues it only when that
is surely the same run: a restart by the launcher, or a relaunch with the
same model, data and training options and a checkpoint to resume (``--resume
auto``; not when it already finished: its final weights written and an intact
checkpoint at its last step), or an explicit ``--resume`` of one of the run's
own checkpoints.
Anything else is refused with one line naming the first difference, unless
``--overwrite`` starts a new run (its old metrics and checkpoints deleted).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from paratrain.checkpoint.format import parse_step_dirname
from paratrain.checkpoint.store import list_checkpoints, read_index
from paratrain.config import Config, ConfigError
from paratrain.distributed import detect_env
from paratrain.trackers import MLFLOW_DIR, TENSORBOARD_DIR, TRACKERS_FILE, WANDB_DIR

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
PROFILE_DIR = "profile"
MEMORY_DIR = "memory"
CHECKPOINT_DIR = "checkpoints"
DIAGNOSTICS_DIR = "diagnostics"
SAMPLES_DIR = "samples"
SUPERSEDED_PREFIX = ".superseded-"
# The sections that define what a run computes; a relaunch may change the others (layout, logging).
IDENTITY_SECTIONS = ("model", "data", "train")
# Options of those sections that change only what is measured or printed, not the trajectory.
# (The micro-batch too: the global batch is the invariant, the micro-batch only how a layout splits it.)
FREE_OPTIONS = {"eval_every", "eval_batches", "sample_tokens", "peak_flops", "micro_batch", "log_every"}


@dataclass(frozen=True)
class RunClaim:
    """What a launch does with its --out: start afresh or continue the run there, deleting `wipe` first.

    A launch (not a restart) always clears the diagnostics of earlier launches: their marks of
    failed ranks would mislead this one's.
    """

    path: Path
    fresh: bool
    wipe: tuple[str, ...] = ()


def claim_run_dir(cfg: Config, restarted: bool) -> RunClaim:
    """Decide, from the directory alone (so every rank decides alike), whether this launch may use --out."""
    out = Path(cfg.run.out)
    holds_run = (out / METRICS_FILE).exists() or (out / RUN_FILE).exists()
    if restarted:  # the launcher restarted the job: the same run by construction
        return RunClaim(out, fresh=not holds_run)
    if not holds_run:
        if list_checkpoints(out / CHECKPOINT_DIR):
            raise ConfigError(f"--out {out} holds checkpoints but no run.json (not a paratrain run directory); "
                              f"choose another --out, or --resume one of its checkpoints into another --out")
        return RunClaim(out, fresh=True, wipe=(DIAGNOSTICS_DIR,))
    if cfg.run.overwrite:
        _refuse_overwriting_the_resume_source(cfg, out)
        return RunClaim(out, fresh=True, wipe=(METRICS_FILE, RUN_FILE, CHECKPOINT_DIR, DIAGNOSTICS_DIR, SAMPLES_DIR,
                                                  TENSORBOARD_DIR, WANDB_DIR, MLFLOW_DIR, TRACKERS_FILE, PROFILE_DIR,
                                                  MEMORY_DIR))
    resume = cfg.checkpoint.resume
    if resume == "none":
        raise ConfigError(f"--out {out} already holds a run; choose another --out, pass --overwrite, or "
                          f"--resume auto to continue it")
    if resume == "auto":
        checkpoints, finished = list_checkpoints(out / CHECKPOINT_DIR), (out / "final").is_dir()
        # A launch that is no restart may still continue an unfinished run without a checkpoint when a node that
        # replaces a lost one can be it: one of several nodes starts its agent afresh (attempt 0) while the other
        # nodes' agents restart, and the restore every rank agrees on (the snapshots in memory, else the start)
        # decides what is continued; on one node, with snapshots on, their restore does.
        if not checkpoints and (finished or not (cfg.checkpoint.snapshot_every or several_nodes(cfg))):
            raise ConfigError(f"--out {out} already holds a run and it has no checkpoint to resume; choose "
                              f"another --out or pass --overwrite")
        difference = config_difference(read_stored_config(out), cfg.to_dict())
        if difference:
            raise ConfigError(f"--out {out} holds another run ({difference}); choose another --out, pass "
                              f"--overwrite, or --resume <checkpoint> to start a new run from its weights")
        newest = _finished_step(checkpoints, cfg.train.steps) if finished else 0
        if newest and not 0 < cfg.checkpoint.load_step < newest:
            # Checkpoints by default leave a finished run one: --resume auto would run no step of it (a 'nan' loss)
            raise ConfigError(f"--out {out} already holds a run, finished at step {newest} (its weights in "
                              f"{out / 'final'}); choose another --out, pass --overwrite, or --resume {out} "
                              f"--steps N --reset lr to train it further")
        return RunClaim(out, fresh=False, wipe=(DIAGNOSTICS_DIR,))
    theirs, mine = checkpoint_run_id(Path(resume)), read_run_id(out)
    if theirs != mine:
        raise ConfigError(f"--out {out} holds run {mine} but --resume {resume} is a checkpoint of run {theirs}; "
                          f"continue the run in {out} with --resume auto, resume into another --out, or pass "
                          f"--overwrite to replace it")
    return RunClaim(out, fresh=False, wipe=(DIAGNOSTICS_DIR,))


def several_nodes(cfg: Config) -> bool:
    """Whether the job spans several nodes: `paratrain train --nnodes`, or a launcher's (torchrun's, Slurm's) ranks
    beyond one node's (`detect_env`)."""
    env = detect_env()
    return cfg.run.nnodes > 1 or env.world_size > env.local_world_size


def _finished_step(checkpoints: list[Path], steps: int) -> int:
    """The step of the newest intact checkpoint at or past the last step (`steps`), or 0 where none is: a damaged
    one is passed over when resuming, so it does not make the run finished. (Checksums read only for those.)"""
    from paratrain.checkpoint.format import CheckpointError
    from paratrain.checkpoint.store import verify_checkpoint

    for path in reversed(checkpoints):
        step = parse_step_dirname(path.name)
        if step < steps:
            return 0
        try:
            verify_checkpoint(path)
        except CheckpointError:
            continue
        return step
    return 0


def _refuse_overwriting_the_resume_source(cfg: Config, out: Path) -> None:
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and (out / CHECKPOINT_DIR).resolve() in Path(resume).resolve().parents:
        raise ConfigError(f"--overwrite would delete {resume}, the checkpoint to resume; resume into another --out")


def apply_claim(claim: RunClaim, cfg: Config) -> str:
    """On rank 0 only: delete what a fresh start replaces, write run.json (fresh) and config.json; return the run id."""
    out = claim.path
    out.mkdir(parents=True, exist_ok=True)
    for name in claim.wipe:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    run_id = read_run_id(out)
    if claim.fresh or run_id is None:
        run_id = uuid.uuid4().hex[:12]
        _write_json(out / RUN_FILE, {"run_id": run_id})
    (out / "config.json").write_text(cfg.to_json() + "\n")
    return run_id


def diagnostics_dir(out: Path) -> Path:
    """Where this attempt's ranks leave their collective fingerprints (one directory per restart)."""
    from paratrain.faults import current_attempt

    return Path(out) / DIAGNOSTICS_DIR / f"attempt-{current_attempt()}"


def read_run_id(out: Path) -> str | None:
    try:
        return json.loads((Path(out) / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_run_id(path: Path) -> str | None:
    """The run id a checkpoint was saved by (CheckpointError if it cannot be read)."""
    return read_index(path).shared_state.get("run_id")


def read_stored_config(out: Path) -> dict:
    """The resolved config of the run in `out` (config.json), or {} where there is none."""
    try:
        return json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def config_difference(stored: dict, current: dict) -> str | None:
    """The first option, in the identity sections, whose value differs: 'train.lr is 0.003 there, 0.001 here'."""
    for section in IDENTITY_SECTIONS:
        theirs, mine = stored.get(section, {}), current.get(section, {})
        for key in sorted(set(theirs) | set(mine)):
            # An option newer than the stored run is not in its config: it ran with that option's fixed value
            # of the time, which cannot be read back (train.eps, before the models' recipes: torch's 1e-8).
            if key not in FREE_OPTIONS and (key in theirs or not theirs) and theirs.get(key) != mine.get(key):
                return f"{section}.{key} is {theirs.get(key)!r} there, {mine.get(key)!r} here"
    return None


def truncate_metrics(out: Path, step: int) -> int:
    """Keep the metrics records of steps ≤ `step` (rank 0, on resume); return how many were dropped."""
    path = Path(out) / METRICS_FILE
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record_step = json.loads(line).get("step", 0)
        except ValueError:
            dropped += 1  # a line cut by the crash
            continue
        if record_step <= step:
            kept.append(line)
        else:
            dropped += 1
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return dropped


def last_logged_step(out: Path) -> int:
    """The step of the last complete record of metrics.jsonl (0 when there is none): how far a run got."""
    try:
        lines = (Path(out) / METRICS_FILE).read_text(encoding="utf-8").split("\n")[:-1]  # a cut line is no record
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError):
            continue
    return 0


def set_aside_newer(root: Path, step: int) -> list[str]:
    """Rename the run's checkpoints newer than `step` out of find_latest's sight (a rewind starts a new branch)."""
    moved = []
    for path in list_checkpoints(root):
        if parse_step_dirname(path.name) > step:
            os.rename(path, path.with_name(f"{SUPERSEDED_PREFIX}{path.name}-{uuid.uuid4().hex[:6]}"))
            moved.append(path.name)
    return moved


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, path)
