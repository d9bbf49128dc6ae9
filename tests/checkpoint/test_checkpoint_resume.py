"""The trainer's checkpoints without a launcher: resume, damaged checkpoints, refusals, disk full, and the step guards.

One-process runs call `paratrain train` in this process (`cli.main`); the two-rank runs (resumes on
other layouts, and the guards: non-finite steps, diverged replicas, per-rank RNG state) run `train()`
on `run_on_ranks`, one launch for all of them. The faults are real: PARATRAIN_FAULT, damaged files.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain.checkpoint import CheckpointReader, list_checkpoints, verify_checkpoint
from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.run.diagnose import FingerprintRing, describe
from paratrain.comm import CallRecord
from paratrain.faults import FAULT_ENV
from paratrain.run.guard import TrainingAborted
from paratrain.mesh import MeshShape
from paratrain.metrics import read_metrics
from paratrain.testing import run_on_ranks

TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress"]
RUN = [*TINY, "--steps", "8", "--checkpoint-every", "4"]


def train_cli(out, *extra, env: dict | None = None, monkeypatch=None) -> int:
    if env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    try:
        return main(["train", *RUN, "--out", str(out), *extra])
    finally:
        for key in env or {}:
            monkeypatch.delenv(key)


def weights(out) -> dict[str, torch.Tensor]:
    return load_file(Path(out) / "final" / "model.safetensors")


def loss_hex(out) -> list[str]:
    return [float.hex(r["loss"]) for r in read_metrics(Path(out) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """An 8-step one-process run with checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", *RUN, "--out", str(out)]) == 0
    return out


