"""Config parsing, validation and the command line derived from it (pure, no processes)."""

import json

import pytest

from paratrain.cli import build_parser, config_from_args
from paratrain.config import Config, ConfigError, check_batch, iter_options, validate


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
    assert check_batch(32, 4, 2) == 4
    with pytest.raises(ConfigError) as e:
        check_batch(30, 4, 2)
    text = str(e.value)
    assert "--global-batch 24 or --global-batch 32" in text
    assert "--micro-batch in [1, 3, 5, 15]" in text
