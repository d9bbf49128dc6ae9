"""`paratrain report`: figures and summary of real and synthetic run directories, overlays, errors."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main
from paratrain.config import Config
from paratrain.models import get_model_config
from paratrain.commands.report import (
    comm_figure,
    format_summary,
    load_run,
    load_runs,
    loss_figure,
    memory_figure,
    run_summary,
)
from paratrain.commands.report_plan import planned_comm
from paratrain.train import train

FIGURES = ["loss.png", "throughput.png", "memory.png", "comm.png"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """Four steps of the trainer, in this process, on a small model; evaluated at steps 2 and 4."""
    cfg = Config()
    cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 2, 64, 4, 2, 128
    cfg.data.seq_len = 32
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch = 4, 8, 8
    cfg.train.eval_every, cfg.train.eval_batches, cfg.train.sample_tokens = 2, 2, 0
    out = tmp_path_factory.mktemp("runs") / "single"
    cfg.run.out, cfg.run.progress = str(out), False
    train(cfg)
    return out


def write_run(path, dp=2, zero=3, pp=None, steps=5, breakdown=True):
    """A run directory as a data-parallel run writes it, with known numbers."""
    path.mkdir(parents=True)
    parallel = {"dp": dp, "zero": zero, "precision": "bf16", "reduce_dtype": "fp32"}
    if pp:
        parallel["pp"] = pp
    config = {"parallel": parallel, "train": {"global_batch": 16, "micro_batch": 2}, "run": {"nproc": dp}}
    (path / "config.json").write_text(json.dumps(config))
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": 5.0 - 0.5 * step, "tokens_seen": 512 * step,
                      "tokens_per_s": 1000.0 * step, "mfu": 0.01 * step,
                      "peak_mem_bytes_per_rank": [(100 + r + step) * 10**6 for r in range(dp)],
                      "comm_bytes": {"dp": 3 * 10**6}}
            if step % 2 == 0:
                record["eval_loss"] = 4.9 - 0.5 * step
            if breakdown:
                record["resident_bytes"] = {"params": 10**6, "grads": 2 * 10**6, "master": 0,
                                            "optimizer": 4 * 10**6, "total": 7 * 10**6}
            f.write(json.dumps(record) + "\n")
    return path


def test_communication_is_drawn_against_the_planners_estimate(tmp_path):
    """A dp2 ZeRO-2 fp32 run of `tiny`, 4 micro-batches per rank: the planner says a reduce-scatter of
    Ψ(N-1)/N fp32 gradients after each micro-batch and one all-gather of the parameters, 4·2Ψ + 2Ψ bytes."""
    run_dir = write_run(tmp_path / "zero2", zero=2)
    config = Config().to_dict()
    config["parallel"].update(dp=2, zero=2)
    config["train"].update(global_batch=16, micro_batch=2)
    (run_dir / "config.json").write_text(json.dumps(config))
    run = load_run(run_dir)
    assert planned_comm(run)["dp"] == 10 * get_model_config("tiny").num_params()
    assert "comm MB/step: dp 3.00 (plan 31.64)" in format_summary([run])
    _, labels = comm_figure([run]).axes[0].get_legend_handles_labels()
    assert labels == ["estimate of paratrain plan", "zero2 (dp2,zero2)"]


@pytest.fixture
def only_the_optional_figures(monkeypatch):
    """`write_report` draws the figures of some runs only (experts, ranks, the pipeline's timeline) and skips the four
    every report draws (`test_report_of_a_real_run` and the overlay test check those): for the tests that check the
    others or the summary."""
    from paratrain.commands import report

    monkeypatch.setattr(report, "FIGURES", {})


def assert_figures(directory, names=FIGURES):
    for name in names:
        data = (directory / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 8_000, f"{name} is only {len(data)} bytes"


def test_report_of_a_real_run(real_run, capsys):
    assert main(["report", str(real_run)]) == 0
    assert_figures(real_run / "report", [*FIGURES, "ranks.png"])
    out = capsys.readouterr().out
    assert "single (dp1): 4 steps" in out
    assert "eval loss" in out and "(step 4)" in out
    assert "comm MB/step: none (one process)" in out


def test_summary_numbers(tmp_path):
    run = load_run(write_run(tmp_path / "synthetic"))
    s = run_summary(run)
    assert (s["steps"], s["first_loss"], s["last_loss"], s["eval_step"]) == (5, 4.5, 2.5, 4)
    assert s["eval_loss"] == pytest.approx(2.9)
    assert s["tokens_per_s"] == 3000.0 and s["mfu"] == pytest.approx(0.03)
    assert s["peak_mem_bytes"] == 106 * 10**6  # rank 1 at the last step
    assert s["comm_bytes_per_step"] == {"dp": 3 * 10**6}
    text = format_summary([run])
    assert "synthetic (dp2,zero3,bf16): 5 steps, loss 4.5000 -> 2.5000" in text
    assert "peak memory 106 MB" in text and "comm MB/step: dp 3.00" in text


def test_several_runs_overlay_on_one_figure(real_run, tmp_path, capsys):
    other = write_run(tmp_path / "zero3")
    runs = load_runs([real_run, other])
    _, labels = loss_figure(runs).axes[0].get_legend_handles_labels()
    assert labels == ["single (dp1) train", "single (dp1) eval", "zero3 (dp2,zero3,bf16) train",
                      "zero3 (dp2,zero3,bf16) eval"]
    memory = memory_figure(runs)
    assert len(memory.axes) == 2, "per-rank peaks, and the breakdown the synthetic run logs"
    assert [p.get_height() for p in memory.axes[1].patches] == pytest.approx([1, 2, 4])  # MB by kind

    assert main(["report", str(real_run), str(other), "--out", str(tmp_path / "both")]) == 0
    assert_figures(tmp_path / "both")
    out = capsys.readouterr().out
    assert "single (dp1)" in out and "zero3 (dp2,zero3,bf16)" in out


def test_runs_with_the_same_directory_name_are_told_apart(tmp_path):
    runs = load_runs([write_run(tmp_path / "a" / "run"), write_run(tmp_path / "b" / "run")])
    assert [r.name for r in runs] == ["a/run", "b/run"]


def test_pipeline_runs_get_a_timeline(tmp_path, capsys, only_the_optional_figures):
    run = write_run(tmp_path / "pp", dp=2, pp=2)
    assert main(["report", str(run)]) == 0
    assert_figures(run / "report", ["pipeline-pp.png"])


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: (d / "file.txt").write_text("x") and d / "file.txt", "is not a run directory"),
    (lambda d: d.mkdir(parents=True, exist_ok=True) or d, "has no metrics.jsonl"),
    (lambda d: (d / "metrics.jsonl").write_text("\n") and d, "is empty"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n') and d, "line 1: not valid JSON"),
])
def test_bad_run_directories_are_one_line_and_exit_2(tmp_path, capsys, make, message):
    target = make(tmp_path)
    assert main(["report", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("paratrain report: error: ") and message in err, err


def test_a_partly_written_last_line_is_ignored(tmp_path):
    run = write_run(tmp_path / "killed", steps=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    assert len(load_run(run).records) == 3


def test_without_matplotlib_the_report_says_what_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    run = write_run(tmp_path / "run")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'paratrain[plot]'" in err and err.count("\n") == 1


# -- predicted against measured step time ------------------------------------------------------------


def write_timed_run(path, steps=5):
    """A dp2 ZeRO-1 run of `tiny` whose records carry a known time breakdown."""
    path.mkdir(parents=True)
    config = Config().to_dict()
    config["parallel"].update(dp=2, zero=1)
    config["train"].update(global_batch=16, micro_batch=4)
    config["data"]["seq_len"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            breakdown = {"compute_s": 0.30 + 0.01 * step, "optimizer_s": 0.02, "data_s": 0.001, "checkpoint_s": 0.0,
                         "comm_exposed_s": {"dp": 0.03, "world": 0.002}, "pipeline_wait_s": 0.0, "other_s": 0.004}
            f.write(json.dumps({"step": step, "loss": 4.0, "step_time_s": 0.36 + 0.01 * step,
                                "time_breakdown_s": breakdown}) + "\n")
    return path


def test_summary_puts_the_predicted_step_next_to_the_measured_medians(tmp_path):
    from paratrain.commands.report_plan import predicted_step
    from paratrain.plan import get_hardware

    run = load_run(write_timed_run(tmp_path / "timed"))
    hardware = get_hardware("a100-80gb")
    predicted = predicted_step(run, hardware)
    text = format_summary([run], hardware)
    assert f"step time: measured median 0.390 s, predicted {predicted.total:.3f} s" in text
    assert f"compute                                 0.330{predicted.compute:>12.3f}" in text
    assert f"exposed comm dp                         0.030{predicted.dp_comm:>12.3f}" in text
    assert f"exposed comm world                      0.002{predicted.sync:>12.3f}" in text
    assert "data, checkpoint, other                 0.005           -" in text


def test_prediction_needs_a_profile_and_takes_the_calibrated_one_by_default(tmp_path, capsys, monkeypatch,
                                                                            only_the_optional_figures):
    import dataclasses

    import paratrain.plan
    from paratrain.plan import get_hardware, save_profile

    run_dir = write_timed_run(tmp_path / "timed")
    monkeypatch.setattr(paratrain.plan, "DEFAULT_PROFILE", tmp_path / "none.json")
    assert main(["report", str(run_dir)]) == 0
    assert "predicted step time: needs a hardware profile; run `paratrain plan --calibrate`" in capsys.readouterr().out
    profile = save_profile(dataclasses.replace(get_hardware("h100-80gb"), name="this-machine"), tmp_path / "hw.json")
    monkeypatch.setattr(paratrain.plan, "DEFAULT_PROFILE", profile)
    assert main(["report", str(run_dir)]) == 0
    assert "on this-machine" in capsys.readouterr().out
    assert main(["report", str(run_dir), "--hardware", "a100-80gb"]) == 0
    assert "on a100-80gb" in capsys.readouterr().out
    assert main(["report", str(run_dir), "--hardware", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "hardware profile" in err and "does not exist" in err and len(err.strip().splitlines()) == 1


def test_a_mixture_of_experts_gets_its_expert_load_figure(real_run, tmp_path, capsys, only_the_optional_figures):
    """The load per layer and the aux loss of each step, from the metrics' `moe` entries; none for a dense run."""
    moe = write_run(tmp_path / "moe", dp=2, zero=1)
    records = [json.loads(line) for line in (moe / "metrics.jsonl").read_text().splitlines()]
    with open(moe / "metrics.jsonl", "w") as f:
        for r in records:
            r["moe"] = {"aux_loss": 0.02, "load_max_mean": {"layer0": 1.5, "layer1": 1.2}, "load_max_mean_worst": 1.5,
                        "tokens_per_expert": {"layer0": [3, 1], "layer1": [2, 2]}}
            f.write(json.dumps(r) + "\n")
    assert main(["report", str(moe), "--out", str(tmp_path / "with")]) == 0
    assert (tmp_path / "with" / "experts.png").read_bytes().startswith(PNG_MAGIC)
    assert main(["report", str(real_run), "--out", str(tmp_path / "without")]) == 0
    assert not (tmp_path / "without" / "experts.png").exists()


def test_each_ranks_compute_time_is_drawn_with_the_stragglers_ringed(tmp_path):
    from paratrain.commands.report import ranks_figure

    path = write_run(tmp_path / "slow")
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    with open(path / "metrics.jsonl", "w") as f:
        for r in records:
            r["compute_s_per_rank"] = [0.01, 0.06]
            if r["step"] >= 3:
                r["stragglers"] = [{"rank": 1, "host": "h", "compute_s": 0.06, "median_s": 0.035, "steps": r["step"]}]
            f.write(json.dumps(r) + "\n")
    run = load_run(path)
    ax = ranks_figure([run]).axes[0]
    assert [line.get_label() for line in ax.get_lines()] == [f"{run.label} rank 0", f"{run.label} rank 1"]
    assert list(ax.get_lines()[1].get_ydata()) == [60.0] * 5
    assert ax.collections[0].get_offsets().tolist() == [[3, 60.0], [4, 60.0], [5, 60.0]]
    assert ranks_figure([load_run(write_run(tmp_path / "old"))]) is None  # a run that did not record it


def test_a_run_without_mfu_says_why_and_named_held_out_losses_are_drawn(tmp_path):
    from paratrain.commands.report import throughput_figure

    path = write_run(tmp_path / "cpu")
    lines = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        r["mfu"] = None
        if "eval_loss" in r:
            r["eval_losses"] = {"wiki": r["eval_loss"] + 0.1, "code": r["eval_loss"] - 0.1}
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    runs = load_runs([path])
    util = throughput_figure(runs).axes[1]
    assert not util.lines and not util.axison and "--peak-flops" in util.texts[0].get_text()
    _, labels = loss_figure(runs).axes[0].get_legend_handles_labels()
    assert labels == ["cpu (dp2,zero3,bf16) train", "cpu (dp2,zero3,bf16) eval", "cpu (dp2,zero3,bf16) eval code",
                      "cpu (dp2,zero3,bf16) eval wiki"]
    assert throughput_figure(load_runs([write_run(tmp_path / "gpu")])).axes[1].lines
