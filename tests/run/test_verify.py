"""`paratrain verify`: the layout grammar, one-line errors, a passing run and a deliberately broken one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.config import ParallelSection
from paratrain.faults import FAULT_ENV
from paratrain.commands.verify import format_table
from paratrain.error_model import BF16_ADAMW, FP8_ADAMW, FP16_ADAMW, FP32_ADAMW_MODEL, default_bound
from paratrain.verify import (
    LAYOUT_TOKENS,
    Comparison,
    VerifyError,
    format_layout,
    num_processes,
    parse_layout,
)

# A small corpus (the json package's sources) keeps each launched process's data loading short; a model narrower
# than `tiny` (bf16 matmuls on a CPU cost seconds a step at its width) keeps each step short.
SMALL = ["--model", "tiny", "--n-layers", "2", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "128",
         "--steps", "3", "--global-batch", "8", "--seq-len", "32", "--data", str(Path(json.__file__).parent)]


def test_layouts_parse_into_parallel_overrides():
    assert parse_layout("dp2,zero3") == {"dp": 2, "zero": 3}
    assert parse_layout(" DP4 , bf16 ") == {"dp": 4, "precision": "bf16"}
    assert num_processes(parse_layout("dp4,zero1")) == 4 and num_processes({}) == 1
    assert parse_layout("cp2,dp2") == {"cp": 2, "dp": 2} and num_processes(parse_layout("cp2,dp2")) == 4


def test_format_is_the_inverse_of_parse():
    for text in ["dp2,zero3,bf16", "dp4", "dp2,zero1,fp16", "dp4,shard2,zero3", "dp2,cp2,zero3"]:
        assert format_layout(parse_layout(text)) == text
    assert format_layout({"dp": 0, "zero": 0, "precision": "fp32"}) == "dp1"


@pytest.mark.parametrize("text, message", [
    ("dp2,foo", "unknown token 'foo' in 'dp2,foo'"),
    ("dp2,zero4", "unknown token 'zero4'"),
    ("dp0", "unknown token 'dp0'"),
    ("dp2,dp4", "sets dp twice"),
    (" , ", "empty layout"),
])
def test_bad_layouts_are_named(text, message):
    with pytest.raises(VerifyError, match=message):
        parse_layout(text)


def test_every_layout_token_sets_a_trainer_option():
    """A token whose [parallel] field did not exist would be dropped by Config.from_dict's key check."""
    fields = {f.name for f in dataclasses.fields(ParallelSection)}
    assert [kind.field for kind in LAYOUT_TOKENS if kind.field not in fields] == []
    assert parse_layout("pp2,dp2,tp2,zero1,interleaved,v2") == {
        "pp": 2, "dp": 2, "tp": 2, "zero": 1, "schedule": "interleaved", "virtual_stages": 2}


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "dp2,foo"], "unknown token 'foo'"),
    (["--layouts", "dp3", "--global-batch", "8"], "--global-batch 8 is not divisible by the 3 data ranks"),
    (["--layouts", "dp2", "--tol", "0"], "--tol must be positive"),
    (["--layouts", "dp2", "--model", "gpt5"], "unknown model 'gpt5'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(["verify", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert "reference" not in captured.out, "nothing ran"


def test_the_default_bound_is_the_error_model_of_the_precision_and_fp8_recipe_per_step():
    assert default_bound("fp32") is FP32_ADAMW_MODEL and default_bound("bf16") is BF16_ADAMW
    assert default_bound("fp16") is FP16_ADAMW and default_bound("bf16", "rowwise") is FP8_ADAMW
    assert FP32_ADAMW_MODEL.param_rtol < FP16_ADAMW.param_rtol <= BF16_ADAMW.param_rtol < FP8_ADAMW.param_rtol
    bf16 = Comparison("dp2,zero3,bf16", 2, 2.96e-5, 2.39e-3, 3.59e-3).judge_by({"precision": "bf16"}, 3, None)
    assert (bf16.loss_bound, bf16.param_bound) == BF16_ADAMW.bounds(3) and bf16.passed()
    # the same differences fail fp32's bound, and one step's bf16 bound
    assert not Comparison("dp2", 2, 2.96e-5, 2.39e-3, 0).judge_by({}, 3, None).passed()
    assert not Comparison("dp2,bf16", 2, 2.96e-5, 2.39e-3, 0).judge_by({"precision": "bf16"}, 1, 1e-3).passed()
    table = format_table([bf16, Comparison("dp2", 2, 1e-7, 1e-6, 1e-6).judge_by({}, 3, None)])
    rows = table.splitlines()
    assert rows[0].startswith("bound [1]: bf16 AdamW, whole model: 0.0004 (loss) and 0.018 (parameters) per step x 3 "
                              "steps; ") and rows[1].startswith("bound [2]: fp32 AdamW")
    assert rows[3].split()[5] == rows[4].split()[5] == "PASS" and rows[3].endswith("[1]") and rows[4].endswith("[2]")
    given = format_table([Comparison("dp2", 2, 1e-7, 1e-6, 1e-6).judge_by({}, 3, 1e-4)])
    assert given.splitlines()[0] == "bound: --tol 0.0001"


def test_data_and_zero3_layouts_match_one_process(capsys):
    assert main(["verify", *SMALL, "--layouts", "dp2;dp2,zero3"]) == 0
    out = capsys.readouterr().out
    table = out.split("layout ")[-1].splitlines()
    assert [line.split()[0] for line in table[1:]] == ["dp2", "dp2,zero3"]
    assert all(line.split()[5] == "PASS" for line in table[1:]), table
    assert "\nbound: fp32 AdamW, whole model: 1e-06 (loss) and 2e-05 (parameters) per step x 3 steps" in out, out


def test_mixed_precision_layouts_pass_with_no_tol(capsys):
    """bf16 on dp2 ZeRO-3, tp2 + sp and pp2 1F1B: judged by the bf16 error model, with no --tol given."""
    assert main(["verify", *SMALL, "--precision", "bf16", "--layouts", "dp2,zero3;tp2,sp;pp2,1f1b"]) == 0
    out = capsys.readouterr().out
    table = out.split("layout ")[-1].splitlines()
    assert [line.split()[5] for line in table[1:]] == ["PASS"] * 3, table
    assert "\nbound: bf16 AdamW, whole model" in out, out


def test_context_parallel_layouts_match_one_process(capsys):
    """cp2, and cp2 with tensor and sequence parallelism, through the trainer: sequences split over the cp
    ranks, attention as a ring, the eval loss too."""
    assert main(["verify", *SMALL, "--layouts", "cp2;cp2,tp2,sp"]) == 0
    table = capsys.readouterr().out.split("layout ")[-1].splitlines()
    assert [line.split()[0] for line in table[1:]] == ["cp2", "cp2,tp2,sp"]
    assert all(line.split()[5] == "PASS" for line in table[1:]), table


@pytest.mark.parametrize("offload", [[], ["--offload", "optimizer"]])
def test_a_broken_engine_fails(capsys, monkeypatch, offload):
    """Rank 1 negates its gradients before every optimizer step: verify must say FAIL and exit 1 (with the optimizer
    offloaded too: the fault acts on the gradients the step reduces, not on the host copies it steps)."""
    monkeypatch.setenv(FAULT_ENV, "negate_grads@rank1:step*")
    assert main(["verify", *SMALL, "--layouts", "dp2,zero2", *offload]) == 1
    out = capsys.readouterr().out
    assert f"fault injection is on ({FAULT_ENV}=negate_grads@rank1:step*)" in out
    row = out.splitlines()[-1].split()
    assert row[0] == "dp2,zero2" and row[5] == "FAIL", row
    assert float(row[2]) > 1e-3 and float(row[3]) > 1e-3, "both losses and parameters moved"


def test_an_unknown_fault_is_refused_before_anything_runs(capsys, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "explode@rank1:step1")
    assert main(["verify", *SMALL, "--layouts", "dp2"]) == 2
    assert f"{FAULT_ENV}: unknown fault kind 'explode'" in capsys.readouterr().err


def test_the_trainers_options_apply_to_every_layout_unless_its_tokens_set_them(monkeypatch, tmp_path):
    """--zero, --precision, --micro-batch ... are `paratrain train`'s options; a layout's tokens override them."""
    from paratrain.cli import build_parser
    from paratrain.commands import verify as command

    ran = []
    monkeypatch.setattr(command, "run_layout", ran.append)
    monkeypatch.setattr(command, "compare", lambda reference, candidate, comparison: comparison)
    args = build_parser().parse_args(["verify", *SMALL, "--layouts", "dp2;dp2,zero3", "--zero", "1",
                                      "--precision", "bf16", "--micro-batch", "2"])
    command.verify(args, tmp_path, log=lambda *_: None)
    runs = [(c.run.nproc, c.parallel.dp, c.parallel.zero, c.parallel.precision, c.train.micro_batch) for c in ran]
    assert runs == [(1, 0, 0, "bf16", 2), (2, 2, 1, "bf16", 2), (2, 2, 3, "bf16", 2)]  # the reference, then each