def _truncate(path: Path):
    data = (path / "rank-00000.safetensors").read_bytes()
    (path / "rank-00000.safetensors").write_bytes(data[:len(data) // 2])


def _flip(path: Path):
    data = bytearray((path / "rank-00000.safetensors").read_bytes())
    data[len(data) - 9] ^= 0xFF
    (path / "rank-00000.safetensors").write_bytes(bytes(data))


DAMAGE = {
    "truncated_shard": (_truncate, r"rank-00000.safetensors size \d+ ≠ expected \d+"),
    "flipped_byte": (_flip, "checksum mismatch in rank-00000.safetensors"),
    "deleted_shard": (lambda p: (p / "rank-00000.safetensors").unlink(), "rank-00000.safetensors is missing"),
    "garbage_index": (lambda p: (p / "index.json").write_text("{ not json"), "index.json size"),
    "garbage_manifest": (lambda p: (p / "manifest.json").write_text("garbage"), "manifest.json is not valid JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_and_refused_when_named(base_run, tmp_path, damage,
                                                                                      capsys):
    damage_fn, message = DAMAGE[damage]
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    damage_fn(out / "checkpoints" / "step-00000008")
    capsys.readouterr()
    assert main(["train", *RUN, "--resume", str(out / "checkpoints" / "step-00000008"),
                 "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert main(["train", *RUN, "--out", str(out)]) == 0  # auto: falls back to step 4, redoes 5..8
    captured = capsys.readouterr()
    assert re.search(f"warning: step-00000008 invalid: .*{message}", captured.err), captured.err
    assert "resumed from" in captured.out and "step-00000004 at step 4" in captured.out
    assert loss_hex(out) == loss_hex(base_run)
    assert all(torch.equal(a, b) for a, b in zip(weights(out).values(), weights(base_run).values()))
    verify_checkpoint(out / "checkpoints" / "step-00000008")  # saved again, in place of the damaged one


def test_resuming_into_another_model_is_refused_naming_the_option(base_run, tmp_path, capsys):
    """The checkpoint carries its model's config (`paratrain.run.carried`): a size option that disagrees is refused
    before anything is built. (A tensor of another shape is refused naming it: test_checkpoint_reshard.)"""
    wider = list(RUN)
    wider[wider.index("--dim") + 1] = "64"
    code = main(["train", *wider, "--resume", str(base_run / "checkpoints" / "step-00000004"),
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.strip() == ("paratrain train: error: --dim 64 disagrees with the model step-00000004 was saved with "
                           "(dim=32); drop --dim: the checkpoint sets the shape"), err


def test_resuming_into_the_out_of_another_run_is_refused(base_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    assert main(["train", *RUN, "--lr", "0.001", "--out", str(out)]) == 2
    assert "holds another run (train.lr is 0.003 there, 0.001 here)" in capsys.readouterr().err
    assert main(["train", *RUN, "--resume", "none", "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    other = tmp_path / "other"
    assert main(["train", *RUN, "--steps", "4", "--out", str(other)]) == 0
    capsys.readouterr()
    assert main(["train", *RUN, "--resume", str(other / "checkpoints" / "step-00000004"), "--out", str(out)]) == 2
    assert "but --resume" in capsys.readouterr().err
    assert main(["train", *RUN, "--overwrite", "--steps", "2", "--out", str(out)]) == 0  # a new run replaces it
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert not (out / "checkpoints" / "step-00000008").exists()


def _resume(rank, world, out, *extra):
    from paratrain.train import train

    train(config_from_args(build_parser().parse_args(["train", *RUN, "--out", out, *extra])))


@pytest.mark.slow
def test_a_run_continues_exactly_on_another_number_of_data_ranks(base_run, on_two_ranks):
    """Saved by one process at step 4, resumed by two: the same global batches, so the same losses."""
    out = on_two_ranks["dp"]
    records, expected = read_metrics(out / "metrics.jsonl"), read_metrics(base_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert loss_hex(out)[:4] == loss_hex(base_run)[:4]
    assert [r["loss"] for r in records[4:]] == pytest.approx([r["loss"] for r in expected[4:]], rel=1e-5)
    layout = CheckpointReader(out / "checkpoints" / "step-00000008").shared_state()["layout"]
    assert (layout["dp"], layout["accumulation"]) == (2, 1), "2 ranks × 1 micro-batch keep the global batch of 4"


@pytest.mark.slow
def test_a_run_continues_exactly_under_hybrid_sharding(base_run, tmp_path):
    """Saved by one process at step 4, resumed by 2 replicas × 2 shards of ZeRO-3: the same losses, and the
    step-8 checkpoint (written by the first replica only) records the split."""
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    shutil.rmtree(out / "checkpoints" / "step-00000008")
    run_on_ranks(_resume, 4, str(out), "--zero", "3", "--dp-shard", "2", "--micro-batch", "1", timeout=180)
    records, expected = read_metrics(out / "metrics.jsonl"), read_metrics(base_run / "metrics.jsonl")
    assert [r["loss"] for r in records[4:]] == pytest.approx([r["loss"] for r in expected[4:]], rel=1e-5)
    assert set(records[-1]["comm_bytes"]) >= {"dp_shard", "dp_replicate"}
    reader = CheckpointReader(out / "checkpoints" / "step-00000008")
    assert {k: reader.shared_state()["layout"][k] for k in ("dp", "dp_shard", "zero")} == {"dp": 4, "dp_shard": 2,
                                                                                          "zero": 3}
    writers = {box.file for name in reader.names() for box in reader.boxes(name)}
    assert writers == {"rank-00000.safetensors", "rank-00001.safetensors"}, writers  # dp_replicate coordinate 0


# (model options, the parallel layout's options, the axis it talks on, its degrees in the checkpoint's layout record)
SPLIT_RUNS = {
    "ep2": (("--model", "tiny-moe"), ("--ep", "2"), "ep", {"dp": 2, "ep": 2}, "dp=2 tp=1 pp=1 ep=2"),
    "cp2": ((), ("--cp", "2"), "cp", {"dp": 1, "cp": 2}, "dp=1 tp=1 pp=1 cp=2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPLIT_RUNS))
def test_a_run_continues_exactly_across_expert_and_context_parallelism(name, base_run, on_two_ranks, tmp_path,
                                                                       capsys):
    """Two ranks that each hold half of the experts (--ep 2: a mixture of experts) or half of every sequence
    (--cp 2) lose what one process loses; resumed by one process from their step-4 checkpoint, the run goes on
    losing the same, and the log names the layout it left. The one process's run of the dense model is the
    module's `base_run` (the same command)."""
    model, layout, axis, degrees, described = SPLIT_RUNS[name]
    one, split = (tmp_path / "one" if model else base_run), on_two_ranks[name]
    if model:
        assert main(["train", *RUN, "--out", str(one), *model]) == 0
    expected = [r["loss"] for r in read_metrics(one / "metrics.jsonl")]
    records = read_metrics(split / "metrics.jsonl")
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-5)
    assert records[-1]["comm_bytes"][axis] > 0, f"the run talked on {axis}"
    saved = CheckpointReader(split / "checkpoints" / "step-00000004").shared_state()["layout"]
    assert {key: saved[key] for key in degrees} == degrees
    shutil.rmtree(split / "checkpoints" / "step-00000008")
    capsys.readouterr()
    assert main(["train", *RUN, "--out", str(split), *model]) == 0
    assert f"layout changed from {described} zero=0 fp32 on 2 process(es) to dp=1" in capsys.readouterr().out
    records = read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-5)


def test_a_layout_that_no_longer_fits_names_the_checkpoints_layout(base_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    assert main(["train", *RUN, "--tp", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("world size 1 is not divisible by tp × pp = 2 × 1" in err and "(the checkpoint to resume, "
            "step-00000008, was saved with dp=1 tp=1 pp=1 zero=0 fp32 on 1 process(es)") in err, err


def test_disk_full_while_saving_fails_clearly_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    code = train_cli(out, env={FAULT_ENV: "ckpt_enospc@rank0:step8"}, monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2
    assert ("saving step-00000008 failed: rank 0: no space left on device while writing rank-00000.safetensors; "
            "last good checkpoint step-00000004 intact") in err, err
    verify_checkpoint(out / "checkpoints" / "step-00000004")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000004"]


def test_out_of_memory_in_a_step_ends_with_one_line_and_a_hint(tmp_path, capsys, monkeypatch):
    code = train_cli(tmp_path / "run", env={FAULT_ENV: "oom@rank0:step2"}, monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("paratrain train: rank 0 ran out of memory at step 2 (injected fault: out of memory at "
                          "rank 0, step 2); lower --micro-batch or --seq-len") and err.count("\n") == 1, err


def test_a_crash_while_an_async_save_is_in_flight_abandons_it_and_resumes_from_the_previous(base_run, tmp_path,
                                                                                             monkeypatch, capsys):
    """The save of step 4 takes 2 s more (a slowed writer); step 5 raises while it is in flight."""
    out, args = tmp_path / "run", ("--checkpoint-async", "--checkpoint-every", "2")
    with pytest.raises(RuntimeError, match="injected fault: raise at rank 0, step 5"):
        train_cli(out, *args, env={FAULT_ENV: "ckpt_slow_write@rank0:step4,raise@rank0:step5"},
                  monkeypatch=monkeypatch)
    assert ("step-00000004 was being saved when the run failed: abandoned before its commit; `latest` stays at "
            "the newest committed checkpoint") in capsys.readouterr().out
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"], "no commit, no leftover"
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert train_cli(out, *args) == 0
    assert "checkpoints/step-00000002 at step 2" in capsys.readouterr().out
    assert loss_hex(out) == loss_hex(base_run)
    assert all(torch.equal(a, b) for a, b in zip(weights(out).values(), weights(base_run).values()))


# -- the step guards, on two ranks, one launch -----------------------------------------------------

def _train(out, *extra, fault: str = ""):
    from paratrain.train import train

    os.environ[FAULT_ENV] = fault
    cfg = config_from_args(build_parser().parse_args(["train", *TINY, "--steps", "6", "--out", str(out), *extra]))
    try:
        return train(cfg)
    except TrainingAborted as e:
        return str(e)


def _guards(rank, world, root):
    root = Path(root)
    results = {
        "skip": _train(root / "skip", "--checkpoint-every", "6", fault="nan@rank1:step3"),
        "abort_in_a_row": _train(root / "row", "--max-bad-steps", "2", fault="nan@rank1:step3,nan@rank1:step4"),
        "abort_policy": _train(root / "abort", "--nan-policy", "abort", fault="infgrad@rank1:step2"),
        "perturb": _train(root / "perturb", "--check-every", "3", fault="perturb@rank1:step3"),
    }
    torch.manual_seed(100 + rank)  # each rank's RNG in its own state, saved at step 2
    saved = torch.get_rng_state()
    _train(root / "rng", "--checkpoint-every", "2", "--keep-latest", "0")
    torch.manual_seed(0)
    _train(root / "rng", "--checkpoint-every", "2", "--keep-latest", "0", "--load-step", "2")  # rewinds to step 2
    results["rng"] = (torch.equal(torch.get_rng_state(), saved),
                      torch.equal(saved, CheckpointReader(root / "rng" / "checkpoints" / "step-00000002")
                                  .rank_state(rank)["rng"]["torch"]))
    results = {k: v if isinstance(v, (str, tuple)) else "finished" for k, v in results.items()}
    # pp2, the `nan` fault on the last stage (rank 1): whether either stage aborted
    results["pp"] = _train(root / "pp", "--pp", "2", "--checkpoint-every", "6", fault="nan@rank1:step3")
    return results


def _on_two_ranks(rank, world, runs, root):
    """Each of `runs` (its --out, then its options), then the step guards' runs in `root`."""
    for out, *extra in runs:
        _resume(rank, world, out, *extra)
    return _guards(rank, world, root)


@pytest.fixture(scope="module")
def on_two_ranks(base_run, tmp_path_factory) -> dict:
    """The module's runs on two ranks, one launch: `base_run` resumed from step 4 ("dp"), each of SPLIT_RUNS from
    the start (by name), and the step guards' runs ("guards": their directory and each rank's results)."""
    root = tmp_path_factory.mktemp("two-ranks")
    runs = {"dp": root / "dp", **{name: root / name for name in SPLIT_RUNS}}
    shutil.copytree(base_run, runs["dp"])
    shutil.rmtree(runs["dp"] / "checkpoints" / "step-00000008")
    options = [(str(runs["dp"]),), *[(str(runs[name]), *model, *layout)
                                     for name, (model, layout, *_) in SPLIT_RUNS.items()]]
    results = run_on_ranks(_on_two_ranks, 2, options, str(root / "guards"), timeout=480)
    return {**runs, "guards": (root / "guards", results)}


@pytest.mark.slow
def test_step_guards_on_two_ranks(on_two_ranks):
    tmp_path, results = on_two_ranks["guards"]
    results = [{k: v for k, v in r.items() if k != "pp"} for r in results]
    assert results[0] == results[1], "every rank takes the same decisions"
    r = results[0]
    assert r["skip"] == "finished"
    records = read_metrics(tmp_path / "skip" / "metrics.jsonl")
    assert [x["skipped_nonfinite"] for x in records] == [0, 0, 1, 1, 1, 1]
    assert records[2]["loss"] != records[2]["loss"]  # NaN, logged, not applied:
    step = CheckpointReader(tmp_path / "skip" / "checkpoints" / "step-00000006").read("optim/output.weight/step")
    assert step.item() == 5, "one of the six steps was skipped by the optimizer"
    assert r["abort_in_a_row"] == ("non-finite loss/grad at step 4 (rank 1): 2 steps in a row skipped "
                                   "(--max-bad-steps 2)")
    assert r["abort_policy"] == ("non-finite loss/grad at step 2 (rank 1); the step was not applied "
                                 "(--nan-policy abort)")
    assert r["perturb"].startswith("replicas diverged at step 3: rank 1 hold(s) parameters that differ")
    assert r["rng"] == (True, True), "each rank's RNG state came back to that rank"
    rng = [CheckpointReader(tmp_path / "rng" / "checkpoints" / "step-00000002").rank_state(k)["rng"]["torch"]
           for k in (0, 1)]
    assert not torch.equal(*rng)


@pytest.mark.slow
def test_the_non_finite_guard_fires_in_a_pipeline_run(on_two_ranks):
    """pp2, the `nan` fault on the last stage (rank 1): step 3 is skipped on every rank, both stages."""
    tmp_path, results = on_two_ranks["guards"]
    results = [r["pp"] for r in results]
    assert all(not isinstance(r, str) for r in results), results  # neither rank aborted
    records = read_metrics(tmp_path / "pp" / "metrics.jsonl")
    assert [x["skipped_nonfinite"] for x in records] == [0, 0, 1, 1, 1, 1]
    assert records[2]["loss"] != records[2]["loss"]  # NaN, logged, not applied
    ckpt = CheckpointReader(tmp_path / "pp" / "checkpoints" / "step-00000006")
    for stage_param in ("tok_embeddings.weight", "output.weight"):  # stage 0 (rank 0) and stage 1 (rank 1)
        assert ckpt.read(f"optim/{stage_param}/step").item() == 5, f"{stage_param}: one of six steps skipped"


# -- diagnostics of a failed collective, from fingerprint files ------------------------------------

def _fingerprints(directory: Path, calls: dict[int, list[tuple[int, ...]]], steps: dict[int, int]) -> None:
    """Rank r issued all_reduce over dp of shape calls[r][i] as call i + 1, and is now at steps[r]."""
    for rank, shapes in calls.items():
        ring = FingerprintRing(directory, rank)
        ring.set_step(4)
        for seq, shape in enumerate(shapes, start=1):
            ring(CallRecord(seq, "all_reduce", "dp", shape, "float32", 0.0))
        ring.set_step(steps[rank])
        ring.close()


def test_fingerprints_name_the_first_divergence_and_the_rank_that_never_came(tmp_path):
    shape, calls = MeshShape(dp=3), [(2,)] * 79  # more calls than a ring keeps
    _fingerprints(tmp_path / "a", {0: calls, 1: calls[:74] + [(3,)] + calls[75:], 2: calls}, {0: 4, 1: 4, 2: 4})
    report = describe(tmp_path / "a", 0, shape)
    assert report.startswith("rank 0 failed at step 4, its last collective #79 all_reduce over dp shape [2]")
    assert report.endswith("collectives diverged at call #75: rank(s) [0, 2] #75 all_reduce over dp shape [2] "
                           "float32 (step 4) vs rank(s) [1] #75 all_reduce over dp shape [3] float32 (step 4)")
    _fingerprints(tmp_path / "b", {0: calls, 1: calls, 2: calls[:70]}, {0: 4, 1: 4, 2: 5})
    assert describe(tmp_path / "b", 1, shape).endswith(
        "rank 2 never issued call #79 (all_reduce over dp shape [2]): its last was #70 all_reduce over dp shape [2] "
        "float32 (step 4) and it is at step 5, hung or dead outside a collective")


class _SimulatedGPUs:
    """torch.cuda's RNG functions over `count` visible devices, `current` this process's (torch.cuda.set_device's)."""

    def __init__(self, count: int, current: int):
        self.count, self.current = count, current
        self.states = {i: torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(count)}

    def _index(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        index = self.current if index is None else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def get_rng_state(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set_rng_state(self, new_state, device="cuda"):
        self.states[self._index(device)] = new_state.clone()

    def install(self, monkeypatch) -> None:
        # torch.cuda.random's own *_all functions call the names bound in that module.
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
            monkeypatch.setattr(module, "device_count", lambda: self.count)
            monkeypatch.setattr(module, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_a_rank_saves_its_own_gpus_rng_state_and_restores_it_where_fewer_gpus_are_visible(tmp_path, monkeypatch):
    """Saved as rank 1 of a machine with 2 visible GPUs (its own: cuda:1), restored where each process sees only
    its own GPU (CUDA_VISIBLE_DEVICES per rank: cuda:0), through a checkpoint's per-rank state."""
    from paratrain.checkpoint import LocalCoordinator, save_checkpoint
    from paratrain.run.checkpoints import rng_state, set_rng_state

    saving = _SimulatedGPUs(count=2, current=1)
    saving.install(monkeypatch)
    path = save_checkpoint(tmp_path, 1, {}, {"rng": rng_state()}, {}, coordinator=LocalCoordinator())

    restoring = _SimulatedGPUs(count=1, current=0)
    restoring.install(monkeypatch)
    set_rng_state(CheckpointReader(path).rank_state(0)["rng"])
    assert torch.equal(restoring.states[0], saving.states[1]), "restored to this rank's device"
    saved = CheckpointReader(path).rank_state(0)["rng"]["cuda"]
    assert torch.equal(saved, saving.states[1]), "this rank's device only, not every visible GPU's"


def test_a_run_checkpoints_by_the_clock_and_at_the_end_without_being_asked(tmp_path, monkeypatch, capsys):
    """The default policy (every 30 min of wall clock, and the last step), on a clock that the test moves 10 minutes
    at each reading: the start, then each step's agreement (rank 0's verdict), then each save."""
    import paratrain.run.checkpoints as checkpoints

    now = iter(range(0, 10**6, 600))
    monkeypatch.setattr(checkpoints, "_clock", lambda: next(now))
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "8", "--keep-latest", "0", "--out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "checkpoints every 30 min and at the end" in first, first
    # Readings: 0 at the start; steps 1, 2, 3 at 600, 1200, 1800 (due: saved, reading 2400); steps 4, 5, 6 at 3000,
    # 3600, 4200 (due); steps 7, 8 at 5400, 6000 and the last step saved.
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-00000003", "step-00000006",
                                                                      "step-00000008"]
    off = tmp_path / "off"
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-every", "0", "--out", str(off)]) == 0
    assert "checkpoints off (--checkpoint-every 0)" in capsys.readouterr().out.splitlines()[0]
    assert not list_checkpoints(off / "checkpoints")


def test_resume_takes_what_a_user_points_at_and_continues_the_run_with_its_own_config(tmp_path, capsys):
    """A run directory, its checkpoints/, its `latest`, its final/: each means the newest complete checkpoint; with
    no other flag the run continues in its own directory with its own options, the same losses as unbroken."""
    from paratrain.config import Config
    from paratrain.run.checkpoints import resolve_resume

    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "6", "--checkpoint-every", "3", "--out", str(run)]) == 0
    unbroken = [r["loss"] for r in read_metrics(run / "metrics.jsonl")]
    for pointer in (run, run / "checkpoints", run / "checkpoints" / "latest", run / "final"):
        cfg = Config()
        cfg.checkpoint.resume = str(pointer)
        resolved, note = resolve_resume(cfg)
        assert "newest complete checkpoint is step-00000006" in note
        assert resolved.checkpoint.resume == str(run / "checkpoints" / "step-00000006") and resolved.run.out == str(run)
        assert cfg.checkpoint.resume == str(pointer) and cfg.run.out == "", "the given config is left as it is"
    torn = next((run / "checkpoints" / "step-00000006").glob("*.safetensors"))
    torn.write_bytes(torn.read_bytes()[:-1])
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step-00000006 is torn" in out and "the one before it is used" in out, out
    assert re.search(r"resumed from \S+step-00000003 at step 3 \(saved \d{4}-\d\d-\d\d \d\d:\d\d UTC by dp=1 tp=1 pp=1 "
                     r"zero=0 fp32 on 1 process\(es\)\)", out), out
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl")] == unbroken

    # A longer schedule under the checkpoint: refused before anything runs, naming --reset lr.
    assert main(["train", "--resume", str(run), "--steps", "9"]) == 2
    err = capsys.readouterr().err
    assert "--steps 9 changes the learning-rate schedule" in err and "--reset lr" in err, err

    off = tmp_path / "off"
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-every", "0", "--out", str(off)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(off)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint was written" in err and "checkpoints were off in that run (--checkpoint-every 0)" in err, err
