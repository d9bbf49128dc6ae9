"""--tracker wandb,mlflow,tensorboard, --profile-steps and --memory-snapshot: what a run shows where people look.

Every tracker is checked against the run's own metrics.jsonl, offline (W&B's offline mode, an MLflow file
store): every logged step's loss, the resolved config as hyperparameters, and a killed and resumed run that
continues the same tracker run. No network is used.
"""

import gzip
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from paratrain.config import ConfigError
from paratrain.errors import ParatrainError
from paratrain.metrics import read_metrics
from paratrain.run.build import preflight
from paratrain.testing import run_on_ranks
from paratrain.train import train

from test_train import small_config


def _killed_and_resumed(out: Path, **logging):
    """6 steps with a checkpoint every 3, the step-6 checkpoint removed (the run killed before it), resumed."""
    cfg = small_config(out)
    cfg.checkpoint.every = 3
    for key, value in logging.items():
        setattr(cfg.logging, key, value)
    train(cfg)
    first = read_metrics(out / "metrics.jsonl")
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    train(cfg)  # --resume auto: from step 3
    return first, read_metrics(out / "metrics.jsonl")


# -- Weights & Biases ----------------------------------------------------------------------------------------

def _wandb_history(path: Path) -> list[dict]:
    """The history records of an offline W&B run file (LevelDB's log format: 32 KiB blocks of records, each a
    CRC, a length and a type, FULL or FIRST/MIDDLE/LAST pieces, after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pieces, history = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        piece, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pieces = piece if kind in (1, 2) else pieces + piece
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            if record.WhichOneof("record_type") == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
    return history


def test_wandb_offline_holds_every_logged_step_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    first, final = _killed_and_resumed(out, trackers="wandb")
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    # One directory per attempt (W&B adds -1, -2 ... when two attempts start within the same second).
    attempts = sorted((out / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(attempts) == 2, "each attempt writes into the run of the paratrain run's id"
    logged = [{h["_step"]: h for h in _wandb_history(path)} for path in attempts]
    assert sorted(logged[0]) == [r["step"] for r in first] and sorted(logged[1]) == [4, 5, 6]
    for attempt, records in ((logged[0], first[:3]), (logged[1], final[3:])):
        for r in records:
            assert attempt[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-12)
            assert attempt[r["step"]]["time_breakdown_s/compute_s"] == pytest.approx(r["time_breakdown_s"]["compute_s"])
    assert logged[1][6]["eval_loss"] == pytest.approx(final[5]["eval_loss"])


# -- MLflow --------------------------------------------------------------------------------------------------

def test_mlflow_run_holds_every_logged_step_and_the_config_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    out = tmp_path / "run"
    first, final = _killed_and_resumed(out, trackers="mlflow")
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=store.as_uri())
    runs = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id], "the resumed attempt logged into the same MLflow run"
    history = client.get_metric_history(run_id, "loss")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4, 5, 6]
    last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # the resumed attempt's, last
    assert [last[r["step"]] for r in final] == pytest.approx([r["loss"] for r in final], rel=1e-12)
    params = client.get_run(run_id).data.params
    config = json.loads((out / "config.json").read_text())
    assert params["train.lr"] == str(config["train"]["lr"]) and params["logging.trackers"] == "mlflow"
    assert params["model.n_layers"] == "2"


# -- what a tracker costs the run -----------------------------------------------------------------------------

class _Down:
    """A tracker whose service is down: it takes a while to fail, then fails at every call."""

    def __init__(self, *args):
        import time

        time.sleep(0.5)

    def log(self, step, values):
        raise ConnectionError("tracking server unreachable")

    def close(self):
        raise ConnectionError("tracking server unreachable")


def test_a_tracker_that_is_down_neither_stalls_nor_kills_training(tmp_path, monkeypatch, capfd):
    from paratrain import trackers

    monkeypatch.setitem(trackers.TRACKER_CLASSES, "mlflow", _Down)
    cfg = small_config(tmp_path / "run", steps=3)
    cfg.logging.trackers = "mlflow,tensorboard"
    train(cfg)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    err = capfd.readouterr().err
    assert err.count("tracker mlflow failed (ConnectionError: tracking server unreachable); training goes on") == 1
    assert (tmp_path / "run" / "tensorboard").is_dir(), "the other tracker went on"


def test_trackers_add_no_host_sync(tmp_path, monkeypatch):
    """A tracker takes the record the loop already made, Python numbers: the same host reads of device memory
    per step with every tracker as without."""
    from paratrain.testing import HostSyncs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    counts = {}
    for name, trackers in (("none", ""), ("all", "tensorboard,wandb,mlflow")):
        cfg = small_config(tmp_path / name, steps=3)
        cfg.logging.trackers = trackers
        with HostSyncs() as syncs:
            train(cfg)
        counts[name] = len(syncs.calls)
    assert counts["all"] == counts["none"]


def test_bad_tracker_options_are_refused_in_one_line(tmp_path, monkeypatch):
    cfg = small_config(tmp_path / "run")
    cfg.logging.trackers = "wandb,neptune"
    with pytest.raises(ConfigError, match=r"^--tracker: unknown tracker 'neptune'; known: tensorboard, wandb, mlflow$"):
        preflight(cfg, 1)
    cfg.logging.trackers = "wandb"
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the client were not installed
    with pytest.raises(ParatrainError) as refused:
        train(cfg)
    assert "pip install 'paratrain[wandb]'" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before the run directory was claimed"
    cfg.logging.trackers = ""
    for bad in ("4", "5:4", "0:1", "a:b", "4:9"):
        cfg.logging.profile_steps = bad
        with pytest.raises(ConfigError, match="^--profile-steps") as refused:
            preflight(cfg, 1)
        assert "\n" not in str(refused.value)


# -- profiler traces and memory snapshots ----------------------------------------------------------------------

def _profiled(rank, world, out):
    cfg = small_config(out, steps=4, micro_batch=4)
    cfg.logging.profile_steps = "2:3"
    train(cfg)


def test_memory_snapshot_on_the_cpu_says_once_that_it_needs_cuda(tmp_path, capfd):
    cfg = small_config(tmp_path / "run", steps=2)
    cfg.logging.memory_snapshot = True
    train(cfg)
    assert capfd.readouterr().err.count("--memory-snapshot needs CUDA (this run is on the cpu)") == 1
    assert not (tmp_path / "run" / "memory").exists()


def test_profile_steps_write_a_trace_per_rank_with_those_steps_forward_and_backward(tmp_path):
    out = tmp_path / "run"
    run_on_ranks(_profiled, 2, str(out), timeout=180)
    for rank in range(2):
        trace = json.loads(gzip.decompress((out / "profile" / f"rank-{rank}-step-2-3.json.gz").read_bytes()))
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("paratrain step")}
        assert sorted(steps) == ["paratrain step 2", "paratrain step 3"]
        for start, end in steps.values():
            inside = [e["name"] for e in events if start <= e["ts"] <= end]
            assert any(n in ("aten::mm", "aten::addmm", "aten::linear") for n in inside), "the forward's matmuls"
            assert any("Backward" in n for n in inside), "the backward's autograd nodes"
    records = read_metrics(out / "metrics.jsonl")
    assert [r.get("profile_trace") for r in records] == [None, None, "profile/rank-0-step-2-3.json.gz", None]
    from paratrain.commands.report import load_run, looking_inside

    assert looking_inside(load_run(out).path) == [
        f"  profiler traces (Perfetto): {out / 'profile' / 'rank-0-step-2-3.json.gz'}, "
        f"{out / 'profile' / 'rank-1-step-2-3.json.gz'}"]


def test_the_profilers_own_log_lines_go_to_the_run_not_the_console(tmp_path, capfd):
    """Kineto writes `USDT: ... profiler_start` and `profiler_stop` to file descriptor 2 whatever its log level."""
    cfg = small_config(tmp_path / "run", steps=2)
    cfg.logging.profile_steps = "1:2"
    train(cfg)
    captured = capfd.readouterr()
    assert "USDT" not in captured.err + captured.out and "profiler_" not in captured.err + captured.out
    assert "profiler_stop" in (tmp_path / "run" / "profile" / "rank-0.log").read_text()
    assert (tmp_path / "run" / "profile" / "rank-0-step-1-2.json.gz").is_file()


def test_memory_snapshots_after_the_first_step_and_before_an_out_of_memory_error_leaves(tmp_path, monkeypatch):
    """The CUDA path with the allocator's calls recorded instead of made (no GPU here): history recorded from the
    start, a snapshot after the attempt's first step only, one more when a step runs out of memory, then the
    error goes on to the run's out-of-memory message."""
    import torch

    from paratrain.run.profiling import MemorySnapshots

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"snapshot"))
    snapshots = MemorySnapshots(True, tmp_path, 3, torch.device("cuda", 0), say_once=True)
    assert calls == [("record", {"max_entries": 100_000})]
    for step in (5, 6):
        with snapshots.around_step(step):
            pass
    with pytest.raises(torch.OutOfMemoryError), snapshots.around_step(7):
        raise torch.OutOfMemoryError("CUDA out of memory")
    snapshots.close()
    assert sorted(p.name for p in (tmp_path / "memory").iterdir()) == ["rank-3-oom-step-7.pickle", "rank-3-step-5.pickle"]
    assert calls[-1] == ("record", {"enabled": None})


def test_wandb_writes_under_wandb_dir_when_the_user_set_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    cfg = small_config(tmp_path / "run", steps=2)
    cfg.logging.trackers = "wandb"
    train(cfg)
    assert list((tmp_path / "elsewhere" / "wandb").glob("offline-run-*"))
    assert not (tmp_path / "run" / "wandb").exists()
