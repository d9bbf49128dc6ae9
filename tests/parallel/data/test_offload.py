"""ZeRO-Offload (`paratrain.parallel.data.offload`): the optimizer over host copies of the masters gives the run
without offload exactly, under every ZeRO stage and tensor parallelism, through verify, across a killed process;
the state really lives apart from the device's tensors; bad input is one line."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.checkpoint import CheckpointReader
from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.faults import FAULT_ENV
from paratrain.metrics import read_metrics
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.data import offload
from paratrain.parallel.api import ParallelConfigError
from paratrain.parallel.data.offload import OffloadError, check_offload, host_tensors
from paratrain.parallel.rules import LayoutRuleError, LayoutSpec, check_layout
from paratrain.testing import run_on_ranks
from parallel_cases import launch_once

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
pytestmark = pytest.mark.filterwarnings("ignore:offload on the CPU")
# A small corpus (the json package's sources: the default corpus's load and statistics cost each run seconds) and one
# held-out batch: what these runs compare is the training steps. Three steps: the third's update reads moments that
# two host steps built, overlapped with the next forward.
DATA = ["--data", str(Path(json.__file__).parent)]
TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--sample-tokens", "0",
        "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--steps", "3", "--grad-clip", "0.05", *DATA]


@pytest.fixture(autouse=True)
def _process_group_left_behind():
    """`paratrain.init_mesh()` in this process starts a process group of one; later tests must not find it."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _steps(precision: str, zero: int, offload: str | None):
    """(losses, model, optimizer) of four clipped steps of two micro-batches through `parallelize` on one process."""
    from paratrain.train import train_step

    with torch.device("meta"):
        model = Transformer(CFG)
    model, optimizer = paratrain.parallelize(
        model, paratrain.init_mesh(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
        precision=precision, data=paratrain.DataParallel(zero=zero, offload=offload),
        init=functools.partial(Transformer(CFG).param_init, seed=0))
    g, losses = torch.Generator().manual_seed(0), []
    for _ in range(4):
        t = torch.randint(0, CFG.vocab_size, (4, 33), generator=g)
        losses.append(train_step(model, optimizer, [(t[:2, :-1], t[:2, 1:]), (t[2:, :-1], t[2:, 1:])], 0.5).loss)
    return losses, model, optimizer


def test_params_offload_steps_the_shards_where_they_live():
    """offload="params": ZeRO-3's shards are the host masters the optimizer steps (no copies), gathered to the
    device for each unit; the same numbers as without offload."""
    plain, _, _ = _steps("bf16", 3, None)
    losses, model, optimizer = _steps("bf16", 3, "params")
    assert losses == plain
    shards = model.engine.masters()
    assert model.masters() == shards and [p for g in optimizer.param_groups for p in g["params"]] == shards
    assert all(s.device.type == "cpu" for s in shards) and model.offload.host_bytes() == 4 * sum(
        s.numel() for s in shards)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 3])
def test_the_host_step_is_the_device_step(precision, zero):
    """Clipping (fused AdamW's grad_scale, on the host), accumulation over micro-batches and the update: the same
    numbers as without offload, exactly; the optimizer and its state live on the host copies, never on the
    engine's tensors; a mixed-precision engine keeps no fp32 master storage of its own."""
    plain, _, _ = _steps(precision, zero, None)
    losses, model, optimizer = _steps(precision, zero, "optimizer")
    assert losses == plain
    device_masters = model.engine.masters()
    host = model.masters()
    assert host is model.offload.values and len(host) == len(device_masters)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in stepped] == [id(h) for h in host]
    engine_storage = {t.untyped_storage().data_ptr() for t in device_masters}
    engine_storage |= {p.untyped_storage().data_ptr() for p in model.module.parameters()}
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert state and not {t.untyped_storage().data_ptr() for t in host + state} & engine_storage
    if precision == "bf16" and zero == 0:  # the separate fp32 masters are gone from the engine
        assert model.resident_bytes()["master"] <= 4 * len(device_masters)
    assert all(p.grad is None for p in model.module.parameters()) and all(m.grad is None for m in device_masters)


