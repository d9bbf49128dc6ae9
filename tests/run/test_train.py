"""The training loop: metrics, checkpoint, accumulation and token-weighted loss, multi-process equivalence."""

import json

import pytest
import torch
from safetensors.torch import load_file

from paratrain.config import Config
from paratrain.metrics import read_metrics
from paratrain.models import ModelConfig, Transformer
from paratrain.mesh import MeshShape, build_mesh
from paratrain.run.build import preflight
from paratrain.parallel.api import DataParallel, parallelize
from paratrain.testing import run_on_ranks
from paratrain.train import IGNORE_INDEX, build_model, learning_rate, lr_jump, train, train_step
from paratrain.error_model import FP32_ADAMW
from parallel_cases import assert_matches_reference


def small_config(out, **train_overrides) -> Config:
    cfg = Config()
    cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 2, 64, 4, 2, 128
    cfg.data.seq_len = 32
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch = 6, 8, 8
    cfg.train.warmup_steps, cfg.train.eval_every, cfg.train.eval_batches, cfg.train.sample_tokens = 2, 3, 2, 16
    cfg.train.peak_flops = 1e12  # a CPU has no peak in paratrain.hardware's table: MFU needs one given
    for key, value in train_overrides.items():
        setattr(cfg.train, key, value)
    cfg.run.out, cfg.run.progress = str(out), False
    return cfg


