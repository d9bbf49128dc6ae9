"""Mixtures of corpora, named held-out sets and training stages (--data "W:A,W:B", --eval-data, --reset).

The mixture's stream is a function of the global sample position (`paratrain.data.mixture`): the
sampler's shares, its independence from the number of data ranks and its resume are checked on the
sampler itself and through `paratrain train` (one process in this one, two on `run_on_ranks`).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paratrain.checkpoint import CheckpointReader
from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.config import Config, resolve_recipe
from paratrain.data import DataError
from paratrain.data.mixture import PERIOD, MixtureSampler, parse_eval_data, parse_mixture, slot_counts
from paratrain.faults import FAULT_ENV
from paratrain.metrics import read_metrics
from paratrain.testing import run_on_ranks
from paratrain.train import learning_rate

TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Three text corpora of different words, each well over what a few steps read."""
    root = tmp_path_factory.mktemp("corpora")
    rng = random.Random(0)
    words = {"web": ["alpha", "beta", "gamma"], "code": ["def", "return", "yield", "pass"], "wiki": ["one", "two"]}
    paths = {}
    for name, vocab in words.items():
        paths[name] = root / f"{name}.txt"
        paths[name].write_text(" ".join(rng.choice(vocab) for _ in range(12000)))
    return paths


# -- the syntax and its refusals ---------------------------------------------------------------------------------

def test_a_mixture_is_weights_and_sources_and_anything_else_is_one_corpus():
    mixture = parse_mixture("0.7:data/web.jsonl.gz, 0.3:code/")
    assert [(s.name, s.path, s.weight) for s in mixture] == [("web", "data/web.jsonl.gz", 0.7), ("code", "code/", 0.3)]
    assert [s.weight for s in parse_mixture("2:a.txt,1:b.txt,1:a.txt")] == [0.5, 0.25, 0.25]
    assert [s.name for s in parse_mixture("1:x/a.txt,1:y/a.txt")] == ["a0", "a1"]  # names stay apart
    for single in ("corpus.txt", "data/*.jsonl", "default", "C:/corpora/a.txt", "runs/prep"):
        assert parse_mixture(single) is None


@pytest.mark.parametrize("spec, message", [
    ("0.7:a.txt,b.txt", r"entry 'b.txt' is not WEIGHT:SOURCE"),
    ("0.7:a.txt,-1:b.txt", r"weight '-1' of 'b.txt' is not a positive number"),
    ("0.7:a.txt,x:b.txt", r"weight 'x' of 'b.txt' is not a positive number"),
    ("0:a.txt,1:b.txt", r"weight '0' of 'a.txt' is not a positive number"),
    ("1:a.txt,1e-6:b.txt", r"every share must be at least 0.001"),
    ("0.5:,0.5:b.txt", r"is not WEIGHT:SOURCE"),
])
def test_a_bad_mixture_is_refused_in_one_line(spec, message):
    with pytest.raises(DataError, match=message) as e:
        parse_mixture(spec)
    assert "\n" not in str(e.value)


def test_named_held_out_sets_and_their_refusals():
    assert parse_eval_data("wiki=w.txt,code=c/") == [("wiki", "w.txt"), ("code", "c/")]
    assert parse_eval_data("") == []
    with pytest.raises(DataError, match="write NAME=PATH"):
        parse_eval_data("w.txt")
    with pytest.raises(DataError, match="repeat a name"):
        parse_eval_data("a=x.txt,a=y.txt")
    args = build_parser().parse_args(["train", "--eval-data", "a=x.txt", "--eval-data", "b=y.txt"])
    assert config_from_args(args).data.eval_data == "a=x.txt,b=y.txt"  # the option repeats