def _host_step_order(rank, world, zero: int) -> list:
    """The order of the host step's unit steps (in its thread) and the next forward's units (in this one), two
    steps of the reference model with a host step slower than a unit's forward; the mesh is `world` data ranks."""
    import threading
    import time

    from paratrain.parallel.blocks import unit_modules
    from paratrain.parallel.data import host_step

    log, lock = [], threading.Lock()

    def note(event):
        with lock:
            log.append(event)

    adam = host_step.adam

    def slow_adam(params, *args, **kwargs):
        note(("stepped", threading.current_thread().name))
        time.sleep(0.05)  # a host step slower than the forward of a unit
        return adam(params, *args, **kwargs)

    host_step.adam = slow_adam
    try:
        with torch.device("meta"):
            model = Transformer(CFG)
        model, optimizer = paratrain.parallelize(
            model, paratrain.init_mesh(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
            data=paratrain.DataParallel(zero=zero, offload="optimizer", bucket_mb=0.01),  # (ZeRO-1/2: a bucket
            init=functools.partial(Transformer(CFG).param_init, seed=0))  # of a few parameters, not the model)
        units = [m for _, m in unit_modules(model.module, None)]  # the embedding, the blocks, the norm, the head
        for i, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda *_, i=i: note(("forward", i)))
        t = torch.randint(0, CFG.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            model.loss_fn(model(t[:, :-1]), t[:, 1:]).backward()
            log.clear()
            optimizer.step()
            note(("returned",))
            optimizer.zero_grad()
        model(t[:, :-1])
    finally:
        host_step.adam = adam
    return [log, len(units)]


@pytest.mark.parametrize("zero, world", [(0, 1), (3, 1), (1, 2), (2, 2)])
def test_the_host_step_runs_unit_by_unit_in_a_worker_while_the_next_forward_waits_for_its_own_unit(zero, world):
    """`optimizer.step()` returns while the host still steps; a worker thread steps the masters unit by unit in
    the forward's order (embedding, blocks, norm, head), and the next forward computes each unit once that
    unit's masters are stepped, not after all of them: its first unit runs while later ones are still stepped.
    ZeRO-1/2 over two ranks too: each bucket's all-gather waits for the forward's first unit that reads it."""
    for log, units in run_on_ranks(_host_step_order, world, zero, timeout=180):
        stepped = [i for i, e in enumerate(log) if e[0] == "stepped"]
        forwards = [i for i, e in enumerate(log) if e[0] == "forward"]
        assert len(stepped) == units and {log[i][1] for i in stepped} == {"paratrain-host-step"}
        assert log.index(("returned",)) < stepped[-1]  # the host still stepping when step() returned
        assert forwards[0] < stepped[-1]  # the first unit computed before the last one was stepped
        assert all(stepped[k] < forwards[k] for k in range(units))  # but only after its own was


def _user_loop(offload, factory, steps: int, precision: str = "fp32", scheduler=None):
    """(losses, optimizer state, host masters) of a user's own loop (backward, step, a scheduler's step, zero_grad)
    on one process, with or without offload."""
    with torch.device("meta"):
        model = Transformer(CFG)
    model, optimizer = paratrain.parallelize(model, paratrain.init_mesh(), optimizer=factory, precision=precision,
                                             data=paratrain.DataParallel(offload=offload),
                                             init=functools.partial(Transformer(CFG).param_init, seed=0))
    scheduler = scheduler(optimizer) if scheduler else None
    g, losses = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        t = torch.randint(0, CFG.vocab_size, (2, 33), generator=g)
        loss = model.loss_fn(model(t[:, :-1]), t[:, 1:]) / t[:, 1:].numel()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = optimizer.state_dict()["state"]
    torch.distributed.destroy_process_group()
    return losses, state, model.offload


def test_a_scheduler_and_zero_grad_after_the_step_act_as_without_offload():
    """The learning rate and the gradients the host step uses are the step's own: a scheduler stepped and the
    gradients zeroed right after `optimizer.step()` returns change nothing the worker is still stepping."""
    run = functools.partial(_user_loop, factory=functools.partial(torch.optim.AdamW, lr=1e-2, fused=True), steps=4,
                            precision="bf16",
                            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + 10 * step)))
    (plain, plain_state, _), (losses, state, host) = run(None), run("optimizer")
    assert host.overlapped and losses == plain
    assert all(torch.equal(plain_state[k]["exp_avg"], state[k]["exp_avg"]) for k in plain_state)


