"""GPU runs resolve sensible defaults, and the shipped recipes are valid: checked with the world size faked.

No process group and no GPU: the configuration is resolved and validated as `paratrain train`
does before any process starts, the model is built on the meta device, and the planner judges
the layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.commands.train import config_from_args
from paratrain.cli import build_parser
from paratrain.hardware import peak_flops_of
from paratrain.models import Transformer
from paratrain.plan import Recompute, SearchSpace, Workload, estimate_memory, get_hardware, search
from paratrain.run.build import default_run_dir, preflight

RECIPES = Path(__file__).parents[2] / "configs"


def _config(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_llama2_7b_zero3_bf16_on_8_gpus_resolves_sensible_defaults(monkeypatch):
    """`torchrun --nproc-per-node 8 -m paratrain train --model llama2-7b --zero 3 --precision bf16`, validated."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    # --mem-budget: an 80 GB GPU's, which this machine does not have (auto would take its own memory)
    cfg = _config("--model", "llama2-7b", "--zero", "3", "--precision", "bf16", "--mem-budget", "80GB")
    cfg = preflight(cfg, world_size=8).cfg
    assert (cfg.train.global_batch, cfg.train.micro_batch) == (16, 2), "16 sequences, one micro-batch per GPU"
    assert cfg.run.out == "", "plain torchrun gives no run id: the ranks agree on a name through its store"
    assert cfg.train.peak_flops is None  # then MFU divides by the GPU's own peak:
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12 and peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("NVIDIA H200") == 989e12 and peak_flops_of("NVIDIA L40S") == 362e12
    assert peak_flops_of("NVIDIA L4") == 121e12 and peak_flops_of("some cpu") is None


def test_batch_defaults_divide_over_any_world_size():
    for world in (1, 3, 8, 24, 64):
        cfg = preflight(_config("--model", "tiny"), world_size=world).cfg
        t = cfg.train
        assert t.global_batch % (t.micro_batch * world) == 0 and t.global_batch >= 16, (world, t)


def test_the_run_directory_needs_no_out_under_any_launcher():
    cfg = _config("--model", "tiny")
    assert default_run_dir(cfg, {"WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "job42"}) == "runs/tiny-job42"
    assert default_run_dir(cfg, {"WORLD_SIZE": "8"}) == ""  # the ranks agree on one: shared_run_dir
    assert default_run_dir(cfg, {}).startswith("runs/tiny-")


@pytest.mark.parametrize("recipe, world, zero", [("llama2-7b-8gpu", 8, (3,)), ("llama2-70b-64gpu", 64, (0, 1, 2, 3))])
def test_a_shipped_recipe_is_valid_and_is_the_planners_choice(recipe, world, zero, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = _config("--config", str(RECIPES / f"{recipe}.toml"), "--mem-budget", "80GB")  # the planner's check too
    plan = preflight(cfg, world_size=world)
    cfg, model_cfg = plan.cfg, plan.model_cfg
    with torch.device("meta"):  # the whole model, no memory
        model = Transformer(model_cfg)
    assert sum(p.numel() for p in model.parameters()) == model_cfg.num_params()
    t, p = cfg.train, cfg.parallel
    work = Workload.for_model(model_cfg, seq_len=cfg.data.seq_len, global_batch=t.global_batch, precision=p.precision)
    hardware = get_hardware("h100-80gb")
    best = search(work, world, hardware, SearchSpace(zero=zero, recompute=(Recompute.FULL,))).best.layout
    dp = world // (p.tp * p.pp)
    assert (best.dp, best.tp, best.pp, best.zero, best.micro_batch) == (dp, p.tp, p.pp, p.zero, t.micro_batch)
    assert best.recompute is Recompute.FULL and p.activation_checkpointing == 1
    assert estimate_memory(work, best).total <= hardware.memory_bytes


@pytest.mark.parametrize("slow", [True, False])
def test_a_bf16_run_on_a_cpu_without_bf16_instructions_says_so_in_its_first_line(slow, monkeypatch, tmp_path, capsys):
    """On an x86 CPU without AVX512-BF16 or AMX torch's bf16 matmuls take a reference kernel ~20x slower than fp32's:
    the run's first line says so (and how to train faster); an fp32 run, or a CPU with the instructions, does not."""
    from paratrain.cli import main
    from paratrain.hardware import slow_bf16_matmuls
    import paratrain.run.build as build

    assert not slow_bf16_matmuls(torch.device("meta"))  # a claim about CPUs only
    monkeypatch.setattr(build, "slow_bf16_matmuls", lambda device: slow and device.type == "cpu")
    run = ["train", "--model", "tiny", "--steps", "1", "--seq-len", "32", "--global-batch", "1", "--eval-every", "0",
           "--sample-tokens", "0", "--no-progress"]
    for precision in ("bf16", "fp32"):
        assert main([*run, "--precision", precision, "--out", str(tmp_path / precision)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        said = "this CPU has no bf16 matrix instructions" in first and "--precision fp32 trains faster" in first
        assert said == (slow and precision == "bf16"), first