def test_run_writes_metrics_config_and_final_weights(tmp_path):
    cfg = small_config(tmp_path / "run")
    resolved = preflight(cfg, 1).cfg  # the options the run uses: every default resolved, `cfg` left as it is
    result = train(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    for key in ["loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes"]:
        assert all(r[key] > 0 for r in records), key
    assert all(r["tokens"] == 8 * 32 for r in records)
    assert {r["step"] for r in records if "eval_loss" in r} == {3, 6}
    for r in records:  # the breakdown splits the step's time, checkpoint saves apart
        b = r["time_breakdown_s"]
        parts = (b["compute_s"] + b["optimizer_s"] + b["data_s"] + sum(b["comm_exposed_s"].values())
                 + b["pipeline_wait_s"] + b["other_s"])
        assert parts == pytest.approx(r["step_time_s"], abs=1e-6) and b["compute_s"] > 0
    assert records[-1]["loss"] < records[0]["loss"]
    assert result.final_loss == records[-1]["loss"] and result.sample
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert Config.from_dict(saved) == resolved

    model_cfg = ModelConfig(**json.loads((tmp_path / "run" / "final" / "model_config.json").read_text()))
    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    model = Transformer(model_cfg)
    model.load_state_dict(weights, strict=True)
    assert not torch.equal(weights["layers.0.attention.wq.weight"],
                           build_model(model_cfg, torch.device("cpu"), 0).layers["0"].attention.wq.weight)


def test_refuses_to_mix_two_runs_in_one_directory(tmp_path):
    train(small_config(tmp_path / "run", steps=1))
    with pytest.raises(ValueError, match="already holds a run"):
        train(small_config(tmp_path / "run", steps=1))


def test_learning_rate_schedule():
    cfg = small_config("unused", steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert learning_rate(5, cfg) == pytest.approx(0.5)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(100, cfg) == pytest.approx(0.1)
    assert 0.1 < learning_rate(55, cfg) < 1.0


@pytest.mark.parametrize("steps, warmup", [(6, 2), (4, 0), (100, 10)])
def test_a_schedule_never_warns_of_its_own_moves(steps, warmup):
    """A short cosine to 0 moves by far more than 10% a step near its end, a warm-up from 0 too: the schedule's."""
    cfg = small_config("unused", steps=steps, warmup_steps=warmup, lr=3e-3, min_lr=0.0)
    lrs = {step: learning_rate(step, cfg) for step in range(1, steps + 1)}
    assert any(abs(lrs[s] - lrs[s - 1]) > 0.1 * lrs[s - 1] for s in range(2, steps + 1))
    assert all(lr_jump(lrs.get(s - 1), lrs[s], s, cfg) == "" for s in range(1, steps + 1))


def test_a_learning_rate_moved_beyond_the_schedule_is_named():
    """The stretched schedule of a stage resumed at step 30 with --steps 40: 3e-4 at step 30, 1.44e-3 at 31."""
    before, after = (small_config("unused", steps=n, warmup_steps=20, lr=3e-3, min_lr=3e-4) for n in (30, 40))
    saved, lr = learning_rate(30, before), learning_rate(31, after)
    assert lr > 4 * saved
    assert "jumps from 0.0003 at step 30 to 0.00144 at step 31" in lr_jump(saved, lr, 31, after)
    assert lr_jump(learning_rate(30, after), lr, 31, after) == ""  # the same steps under one schedule
    assert lr_jump(saved, learning_rate(31, after, start=30), 31, after, start=30) == ""  # --reset lr: a new one
    # 10% beyond the schedule's own move, either way
    own = learning_rate(30, after)
    assert lr_jump(own * 1.09, lr, 31, after) == "" and lr_jump(own * 0.91, lr, 31, after) == ""
    assert lr_jump(own * 1.12, lr, 31, after) and lr_jump(own * 0.88, lr, 31, after)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_resumed_run_continues_its_schedule_without_a_warning(tmp_path, capsys, optimizer):
    """Muon's group holds the learning rate scaled by its own peak: the checkpoint keeps the schedule's."""
    import shutil

    cfg = small_config(tmp_path / "run", steps=4, warmup_steps=1, sample_tokens=0, eval_every=0, optimizer=optimizer)
    cfg.checkpoint.every = 2
    train(cfg)
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-00000004")
    capsys.readouterr()
    train(cfg)  # --resume auto: from step 2
    out = capsys.readouterr()
    assert "resumed from" in out.out and "jumps" not in out.out + out.err
    assert [r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [r["lr"] for r in first]


def _tiny_model(seed=0):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    return build_model(cfg, torch.device("cpu"), seed)


def _uneven_batch(generator):
    inputs = torch.randint(0, 64, (4, 16), generator=generator)
    labels = torch.randint(0, 64, (4, 16), generator=generator)
    for row, keep in enumerate([16, 3, 9, 1]):  # very different token counts per sequence
        labels[row, keep:] = IGNORE_INDEX
    return inputs, labels


def _accumulation(rank, world):
    mesh = build_mesh(MeshShape(dp=world))
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    whole, opt_whole = parallelize(_tiny_model(), mesh, optimizer=adamw, data=DataParallel(grad_reduction="sum"))
    split, opt_split = parallelize(_tiny_model(), mesh, optimizer=adamw, data=DataParallel(grad_reduction="sum"))
    inputs, labels = _uneven_batch(torch.Generator().manual_seed(0))
    steps = []
    for _ in range(3):
        whole_step = train_step(whole, opt_whole, [(inputs, labels)], 1.0)
        micro = [(inputs[i:i + 1], labels[i:i + 1]) for i in range(4)]
        steps.append((whole_step, train_step(split, opt_split, micro, 1.0)))
    return steps, list(whole.module.parameters()), list(split.module.parameters())


def test_accumulation_with_uneven_masks_equals_one_batch():
    """Token-weighted loss: 4 micro-batches of 1 equal one batch of 4, padding included; losses and parameters
    under the parity tests' error model (paratrain.error_model.FP32_ADAMW: after AdamW, element by element, one of 512
    differs by 1.4e-6 on the default CPU kernel path)."""
    steps, whole, split = run_on_ranks(_accumulation, 1, timeout=60)[0]
    for whole_step, split_step in steps:
        assert whole_step.tokens == 16 + 3 + 9 + 1
        assert split_step.grad_norm == pytest.approx(whole_step.grad_norm, rel=1e-5)
    assert_matches_reference([s.loss for _, s in steps], dict(enumerate(split)), [w.loss for w, _ in steps],
                             dict(enumerate(whole)), FP32_ADAMW)


ZERO_STAGES = [0, 1, 2, 3]


def _train_on_ranks(rank, world_size, root, accumulate):
    """A run for every ZeRO stage, one after another on the same ranks, each in its own directory."""
    for zero in ZERO_STAGES:
        cfg = small_config(f"{root}/zero{zero}", steps=4, micro_batch=8 // world_size // accumulate)
        cfg.parallel.zero = zero
        train(cfg)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The metrics of one process trained as the two-rank runs are: one run for every ZeRO stage."""
    out = tmp_path_factory.mktemp("one")
    train(small_config(out, steps=4))
    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The directory holding each ZeRO stage's run on two data ranks with accumulation, all in one launch."""
    root = tmp_path_factory.mktemp("two")
    run_on_ranks(_train_on_ranks, 2, str(root), 2, timeout=240)
    return root


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_two_processes_match_one(one_process, two_processes, zero):
    """Two data ranks with accumulation give the losses of one process with the same global batch."""
    reference = one_process
    records = read_metrics(two_processes / f"zero{zero}" / "metrics.jsonl")
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    assert all(r["comm_bytes"]["dp"] > 0 and len(r["peak_mem_bytes_per_rank"]) == 2 for r in records)
    assert "dp" not in reference[0]["comm_bytes"], "one process communicates nothing"


def _held_out_text(path, size: int = 5000):
    """A text file whose held-out part is 3 sequences of 32 byte tokens (2 % of 5001 tokens: 101, 3 windows)."""
    words = [f"line {i} of a small corpus, word {i * 7 % 13}.\n" for i in range(size)]
    path.write_text("".join(words)[:size])
    return str(path)


def _evaluate_on_ranks(rank, world_size, out, data, zero):
    cfg = small_config(out, steps=2, global_batch=2, micro_batch=1, eval_every=0, sample_tokens=0)
    cfg.data.path, cfg.parallel.zero = data, zero
    cfg.reliability.pg_timeout_s = 10.0  # a rank that runs one forward more fails in seconds, not in 10 minutes
    return train(cfg).eval_loss


def test_zero3_evaluates_a_held_out_set_the_data_ranks_cannot_split_evenly(tmp_path):
    """3 held-out sequences over 2 data ranks of micro-batch 1: every rank runs the same forwards (ZeRO-3 gathers
    parameters in each), and the eval loss is one process's, token-weighted over the real sequences."""
    from paratrain.data import build_dataset

    data = _held_out_text(tmp_path / "small.txt")
    held_out = build_dataset(data, "byte", 32, None, progress=False)[1]
    assert len(held_out) == 3, "the held-out set is not divisible by dp × micro-batch = 2"
    cfg = small_config(tmp_path / "one", steps=2, global_batch=2, micro_batch=1, eval_every=0, sample_tokens=0)
    cfg.data.path = data
    one = train(cfg)
    losses = run_on_ranks(_evaluate_on_ranks, 2, str(tmp_path / "two"), data, 3, timeout=90)
    assert losses == pytest.approx([one.eval_loss] * 2, rel=1e-5)


def _four_layers(out, **train_overrides) -> Config:
    cfg = small_config(out, steps=4, **train_overrides)
    cfg.model.n_layers = 4  # room for 2 stages × 2 virtual stages
    return cfg


def _train_layout(rank, world_size, out, parallel):
    cfg = _four_layers(out, micro_batch=2)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    result = train(cfg)
    return result.sample, result.eval_loss


LAYOUTS = {
    "dp2_tp2_sp_zero1": {"tp": 2, "sequence_parallel": True, "zero": 1},
    "dp2_tp2_zero3": {"tp": 2, "zero": 3},
    "pp2_dp2_1f1b_zero1": {"pp": 2, "zero": 1, "schedule": "1f1b"},
    "pp2_tp2_interleaved": {"pp": 2, "tp": 2, "schedule": "interleaved", "virtual_stages": 2},
}


def _train_layouts(rank, world_size, root):
    """Every layout's run, one after another on the same 4 ranks, each in its own directory."""
    return {name: _train_layout(rank, world_size, f"{root}/{name}", parallel) for name, parallel in LAYOUTS.items()}


@pytest.fixture(scope="module")
def one_process_four_layers(tmp_path_factory):
    """One process's run of the four-layer model and its metrics: the reference of every layout."""
    out = tmp_path_factory.mktemp("one_four_layers")
    return train(_four_layers(out)), read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The runs of every layout in one launch of 4 ranks (each rank process pays seconds of start-up): the
    directory holding each layout's run, and each rank's results by layout."""
    root = tmp_path_factory.mktemp("four")
    return root, run_on_ranks(_train_layouts, 4, str(root), timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_trainer_matches_one_process(one_process_four_layers, four_ranks, name):
    """`paratrain train` on 4 ranks: the losses and eval loss of one process, one text sample on every rank."""
    one, reference = one_process_four_layers
    root, by_rank = four_ranks
    results = [layouts[name] for layouts in by_rank]
    records = read_metrics(root / name / "metrics.jsonl")
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    assert [eval_loss for _, eval_loss in results] == pytest.approx([one.eval_loss] * 4, rel=1e-5)
    axes = {axis for axis in ("dp", "tp", "pp") if LAYOUTS[name].get(axis, 1) > 1 or axis == "dp" and
            4 // (LAYOUTS[name].get("tp", 1) * LAYOUTS[name].get("pp", 1)) > 1}
    assert all(r["comm_bytes"].get(axis, 0) > 0 for r in records for axis in axes)
    samples = [sample for sample, _ in results]
    assert samples[0] and len(set(samples)) == 1, "every rank samples the same text"
