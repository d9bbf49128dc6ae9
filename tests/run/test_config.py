"""Config parsing, validation and the command line derived from it (pure, no processes)."""

import json

import pytest

from paratrain.cli import build_parser
from paratrain.commands.options import config_from_args
from paratrain.config import Config, ConfigError, iter_options, validate
from paratrain.parallel.rules import batch_violations


def parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_defaults_round_trip_through_json():
    cfg = Config()
    again = Config.from_dict(json.loads(cfg.to_json()))
    assert again == cfg


def test_command_line_overrides_toml_overrides_defaults(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nsteps = 7\nlr = 0.01\n[data]\nseq_len = 64\n')
    cfg = parse("--config", str(toml), "--steps", "9", "--model", "small", "--no-progress")
    assert cfg.train.steps == 9  # command line wins
    assert cfg.train.lr == 0.01  # from the file
    assert cfg.data.seq_len == 64
    assert cfg.model.name == "small"
    assert cfg.run.progress is False
    assert cfg.train.global_batch == Config().train.global_batch  # default untouched


def resolved(*argv):
    """The config `paratrain train ARGV` runs with: parsed, then its defaults resolved as the trainer's preflight
    resolves them (before any process starts; no 7B model is built)."""
    from paratrain.run.build import preflight

    cfg = parse(*argv, "--no-mem-check", "--out", "unused-run-dir")
    return preflight(cfg, 1).cfg


def test_a_named_model_trains_with_its_published_recipe():
    """Llama 2 (Touvron et al. 2023, §2.2 and table 1): AdamW β1 0.9, β2 0.95, eps 1e-5, 2,000 warm-up steps, cosine
    to 10 % of the peak, weight decay 0.1, clipping at 1.0; peak 3e-4 for 7B and 13B, 1.5e-4 for 70B."""
    t = resolved("--model", "llama2-7b").train
    assert (t.lr, t.min_lr, t.warmup_steps) == (3e-4, pytest.approx(3e-5), 2000)
    assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip) == (0.9, 0.95, 1e-5, 0.1, 1.0)
    assert resolved("--model", "llama2-13b").train.lr == 3e-4
    assert (resolved("--model", "llama2-70b").train.lr, resolved("--model", "llama2-70b").train.min_lr) == \
        (1.5e-4, pytest.approx(1.5e-5))
    assert resolved("--model", "llama3-8b").train.lr == 3e-4  # Llama 3 (Dubey et al. 2024), table 3


def test_the_default_model_keeps_its_recipe():
    """`paratrain train` as the README runs it: the numbers it always trained with."""
    t = resolved().train
    assert (t.lr, t.min_lr, t.warmup_steps, t.weight_decay, t.beta1, t.beta2, t.grad_clip) == \
        (3e-3, pytest.approx(3e-4), 20, 0.1, 0.9, 0.95, 1.0)
    assert t.eps == 1e-8  # torch's AdamW default


def test_the_users_options_win_over_the_recipe(tmp_path):
    t = resolved("--model", "llama2-7b", "--lr", "1e-4", "--warmup-steps", "10", "--grad-clip", "0").train
    assert (t.lr, t.warmup_steps, t.grad_clip) == (1e-4, 10, 0.0)
    assert t.min_lr == pytest.approx(1e-5), "the decay ends at the recipe's fraction of the peak the user chose"
    assert t.beta2 == 0.95 and t.eps == 1e-5
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nname = 'llama2-7b'\n[train]\nlr = 2e-4\nmin_lr = 0.0\nbeta2 = 0.98\n")
    t = resolved("--config", str(toml)).train
    assert (t.lr, t.min_lr, t.beta2, t.warmup_steps) == (2e-4, 0.0, 0.98, 2000)
    assert resolved("--config", str(toml), "--lr", "5e-5").train.lr == 5e-5  # the command line over the file


def test_a_run_written_before_an_option_existed_is_the_same_run():
    """A run directory whose config.json predates train.eps resumes; a changed option is still another run."""
    from paratrain.run.rundir import config_difference

    current = resolved().to_dict()
    stored = json.loads(json.dumps(current))
    del stored["train"]["eps"]
    assert config_difference(stored, current) is None
    stored["train"]["lr"] = 1e-3
    assert config_difference(stored, current) == "train.lr is 0.001 there, 0.003 here"


def test_unknown_toml_key_and_section_are_errors(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['stepz'\] in \[train\]"):
        parse("--config", str(toml))
    toml.write_text("[trian]\nsteps = 3\n")
    with pytest.raises(ConfigError, match="unknown config section"):
        parse("--config", str(toml))


def test_wrong_types_name_the_option():
    with pytest.raises(ConfigError, match="--steps: expected int, got 'ten'"):
        parse("--steps", "ten")
    with pytest.raises(ConfigError, match="train.steps: expected int"):
        Config.from_dict({"train": {"steps": 2.5}})


def test_every_field_has_a_flag_and_help():
    flags = [flag for _, _, _, flag in iter_options()]
    assert len(flags) == len(set(flags)), "flags must be unique across sections"
    for _, _, f, _ in iter_options():
        assert f.metadata["help"], f.name
    for flag in ["--steps", "--seed", "--model", "--data", "--global-batch", "--micro-batch",
                 "--seq-len", "--out", "--nproc"]:
        assert flag in flags


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "--steps must be at least 1"),
    (["--lr", "-0.1"], "--lr must not be negative"),
    (["--global-batch", "10", "--micro-batch", "4"], "--global-batch 10 is not divisible"),
    (["--beta2", "1.5"], "--beta2 must be in"),
    (["--eval-fraction", "0.9"], "--eval-fraction must be in"),
])
def test_validation_messages(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse(*argv))


def test_batch_divisibility_suggests_valid_choices():
    assert batch_violations(32, 4, 2) == []
    text = batch_violations(30, 4, 2)[0].message
    assert "--global-batch 24 or --global-batch 32" in text
    assert "--micro-batch in [1, 3, 5, 15]" in text
