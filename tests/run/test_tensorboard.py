"""--tensorboard: the trainer's metrics.jsonl records, also as TensorBoard scalars (rank 0, beside the file)."""

import sys

import pytest

from paratrain.commands.train import add_config_options, config_from_args
from paratrain.errors import ParatrainError
from paratrain.metrics import read_metrics
from paratrain.train import train

from test_train import small_config


def test_tensorboard_scalars_equal_the_metrics_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = small_config(tmp_path / "run", steps=4, eval_every=2)
    cfg.run.tensorboard = True
    train(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag, key in [("loss", ("loss",)), ("lr", ("lr",)), ("grad_norm", ("grad_norm",)),
                     ("tokens_per_s", ("tokens_per_s",)), ("mfu", ("mfu",)), ("peak_mem_bytes", ("peak_mem_bytes",)),
                     ("time_breakdown_s/compute_s", ("time_breakdown_s", "compute_s")), ("eval_loss", ("eval_loss",))]:
        assert tag in tags, tag
        expected = {}
        for r in records:
            value = r
            for k in key:
                value = value.get(k) if isinstance(value, dict) else None
            if value is not None:
                expected[r["step"]] = value
        written = {e.step: e.value for e in events.Scalars(tag)}
        assert written.keys() == expected.keys() and expected, tag
        assert all(written[s] == pytest.approx(v, rel=1e-6) for s, v in expected.items()), tag  # stored as float32
    assert "step" not in tags and not any(t.startswith("peak_mem_bytes_per_rank") for t in tags)  # lists left out


def test_tensorboard_missing_refuses_the_run_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    cfg = small_config(tmp_path / "run")
    cfg.run.tensorboard = True
    with pytest.raises(ParatrainError) as refused:
        train(cfg)
    message = str(refused.value)
    assert "pip install tensorboard" in message and "\n" not in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the run directory was claimed


def test_tensorboard_is_a_command_line_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_options(parser)
    assert config_from_args(parser.parse_args(["--tensorboard"])).run.tensorboard is True
    assert config_from_args(parser.parse_args([])).run.tensorboard is False