def test_the_run_refuses_a_source_that_does_not_exist_before_it_starts(corpora, tmp_path, capsys):
    code = main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r"),
                 "--data", f"0.5:{corpora['web']},0.5:{tmp_path / 'missing.txt'}"])
    err = capsys.readouterr().err
    assert code == 2 and "missing.txt" in err and "does not exist" in err and not (tmp_path / "r").exists()
    code = main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r"), "--eval-data", "x=nowhere.txt"])
    assert code == 2 and "nowhere.txt" in capsys.readouterr().err


# -- the sampler ------------------------------------------------------------------------------------------------

def test_each_source_gets_its_share_of_every_stretch_of_the_stream():
    weights = [0.7, 0.2, 0.1]
    sampler = MixtureSampler([50, 37, 1000], weights, global_batch=16)
    counts = np.zeros(3)
    for _ in range(40):
        counts += sampler.source_counts(sampler.samples_consumed, 16)
        sampler.next_batch()
    assert np.abs(counts / counts.sum() - weights).max() <= 0.03
    assert slot_counts(weights).tolist() == [700, 200, 100] and slot_counts([1 / 3] * 3).sum() == PERIOD
    one_period = MixtureSampler([5, 5], [0.5, 0.5], global_batch=PERIOD)
    assert one_period.source_counts(123, PERIOD).tolist() == [500, 500]  # any window of a period: exact


