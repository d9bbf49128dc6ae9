"""--mem-budget auto on CUDA, simulated on the CPU: the plan must fit beside the CUDA context and NCCL's buffers."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from paratrain.cli import build_parser
from paratrain.commands.options import config_from_args
from paratrain.config import ConfigError
from paratrain.mesh import MeshShape, build_mesh
from paratrain.run.build import preflight
from paratrain.run.memory_budget import format_bytes, planned_memory
from paratrain.testing import run_on_ranks

MiB = 2**20


def parse(tmp_path, *argv):
    return config_from_args(build_parser().parse_args(["train", "--out", str(tmp_path / "run"), *argv]))


def simulate_gpu(monkeypatch, total: float, free: float | None = None) -> None:
    """torch.cuda as one device of `total` bytes with `free` of them free, on a machine without CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=int(total), name="simulated GPU"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free or total), int(total)))


def plan_bytes(cfg, world_size: int) -> float:
    plan = preflight(cfg, world_size)  # resolves the batch defaults (with --no-mem-check: nothing else)
    return planned_memory(plan.cfg, plan.model_cfg, plan.cfg.parallel.dp or world_size).total


def test_a_gpu_just_larger_than_the_plan_is_refused_before_launch(tmp_path, monkeypatch):
    """A worker of a 2-process job: the GPU's whole memory holds the plan, but not with the CUDA context and the
    world's and the data axis's NCCL communicators beside it."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    plan = plan_bytes(parse(tmp_path, "--zero", "3", "--no-mem-check"), 2)
    simulate_gpu(monkeypatch, total=plan + 256 * MiB)
    with pytest.raises(ConfigError) as refused:
        preflight(parse(tmp_path, "--zero", "3"), 2)
    message = str(refused.value)
    assert "\n" not in message
    assert f"the planner's memory estimate for one process, {format_bytes(plan)}" in message
    assert format_bytes(plan + 256 * MiB) in message and "CUDA context" in message
    assert "2 NCCL communicator" in message
    for fix in ("--mem-budget", "a smaller --micro-batch", "more --zero"):
        assert fix in message, fix
    simulate_gpu(monkeypatch, total=plan + 8 * 2**30)  # room for both: it starts
    preflight(parse(tmp_path, "--zero", "3"), 2)


def _free_memory_on_ranks(rank, world_size, out, free):
    """The check once the mesh exists, on a mesh that computes on a simulated GPU (its collective over gloo)."""
    from paratrain.run.memory_budget import check_free_memory

    cfg = config_from_args(build_parser().parse_args(["train", "--out", out, "--zero", "3"]))
    plan = preflight(cfg, world_size)  # as `train` does first (on the CPU's budget: torch.cuda is real here)
    torch.cuda.mem_get_info = lambda device=None: (int(free[rank]), int(max(free) * 2))
    mesh = dataclasses.replace(build_mesh(MeshShape(dp=world_size)), device=torch.device("cuda", 0))
    try:
        check_free_memory(plan.cfg, plan.model_cfg, mesh)
    except ConfigError as e:
        return str(e)
    return None


def test_free_memory_of_the_fullest_gpu_is_the_budget_once_the_mesh_exists(tmp_path, monkeypatch):
    """Every rank refuses together, naming the rank whose GPU has the least free memory (another process on it)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    cfg = parse(tmp_path, "--zero", "3", "--no-mem-check")
    plan = plan_bytes(cfg, 2)
    monkeypatch.delenv("RANK"), monkeypatch.delenv("WORLD_SIZE")
    roomy = plan + 8 * 2**30
    messages = run_on_ranks(_free_memory_on_ranks, 2, str(tmp_path / "run"), [roomy, plan + 256 * MiB], timeout=60)
    assert messages[0] == messages[1] and messages[0] is not None
    assert "rank 1" in messages[0] and format_bytes(plan + 256 * MiB) in messages[0]
    assert "2 NCCL communicator" in messages[0] and "\n" not in messages[0]
    assert run_on_ranks(_free_memory_on_ranks, 2, str(tmp_path / "run"), [roomy, roomy], timeout=60) == [None, None]