def test_param_groups_and_amsgrad_step_on_the_host_as_on_the_device():
    """Each of the optimizer's groups keeps its own hyperparameters in the host step, and AMSGrad its fourth
    state: the same losses and state as without offload."""
    def factory(params):
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 3e-3}],
                                 lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True)

    (plain, plain_state, _), (losses, state, host) = (_user_loop(offload, factory, 3) for offload in (None, "optimizer"))
    assert host.overlapped and losses == plain
    assert all(torch.equal(plain_state[k]["max_exp_avg_sq"], state[k]["max_exp_avg_sq"]) for k in plain_state)


def test_host_memory_comes_in_chunks_not_one_allocation_per_master(monkeypatch):
    monkeypatch.setattr(offload, "CHUNK_BYTES", 1024)
    shapes = [torch.Size([128])] * 7 + [torch.Size([3, 5])]  # 512 bytes each: two per chunk
    tensors = host_tensors(shapes, torch.float32, pin=False)
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert [t.shape for t in tensors] == shapes and len(storages) == 4  # 2 + 2 + 2 + (1 + the small one)
    assert all(t.device.type == "cpu" for t in tensors)


def test_bad_offload_input_is_one_line(capsys):
    with pytest.raises(OffloadError, match="is not a mode"):
        check_offload("gpu")
    with pytest.raises(LayoutRuleError, match="needs ZeRO-3"):  # a layout rule (`rules.offload_violations`)
        check_layout(LayoutSpec(dp=1, zero=2, offload="params"))
    with pytest.raises(ParallelConfigError, match="needs ZeRO-3"):
        paratrain.parallelize(torch.nn.Linear(4, 4), paratrain.init_mesh(),
                              data=paratrain.DataParallel(zero=1, offload="params"))
    for bad, message in ((["--offload", "disk"], "is not one of"), (["--offload", "params", "--zero", "2"],
                                                                    "--offload params needs --zero 3")):
        assert main(["train", *TINY, *bad, "--out", "unused"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


# The layouts whose runs with and without offload must agree: all trained in one launch of 2 ranks.
PAIRS = {"zero1": (["--zero", "1"], "optimizer"), "zero2": (["--zero", "2"], "optimizer"),
         "zero3": (["--zero", "3"], "optimizer"), "tp2": (["--tp", "2"], "optimizer"),
         "zero2_bf16": (["--zero", "2", "--precision", "bf16"], "optimizer"),
         "zero3_params": (["--zero", "3"], "params"),
         "zero3_tp2_sp_params": (["--zero", "3", "--tp", "2", "--sequence-parallel"], "params")}
_PAIRS: dict = {}


def _train_pairs(rank, world, root):
    """For each of `PAIRS`, the same run without and with offload, one after the other, on these ranks."""
    from paratrain.train import train

    for name, (layout, mode) in PAIRS.items():
        for run, extra in (("plain", []), ("offload", ["--offload", mode])):
            argv = ["train", *TINY, *layout, *extra, "--out", f"{root}/{name}/{run}"]
            train(config_from_args(build_parser().parse_args(argv)))


@pytest.mark.parametrize("name", list(PAIRS))
def test_two_ranks_with_offload_equal_two_ranks_without(tmp_path_factory, name):
    root = tmp_path_factory.getbasetemp() / "offload-pairs"
    launch_once(_PAIRS, 2, _train_pairs, str(root), timeout=600)
    plain, offload = (read_metrics(root / name / run / "metrics.jsonl") for run in ("plain", "offload"))
    assert [r["loss"] for r in offload] == pytest.approx([r["loss"] for r in plain], rel=1e-6, abs=0)
    assert [r["grad_norm"] for r in offload] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-6)


@pytest.mark.parametrize("optimizer, layouts", [("adamw", "dp2,zero1;dp2,zero3;tp2"), ("muon", "dp2,zero2;tp2")])
def test_verify_passes_every_layout_with_offload(capsys, optimizer, layouts, tmp_path):
    """With AdamW on `tiny`, and with Muon (its momentum on the host, its Newton–Schulz iteration on the device) at
    Muon's bound on a small Llama directory (Newton–Schulz's bf16 products on `tiny`'s matrices take seconds a step
    on a CPU without bf16 matrix units)."""
    model = "tiny"
    if optimizer == "muon":
        pytest.importorskip("transformers")
        from hf_families import save_llama_config

        model = str(save_llama_config(tmp_path / "llama"))
    assert main(["verify", "--model", model, "--layouts", layouts, "--offload", "optimizer", "--steps", "2",
                 "--optimizer", optimizer, *DATA]) == 0
    assert capsys.readouterr().out.count("PASS") == len(layouts.split(";"))


def test_a_killed_offloaded_run_resumes_bit_exact(tmp_path):
    """Two ranks under the launcher with the optimizer on the host, rank 1 SIGKILLed in step 5: the restart loads
    the host masters and state from the last committed checkpoint (step 4's, or step 2's while step 4's is still
    being written in the background) and ends where a run straight through ends, bit for bit. The save copies the
    host state before the next step moves it, and waits for a host step under way first. The run straight through is
    launched from this process (its ranks' output is not read: its metrics say where it started from)."""
    from test_faults_launched import run_here

    argv = ["train", *TINY, "--steps", "6", "--zero", "2", "--offload", "optimizer", "--checkpoint-every", "2",
            "--checkpoint-async", "--nproc", "2", "--max-restarts", "1"]
    assert run_here([*argv, "--out", str(tmp_path / "whole")]) == 0
    env = {**os.environ, FAULT_ENV: "sigkill@rank1:step5"}
    result = subprocess.run([sys.executable, "-m", "paratrain", *argv, "--out", str(tmp_path / "killed")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {name: read_metrics(tmp_path / name / "metrics.jsonl") for name in ("whole", "killed")}
    assert "resumed from" in result.stdout + result.stderr
    assert runs["whole"][0]["restored_from"] == {"source": "none"}  # the straight run resumed from nothing
    assert [r["step"] for r in runs["killed"]] == list(range(1, 7))
    assert [r["loss"] for r in runs["killed"]] == [r["loss"] for r in runs["whole"]]
    final = [CheckpointReader(tmp_path / name / "checkpoints" / "step-00000006") for name in ("whole", "killed")]
    names = sorted(final[0].names())
    assert names == sorted(final[1].names()) and any(n.endswith("/exp_avg_sq") for n in names)
    for key in names:
        assert torch.equal(final[0].read(key), final[1].read(key)), key


# -- the planner ----------------------------------------------------------------------------------------------------

def test_llama2_7b_fits_one_80gb_gpu_only_with_its_optimizer_offloaded(capsys):
    argv = ["plan", "--model", "llama2-7b", "--gpus", "1", "--gpu-memory", "80GB"]
    assert main(argv) == 0
    assert "no layout fits" in capsys.readouterr().out
    assert main([*argv, "--offload", "optimizer"]) == 0
    out = capsys.readouterr().out
    assert "best: dp=1 tp=1 pp=1" in out and "offload=optimizer" in out and "host (offloaded)" in out


def test_the_planner_moves_masters_and_moments_to_the_host_and_prices_the_host_step():
    from paratrain.models import get_model_config
    from paratrain.plan import HARDWARE_PRESETS, Layout, Workload, estimate
    from paratrain.plan.compute import offload_seconds

    model, h100 = get_model_config("llama2-7b"), HARDWARE_PRESETS["h100-80gb"]
    workload = Workload.for_model(model, seq_len=2048, global_batch=16, precision="bf16")
    layout = Layout(dp=8, zero=1, micro_batch=2, recompute="selective")
    plain = estimate(workload, layout, h100)
    offloaded = estimate(workload, dataclasses.replace(layout, offload="optimizer"), h100)
    psi = model.num_params()
    assert offloaded.memory.optimizer_state == 0 and plain.memory.optimizer_state == pytest.approx(12 * psi / 8)
    assert offloaded.memory.host == pytest.approx(16 * psi / 8)  # master, two moments, gradient buffer
    assert plain.memory.total - offloaded.memory.total == pytest.approx(12 * psi / 8)
    # the fp32 gradient out and the value back over PCIe (50 GB/s), 28 bytes per element through the host's
    # memory (100 GB/s a node, shared by its eight ranks)
    seconds = offload_seconds(h100, psi / 8, 8)
    assert seconds == pytest.approx(2 * 4 * psi / 8 / 50e9 + 28 * psi / 8 / (100e9 / 8))
    # what shows of it beside the next forward (`test_the_planner_prices_the_host_step_as_the_runtime_overlaps_it`)
    assert offloaded.time.optimizer > plain.time.optimizer + 0.5 * seconds


def test_the_planner_prices_the_host_step_as_the_runtime_overlaps_it():
    """Pipelined over the model's units (the copies out and back beside the steps of the other units), and
    overlapped with the next forward where it waits unit by unit: what shows is the host step beyond the
    forward of all units but the first, and at least one unit's pass through the pipeline."""
    from paratrain.models import get_model_config
    from paratrain.plan import HARDWARE_PRESETS, Layout, Workload, estimate
    from paratrain.plan import compute
    from paratrain.plan.compute import offload_seconds

    h100 = HARDWARE_PRESETS["h100-80gb"]
    psi = 6.74e9
    copy, host = 4 * psi / 50e9, 28 * psi / 100e9  # over PCIe at 50 GB/s; through the host's memory at 100 GB/s
    assert offload_seconds(h100, psi, 1) == pytest.approx(2 * copy + host)  # one group: one after the other
    assert offload_seconds(h100, psi, 1, groups=35) == pytest.approx(host + 2 * copy / 35)
    assert offload_seconds(h100, psi, 1, groups=35, forward=0.35) == pytest.approx(host + 2 * copy / 35
                                                                                   - 0.35 * 34 / 35)
    assert offload_seconds(h100, psi, 1, groups=35, forward=100.0) == pytest.approx((host + 2 * copy) / 35)
    assert offload_seconds(h100, psi, 1, groups=35, copies=0) == pytest.approx(host)  # offload="params"
    # Through the step's estimate: one GPU (DDP) and ZeRO-1 over eight ranks wait unit by unit, a pipeline stage
    # for all of it.
    model = get_model_config("llama2-7b")
    workload = Workload.for_model(model, seq_len=2048, global_batch=64, precision="bf16")
    for layout, overlaps in ((Layout(micro_batch=2, offload="optimizer"), True),
                             (Layout(dp=8, zero=1, micro_batch=2, offload="optimizer"), True),
                             (Layout(pp=2, micro_batch=2, offload="optimizer"), False)):
        m = layout.num_microbatches(workload.global_batch)
        waits, forward = (compute._optimizer_seconds(workload, layout, h100, 0, m, f) for f in (0.0, 0.35))
        assert waits - forward == (pytest.approx(0.35 * (model.n_layers + 2) / (model.n_layers + 3)) if overlaps
                                   else 0.0)
    assert estimate(workload, Layout(micro_batch=2, offload="optimizer"), h100).time.optimizer < \
        compute._optimizer_seconds(workload, Layout(micro_batch=2, offload="optimizer"), h100, 0, 32)


def test_a_host_too_small_for_the_offloaded_state_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from paratrain.run import memory_budget

    monkeypatch.setattr(memory_budget, "machine_memory", lambda: 1000.0)
    assert main(["train", *TINY, "--offload", "optimizer", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--offload optimizer: the host state" in err and "exceeds this machine's 1 kB" in err and "\n" not in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_refused_pinning_falls_back_to_pageable_memory_with_one_warning(monkeypatch):
    from paratrain.parallel.data.offload import can_pin

    real = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (locked pages)\nmore")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.warns(UserWarning, match=r"pinned host memory refused \(CUDA error: out of memory \(locked pages\)\); "
                                         r"using pageable memory.*ulimit -l") as caught:
        assert can_pin(torch.device("cuda")) is False
    assert len(caught) == 1
    assert can_pin(torch.device("cpu")) is False  # nothing to pin for: no warning