def test_the_stream_does_not_depend_on_the_data_ranks_and_resumes_exactly():
    sizes, weights = [40, 25], [0.6, 0.4]
    one = MixtureSampler(sizes, weights, global_batch=8, seed=3)
    steps = [one.next_batch() for _ in range(30)]  # several epochs of both sources
    two = [MixtureSampler(sizes, weights, global_batch=8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    assert [two[0].next_batch() + two[1].next_batch() for _ in range(30)] == steps
    later = MixtureSampler(sizes, weights, global_batch=8, seed=3)
    for _ in range(12):
        later.next_batch()
    resumed = MixtureSampler(sizes, weights, global_batch=8, seed=3)
    resumed.load_state_dict(later.state_dict())
    assert [resumed.next_batch() for _ in range(18)] == steps[12:]
    # every source's samples, each once per its own epoch
    firsts = [i for batch in steps[:5] for i in batch if i < 40]
    assert len(firsts) == len(set(firsts))
    with pytest.raises(DataError, match="--reset data"):
        MixtureSampler([40, 26], weights, global_batch=8, seed=3).load_state_dict(later.state_dict())
    with pytest.raises(DataError, match="mixture weights"):
        MixtureSampler(sizes, [0.5, 0.5], global_batch=8, seed=3).load_state_dict(later.state_dict())


# -- through the trainer ------------------------------------------------------------------------------------------

def _argv(corpora, out, *extra) -> list[str]:
    return ["train", *TINY, "--data", f"0.7:{corpora['web']},0.3:{corpora['code']}", "--out", str(out), *extra]


def _train_on_ranks(rank, world, argv):
    from paratrain.train import train

    train(config_from_args(build_parser().parse_args(argv)))


def test_a_mixture_trains_with_its_tokens_by_source_on_any_number_of_ranks(corpora, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["--steps", "6", "--eval-every", "3", "--eval-data", f"wiki={corpora['wiki']}"]
    assert main(_argv(corpora, one, *extra)) == 0
    run_on_ranks(_train_on_ranks, 2, _argv(corpora, two, *extra), timeout=120)
    records, twos = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    by_source = [r["tokens_by_source"] for r in records]
    assert by_source == [r["tokens_by_source"] for r in twos]
    assert all(sum(s.values()) == r["tokens"] == 8 * 32 for s, r in zip(by_source, records))
    web = sum(s["web"] for s in by_source) / sum(sum(s.values()) for s in by_source)
    assert abs(web - 0.7) <= 0.03
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and set(evals[-1]["eval_losses"]) == {"web", "code", "wiki"}
    losses = evals[-1]["eval_losses"]
    assert evals[-1]["eval_loss"] == pytest.approx(0.7 * losses["web"] + 0.3 * losses["code"])
    for mine, theirs in zip(evals, [r for r in twos if "eval_loss" in r]):
        assert mine["eval_losses"] == pytest.approx(theirs["eval_losses"], rel=1e-4)


def test_a_killed_mixture_run_resumes_the_same_stream(corpora, tmp_path):
    """Two ranks under the launcher, rank 1 SIGKILLed in step 6: the restart resumes from step 4's checkpoint
    and every step's tokens by source, and its loss, are those of one process that ran straight through."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(_argv(corpora, whole, "--steps", "8")) == 0
    env = {**os.environ, FAULT_ENV: "sigkill@rank1:step6"}
    result = subprocess.run([sys.executable, "-m", "paratrain", *_argv(corpora, killed, "--steps", "8",
                             "--checkpoint-every", "4", "--nproc", "2", "--max-restarts", "1")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    a, b = read_metrics(whole / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["tokens_by_source"] for r in a] == [r["tokens_by_source"] for r in b]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)


# -- stages ---------------------------------------------------------------------------------------------------------

def _optimizer_steps(checkpoint: Path) -> float:
    reader = CheckpointReader(checkpoint)
    name = next(n for n in reader.names() if n.endswith("/step"))
    return float(reader.read(name))


@pytest.fixture(scope="module")
def first_stage(corpora, tmp_path_factory) -> Path:
    """A mixture run's step-4 checkpoint, six steps planned, so that a stage that keeps the schedule ('data')
    continues it as it was. Each stage reads it and writes only its own --out."""
    first = tmp_path_factory.mktemp("first") / "run"
    assert main(_argv(corpora, first, "--steps", "6", "--checkpoint-every", "4")) == 0
    return first / "checkpoints" / "step-00000004"


@pytest.mark.parametrize("reset, steps, schedule_start", [("data", [5, 6], 0), ("data,lr", [5, 6], 4),
                                                            ("data,step", [1, 2, 3, 4, 5, 6], 0)])
def test_a_new_stage_continues_the_model_and_optimizer_on_new_data(corpora, first_stage, tmp_path, reset, steps,
                                                                   schedule_start):
    checkpoint, stage = first_stage, tmp_path / "stage"
    argv = ["train", *TINY, "--data", str(corpora["wiki"]), "--steps", "6", "--checkpoint-every", "6"]
    assert main([*argv, "--resume", str(checkpoint), "--reset", reset, "--out", str(stage)]) == 0
    records = read_metrics(stage / "metrics.jsonl")
    assert [r["step"] for r in records] == steps and "tokens_by_source" not in records[0]
    # the optimizer went on from the first stage's four steps
    assert _optimizer_steps(stage / "checkpoints" / f"step-{steps[-1]:08d}") == 4 + len(steps)
    cfg = config_from_args(build_parser().parse_args(argv))
    resolve_recipe(cfg)
    assert [r["lr"] for r in records] == pytest.approx([learning_rate(s, cfg, schedule_start) for s in steps])


def test_a_stage_refuses_what_makes_no_sense(corpora, tmp_path, capsys):
    base = ["train", *TINY, "--steps", "2", "--out", str(tmp_path / "r")]
    assert main([*base, "--reset", "data"]) == 2
    assert "--reset data starts a new stage from a checkpoint: give it as --resume PATH" in capsys.readouterr().err
    first = tmp_path / "first"
    assert main(_argv(corpora, first, "--steps", "2", "--checkpoint-every", "2")) == 0
    checkpoint = str(first / "checkpoints" / "step-00000002")
    assert main([*base, "--resume", checkpoint, "--reset", "weights"]) == 2
    assert "'weights' is not one of data, lr, step" in capsys.readouterr().err
    assert main([*base, "--data", str(corpora["wiki"]), "--resume", checkpoint]) == 2  # new data without --reset
    assert "start a new stage on this data with --reset data" in capsys.readouterr().err
    assert isinstance(Config().checkpoint.reset, str)
