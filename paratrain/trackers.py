"""Where a run's records go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow (`--tracker`).

Rank 0 hands every record it writes to metrics.jsonl (`paratrain.metrics.MetricsLog`) to each tracker
the run asked for, as scalars at the record's step: every logged step and every evaluation, from the
one logging path the trainer has. The records are plain Python numbers by then, so a tracker adds no
device work and no host sync to a step.

Each tracker runs behind a queue on a thread of its own (`Background`): the loop puts the record and
goes on. The client is imported and its run opened on that thread too, so a slow service (or one that
is down) delays no step; a tracker that fails is reported once, on stderr, and dropped, and training
goes on. At the end of the run (or of an attempt) the queue is drained, within `CLOSE_TIMEOUT_S`.

The tracker run is the paratrain run: named by the run id of run.json, with the resolved config as its
hyperparameters (flattened: `train.lr`). A resumed run continues the same tracker run (W&B: the run id
with resume="allow"; MLflow: the run id it was given, kept in <out>/trackers.json). Offline, each writes
where it can be synced later: W&B with WANDB_MODE=offline under <out>/wandb, MLflow into the store
MLFLOW_TRACKING_URI names (default: a file store, <out>/mlruns).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

from paratrain.config import Config, ConfigError
from paratrain.errors import ParatrainError

TRACKERS = ("tensorboard", "wandb", "mlflow")
# What the trackers write into a run directory (`paratrain.run.rundir` keeps them across a relaunch, or wipes them).
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
MLFLOW_DIR = "mlruns"
TRACKERS_FILE = "trackers.json"  # the run ids trackers gave this run (MLflow's), so that a resumed run continues them
# tracker: (module that must import, pip extra that installs it)
CLIENTS = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
           "mlflow": ("mlflow", "mlflow")}
CLOSE_TIMEOUT_S = 120.0


def tracker_names(cfg: Config) -> tuple[str, ...]:
    """The trackers the run sends its records to: --tracker's, and tensorboard for --tensorboard; ConfigError for an
    unknown one."""
    names = [n.strip() for n in cfg.logging.trackers.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"--tracker: unknown tracker {unknown[0]!r}; known: {', '.join(TRACKERS)}")
    return tuple(dict.fromkeys([*names, *(["tensorboard"] if cfg.run.tensorboard else [])]))


def check_clients(names: tuple[str, ...]) -> None:
    """Each tracker's client can be imported; else a one-line ParatrainError naming the extra that installs it."""
    import importlib

    for name in names:
        module, extra = CLIENTS[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ParatrainError(f"--tracker {name} needs the {extra} client: pip install 'paratrain[{extra}]' "
                                 f"(or pip install {extra})") from None


def _leaves(doc: dict, separator: str, prefix: str = "") -> dict[str, object]:
    """Every value of nested dicts under its path of keys joined by `separator`."""
    out = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(_leaves(value, separator, f"{prefix}{key}{separator}"))
        else:
            out[prefix + key] = value
    return out


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers as tracker keys: nested dicts flattened as `a/b`; lists, None and flags left out."""
    return {k: v for k, v in _leaves(record, "/").items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config: dict) -> dict[str, object]:
    """The resolved config as hyperparameters: `train.lr`, `parallel.zero`, ... (None as an empty string)."""
    return {k: "" if v is None else v for k, v in _leaves(config, ".").items()}


class TensorBoardTracker:
    """torch's SummaryWriter into <out>/tensorboard; `purge_step`: a resumed run's first step, from which
    TensorBoard drops what an earlier attempt wrote (as metrics.jsonl is cut back to the resumed step)."""

    def __init__(self, out: Path, run_id: str, config: dict, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / TENSORBOARD_DIR), purge_step=purge_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run with the paratrain run's id (resume="allow": a resumed run continues it), its files under
    <out>/wandb, or under WANDB_DIR where the user set it (W&B's own convention, which accelerate and the
    Trainer respect); WANDB_MODE, WANDB_PROJECT (default "paratrain") and W&B's other variables apply."""

    def __init__(self, out: Path, run_id: str, config: dict, purge_step: int | None):
        import wandb

        where = Path(os.environ.get("WANDB_DIR") or out)
        (where / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "paratrain"), id=run_id, name=out.name,
                              dir=str(where), config=flat_config(config), resume="allow",
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in the store MLFLOW_TRACKING_URI names (default: a file store, <out>/mlruns), experiment
    MLFLOW_EXPERIMENT_NAME (default "paratrain"); its id kept in <out>/trackers.json, so a resumed run logs
    into the same run. The params are the resolved config; each record's numbers are metrics at its step."""

    def __init__(self, out: Path, run_id: str, config: dict, purge_step: int | None):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / MLFLOW_DIR).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance and refuses it unless asked: a file store is what the
            # user named (or an offline run's default, synced later with MLflow's own tools).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        state = _read_state(out)
        self.run_id = state.get("mlflow")
        if self.run_id is None or self._gone(self.run_id):
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "paratrain")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=out.name,
                                                 tags={"paratrain.run_id": run_id}).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            _write_state(out, {**state, "mlflow": self.run_id})
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def _gone(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return True
        return False

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKER_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def _read_state(out: Path) -> dict:
    try:
        return json.loads((out / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(out: Path, state: dict) -> None:
    tmp = out / (TRACKERS_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(out / TRACKERS_FILE)


_STOP = object()


class Background:
    """One tracker on a thread of its own: opened there, fed from a queue; a failure is said once and the tracker
    dropped, so a slow or broken service never stalls or kills training."""

    def __init__(self, name: str, open_tracker, *args):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(open_tracker, args), name=f"tracker-{name}",
                                        daemon=True)
        self._thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        self._queue.put((step, values))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Drain what is queued (at most `timeout` seconds), then close the tracker's run."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            print(f"paratrain: tracker {self.name}: not done after {timeout:.0f} s; its last records may be missing",
                  file=sys.stderr, flush=True)

    def _run(self, open_tracker, args) -> None:
        tracker = None
        try:
            tracker = open_tracker(*args)
            while (item := self._queue.get()) is not _STOP:
                tracker.log(*item)
            tracker.close()
        except Exception as e:  # noqa: BLE001 - any failure of a tracker's client ends the tracker, not the run
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            print(f"paratrain: tracker {self.name} failed ({type(e).__name__}: {first}); training goes on "
                  f"without it", file=sys.stderr, flush=True)
            while self._queue.get() is not _STOP:  # let close() return at once
                pass


def open_trackers(names: tuple[str, ...], out: Path, run_id: str, config: dict,
                  purge_step: int | None = None) -> list[Background]:
    """The trackers `names` for the run in `out`, each opening on its own thread."""
    return [Background(name, TRACKER_CLASSES[name], out, run_id, config, purge_step) for name in names]
