"""Traps for what only a GPU with NCCL would show, set on the CPU.

Default device: with `torch.set_default_device("meta")` around the training steps while the model
lives on the CPU, any tensor paratrain allocates without naming a device lands on meta and the first
op that mixes it with a real tensor fails ("... is on device meta ..."), as a CPU tensor fed to an
NCCL collective would on a GPU. The whole layout matrix runs under the trap: DDP, ZeRO-1/2/3, TP,
TP+SP, every pipeline schedule, 2D, 3D, a checkpoint save and load, and steps of the trainer.

Rendezvous sends: gloo buffers a send, NCCL may not return from one until its receive is posted.
With `Comm(mesh, rendezvous=True)` every send waits for the receiver's acknowledgement: every
schedule must train there to the losses of the normal mode, and a schedule whose transfers are
grouped one action at a time (interleaved 1F1B, which then deadlocks under NCCL) must hang until the
process group's timeout says so.

CUDA before the fork: workers are forked from a server that imported torch (`paratrain.forkserver`);
a CUDA context made there would be unusable in every forked worker. Importing what the server
preloads must never initialize CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import pytest
import torch

from paratrain import DataParallel, PipelineParallel, TensorParallel, init_mesh
from paratrain.parallel.api import parallelize_run
from paratrain.checkpoint import CheckpointReader, DistCoordinator, save_checkpoint
from paratrain.comm import Comm
from paratrain.parallel.pipeline.schedules import ScheduleError, build_schedule
from paratrain.parallel.pipeline.simulator import check_rendezvous
from paratrain.testing import RankFailure, run_on_ranks
from paratrain.models import ModelConfig, Transformer
from paratrain.run.model_state import load_model_shards, model_shards
from paratrain.train import train_step
from parallel_cases import adamw, batches, launch_once

def _torch_adam_steps_on_the_default_device() -> bool:
    """Whether this torch's own single-tensor Adam makes its `step` counter on the default device (torch
    before 2.13 does: `torch.tensor(0.0)`, where 2.13 names the CPU). That allocation is torch's, not
    paratrain's; under the trap the optimizer then runs fused, whose `step` follows its parameter."""
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.zeros(1)
    optimizer = torch.optim.AdamW([param])
    with torch.device("meta"):
        try:
            optimizer.step()
        except RuntimeError:  # Tensor.item() cannot be called on meta tensors: the `step` just made
            pass
    return optimizer.state[param]["step"].is_meta


trap_adamw = functools.partial(adamw, fused=True) if _torch_adam_steps_on_the_default_device() else adamw


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    offload: str | None = None

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _config(layout: Layout) -> ModelConfig:
    """MODEL with a block per pipeline stage (two at least): what a layout allocates per block is the same in every
    block, so more blocks than stages add steps' work and no allocation site."""
    return dataclasses.replace(MODEL, n_layers=max(MODEL.n_layers, layout.pp * layout.virtual_stages))


MATRIX = {
    **{f"dp2_zero{z}": Layout(dp=2, zero=z) for z in range(4)},
    "tp2": Layout(tp=2),
    "tp2_sp": Layout(tp=2, sp=True),
    **{f"pp2_{s}": Layout(pp=2, schedule=s) for s in ("gpipe", "1f1b", "zb-h1")},
    "pp2_interleaved_v2": Layout(pp=2, schedule="interleaved", virtual_stages=2),
    "dp2_tp2_zero1": Layout(dp=2, tp=2, zero=1),
    "dp2_tp2_sp_zero3": Layout(dp=2, tp=2, zero=3, sp=True),
    "pp2_dp2_tp2_zero1": Layout(pp=2, dp=2, tp=2, zero=1),
    "dp2_zero2_offload": Layout(dp=2, zero=2, offload="optimizer"),
    "dp2_tp2_sp_zero3_offload_params": Layout(dp=2, tp=2, zero=3, sp=True, offload="params"),
}


RENDEZVOUS = {f"pp{pp}_{s}": Layout(pp=pp, schedule=s, virtual_stages=2 if s == "interleaved" else 1)
              for pp in (2, 4) for s in ("gpipe", "1f1b", "interleaved", "zb-h1")}


def _model(layout: Layout, mesh, comm: Comm | None = None):
    """The reference model built on meta and parallelized with the default device set to meta as well: a
    shard, bucket or buffer made on the default device instead of the mesh's stays meta and fails later."""
    with torch.device("meta"):
        model = Transformer(_config(layout))
        return parallelize_run(
            model, mesh, optimizer=trap_adamw,
            data=DataParallel(zero=layout.zero, grad_reduction="sum", offload=layout.offload),
            tensor=TensorParallel(sequence_parallel=layout.sp), comm=comm,
            pipeline=PipelineParallel(schedule=layout.schedule, virtual_stages=layout.virtual_stages))


def _steps(layout: Layout, root: str | None):
    """Two steps under the trap (and a checkpoint round trip for dp2 ZeRO-3); the losses."""
    mesh = init_mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp)
    model, optimizer = _model(layout, mesh)
    rows = 8 // layout.dp
    data = [(x[mesh.coord("dp") * rows:(mesh.coord("dp") + 1) * rows], y[mesh.coord("dp") * rows:][:rows])
            for x, y in batches(vocab=64, steps=2, batch=8, seq=16)]
    micro = rows // (2 * layout.pp) if layout.pp > 1 else rows
    losses = []
    with torch.device("meta"):  # the trap: an allocation without a device fails from here on
        for step, (x, y) in enumerate(data, start=1):
            pieces = [(x[i:i + micro], y[i:i + micro]) for i in range(0, rows, micro)]
            losses.append(train_step(model, optimizer, pieces, 1.0).loss)
        if root is not None:
            save_checkpoint(root, 2, model_shards(model, optimizer), coordinator=DistCoordinator())
            load_model_shards(model, optimizer, CheckpointReader(f"{root}/step-00000002"))
    return losses


def _pipeline_losses(layout: Layout, rendezvous: bool, steps: int = 2) -> list[float]:
    """`steps` steps of 2·pp micro-batches, sends buffered (gloo) or rendezvous (as NCCL's may be)."""
    mesh = init_mesh(pp=layout.pp)
    model, optimizer = _model(layout, mesh, Comm(mesh, rendezvous=rendezvous))
    micro = 8 // (2 * layout.pp)
    return [train_step(model, optimizer, [(x[i:i + micro], y[i:i + micro]) for i in range(0, 8, micro)], 1.0).loss
            for x, y in batches(vocab=64, steps=steps, batch=8, seq=16)]


def _matrix(rank, world, root):
    out = {name: _steps(layout, f"{root}/{name}" if name == "dp2_zero3" else None)
           for name, layout in MATRIX.items() if layout.world == world}
    out.update({f"rendezvous_{name}": (_pipeline_losses(layout, False), _pipeline_losses(layout, True))
                for name, layout in RENDEZVOUS.items() if layout.world == world})
    return out


_RESULTS: dict = {}


@pytest.mark.parametrize("name", list(MATRIX))
def test_no_allocation_falls_back_to_the_default_device(name, tmp_path_factory):
    world = MATRIX[name].world
    root = str(tmp_path_factory.getbasetemp() / f"gpu-traps-{world}")
    losses = launch_once(_RESULTS, world, _matrix, root, timeout=600)[0][name]
    assert len(losses) == 2 and all(loss == loss for loss in losses)


def _trainer_under_trap(rank, world, out):
    import paratrain.train as trainer
    from paratrain.config import Config

    def trapped(*args, **kwargs):
        with torch.device("meta"):
            return step(*args, **kwargs)

    step, trainer.train_step = trainer.train_step, trapped
    cfg = Config()
    cfg.model.n_layers, cfg.model.dim, cfg.model.ffn_dim = 2, 32, 64
    cfg.data.seq_len = 32
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch = 3, 4, 2
    cfg.train.sample_tokens, cfg.train.eval_every = 0, 0
    cfg.parallel.zero, cfg.checkpoint.every = 3, 2
    cfg.run.out, cfg.run.progress = out, False
    return trainer.train(cfg).final_loss


def test_trainer_steps_under_the_trap(tmp_path):
    losses = run_on_ranks(_trainer_under_trap, 2, str(tmp_path / "run"), timeout=240)
    assert losses[0] == losses[1] and losses[0] == losses[0]


@pytest.mark.parametrize("name", list(RENDEZVOUS))
def test_every_schedule_trains_when_sends_wait_for_their_receives(name, tmp_path_factory):
    world = RENDEZVOUS[name].world
    root = str(tmp_path_factory.getbasetemp() / f"gpu-traps-{world}")
    buffered, rendezvous = launch_once(_RESULTS, world, _matrix, root, timeout=600)[0][f"rendezvous_{name}"]
    assert rendezvous == buffered and len(buffered) == 2


def one_action_per_group(schedule):
    """The schedule with its transfers grouped one action at a time (no forward-backward pairs)."""
    return dataclasses.replace(schedule, segments=())


def test_the_simulator_finds_the_deadlock_of_one_action_per_group():
    schedule = build_schedule("interleaved", 2, 4, 2)
    check_rendezvous(schedule)
    with pytest.raises(ScheduleError, match="deadlock when sends wait for their receives: rank 0 waits to send"):
        check_rendezvous(one_action_per_group(schedule))


def _misordered(rank, world):
    mesh = init_mesh(pp=2, dp=2, timeout_s=3)  # pp groups of their own, with a short timeout
    layout = Layout(pp=2, schedule="interleaved", virtual_stages=2)
    model, optimizer = _model(layout, mesh, Comm(mesh, rendezvous=True))
    model.pipeline._schedules[4] = one_action_per_group(model.pipeline.schedule(4))  # skips the validation
    x, y = batches(vocab=64, steps=1, batch=4, seq=16)[0]
    train_step(model, optimizer, [(x[i:i + 1], y[i:i + 1]) for i in range(4)], 1.0)


def test_a_misordered_schedule_hangs_until_the_timeout_says_so():
    with pytest.raises(RankFailure, match="Timed out waiting 3000ms"):
        run_on_ranks(_misordered, 4, timeout=120)


# -- diagnosis from torch's flight recorder (NCCL's per-rank history), on a recorded dump -------------

def _stuck_collective(rank, world, directory):
    """Two all-reduces over dp on both ranks, then a third that rank 1 never issues; each rank's flight record."""
    import time
    from pathlib import Path

    from paratrain.run.diagnose import FLIGHT_PREFIX, write_flight_record

    mesh = init_mesh(dp=2, timeout_s=3)
    comm = Comm(mesh)
    for _ in range(2):
        comm.all_reduce(torch.ones(4), "dp")
    timed_out = Path(directory) / "rank0-timed-out"
    if rank == 0:
        with pytest.raises(RuntimeError, match="Timed out"):
            comm.all_reduce(torch.ones(4), "dp")  # rank 1 never arrives: the group's timeout ends it
    write_flight_record(Path(directory) / f"{FLIGHT_PREFIX}{rank}")
    if rank == 0:
        timed_out.touch()
        return
    # Alive while rank 0 waits, as a rank stuck outside a collective is: had it exited, rank 0's
    # collective would end with "connection closed" instead. Until rank 0 says so, however long that takes.
    deadline = time.monotonic() + 50
    while not timed_out.exists():
        assert time.monotonic() < deadline, "rank 0's all-reduce never timed out"
        time.sleep(0.05)


def test_the_flight_recorder_names_the_rank_and_the_collective(tmp_path):
    from paratrain.run.diagnose import describe_flight_records

    run_on_ranks(_stuck_collective, 2, str(tmp_path), timeout=60, env={"TORCH_FR_BUFFER_SIZE": "100"})
    line = describe_flight_records(tmp_path, 2)
    assert line == ("rank 1 never issued collective #3 all_reduce over dp sizes [[4]] that rank(s) [0] wait in; "
                    "its last there was #2 all_reduce over dp sizes [[4]]"), line


def test_a_pickled_flight_record_is_read_as_plain_data_only(tmp_path):
    """NCCL's dump on timeout is a pickle: its plain data is read, anything that names code is refused."""
    import json
    import pickle

    from paratrain.run.diagnose import read_flight_record

    record = {"version": "2.10", "entries": [{"collective_seq_id": 1, "process_group": ["1", "tp"],
                                              "profiling_name": "nccl:all_reduce", "input_sizes": [[8]],
                                              "state": "started", "is_p2p": False}]}
    (tmp_path / "plain").write_bytes(pickle.dumps(record))
    (tmp_path / "json").write_text(json.dumps(record))
    assert read_flight_record(tmp_path / "plain") == record == read_flight_record(tmp_path / "json")

    class Exploit:
        def __reduce__(self):
            return (print, ("executed",))

    (tmp_path / "evil").write_bytes(pickle.dumps({"entries": [Exploit()]}))
    assert read_flight_record(tmp_path / "evil") is None


def _entry(record: int, group: str, axis: str, name: str, *, seq: int = 1, p2p_seq: int = 0, state: str = "completed",
           sizes=((4, 8),)) -> dict:
    """One flight-recorder entry as NCCL's dump holds it (torch.distributed.flight_recorder reads the same keys)."""
    sizes = [list(s) for s in sizes]
    return {"record_id": record, "pg_id": int(group), "process_group": [group, axis], "collective_seq_id": seq,
            "p2p_seq_id": p2p_seq, "op_id": record + 1, "profiling_name": f"nccl:{name}",
            "time_created_ns": 1_000 * record, "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes),
            "output_sizes": sizes, "output_dtypes": ["Float"] * len(sizes), "state": state,
            "retired": state == "completed", "timeout_ms": 600_000, "is_p2p": " " in name or name == "coalesced"}


def _write_dumps(directory, entries: dict[int, list[dict]]) -> None:
    """Each rank's dump as NCCL writes it on a timeout: a pickle of plain data, with the group table."""
    import pickle

    from paratrain.run.diagnose import FLIGHT_PREFIX

    groups = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}, "1": {"name": "1", "desc": "pp", "ranks": "[0, 1]"}}
    for rank, mine in entries.items():
        (directory / f"{FLIGHT_PREFIX}{rank}").write_bytes(
            pickle.dumps({"version": "2.10", "pg_config": groups, "entries": mine}))


def test_a_pipeline_hang_is_named_from_the_transfers_when_the_collectives_agree(tmp_path):
    """pp=2: stage 0 sent its activations (a batch_isend_irecv: its ops, then the batch's own entry) and waits for
    the gradients, which stage 1 never sent; every collective agrees and completed."""
    from paratrain.run.diagnose import describe_flight_records

    both = [_entry(0, "0", "default_pg", "all_reduce")]
    _write_dumps(tmp_path, {
        0: both + [_entry(1, "1", "pp", "send 0->1", p2p_seq=1, state="scheduled"),
                   _entry(2, "1", "pp", "coalesced", p2p_seq=1),
                   _entry(3, "1", "pp", "recv 0<-1", p2p_seq=2, state="started")],
        1: both + [_entry(1, "1", "pp", "recv 1<-0", p2p_seq=1)],
    })
    line = describe_flight_records(tmp_path, 2)
    assert line == ("rank 0 waits in transfer #2 over pp (recv from rank 1 sizes [[4, 8]]), started, not completed; "
                    "rank 1 never posted its side (a pipeline hang): its last transfer with rank 0 there was "
                    "#1 over pp (recv from rank 0 sizes [[4, 8]]), completed"), line


def test_two_stages_that_both_wait_to_send_are_named_together(tmp_path):
    from paratrain.run.diagnose import describe_flight_records

    _write_dumps(tmp_path, {0: [_entry(0, "1", "pp", "send 0->1", p2p_seq=1, state="started")],
                            1: [_entry(0, "1", "pp", "send 1->0", p2p_seq=1, state="started")]})
    line = describe_flight_records(tmp_path, 2)
    assert line == ("rank 0 waits in transfer #1 over pp (send to rank 1 sizes [[4, 8]]), started, not completed; "
                    "rank 1 waits in transfer #1 over pp (send to rank 0 sizes [[4, 8]]) too"), line


# -- where the flight recorder dumps: set before the process group exists -------------------------------

def test_under_plain_torchrun_the_flight_records_go_into_the_run_before_the_group_exists(tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 2 -m paratrain train` on GPUs, no --out and no run id: each rank's dump prefix is
    set before init_process_group, in the run's diagnostics (where the failure summary reads), the same run on
    every rank. Simulated: CUDA present, torchrun's agent store hosted here, init_process_group stopped."""
    from datetime import timedelta

    import torch.distributed as dist

    import paratrain.run.build as build
    from paratrain.cli import build_parser
    from paratrain.commands.train import config_from_args
    from paratrain.run.diagnose import FLIGHT_PREFIX
    from paratrain.run.rundir import diagnostics_dir
    from paratrain.train import train

    class Stop(Exception):
        pass

    seen = {}

    def init_process_group(*args, **kwargs):
        seen[os.environ["RANK"]] = {v: os.environ.get(v) for v in ("TORCH_FR_DUMP_TEMP_FILE",
                                                                     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}
        raise Stop

    agent = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(agent.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    outs, agreed = {}, []
    import paratrain.train as trainer  # the run directory each rank's train() agreed on (its config is left as given)

    monkeypatch.setattr(trainer, "shared_run_dir",
                        lambda cfg, store, share=trainer.shared_run_dir: agreed.append(share(cfg, store)) or agreed[-1])
    for rank in ("0", "1"):
        for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                     "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
            monkeypatch.delenv(name, raising=False)  # each rank a process of its own
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        # The ranks' clocks disagree: each proposes its own name for the run.
        monkeypatch.setattr(build.time, "strftime", lambda fmt, rank=rank: f"clock-of-rank-{rank}")
        cfg = config_from_args(build_parser().parse_args(["train", "--model", "tiny", "--mem-budget", "16GB"]))
        with pytest.raises(Stop):
            train(cfg)
        outs[rank] = agreed[-1]
    assert outs == {"0": "runs/tiny-clock-of-rank-0", "1": "runs/tiny-clock-of-rank-0"}, "one run, rank 0's name"
    prefix = str(diagnostics_dir(Path(outs["0"])) / FLIGHT_PREFIX)
    expected = {"TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    assert seen == {"0": expected, "1": expected}


def test_what_the_forkserver_preloads_never_initializes_cuda():
    """Every module the worker server imports, with CUDA's initialization made to fail: none may call it. Nor may
    one run a backward: autograd's first backward starts its device threads, which on a CUDA build count the
    GPUs through the driver (cuInit), so every worker forked from the server failed its first CUDA call with
    "CUDA error: initialization error" (seen on an H200: a probe run at import in paratrain.compat)."""
    import subprocess
    import sys

    from paratrain import forkserver

    modules = [*forkserver.PRELOAD, "paratrain.forkserver", "paratrain.testing", "paratrain.launch",
               "paratrain.plan.calibrate", "paratrain.forkserver_preloaded"]
    code = ("import torch, torch.cuda, torch.autograd, torch.autograd.graph\n"
            "def trapped(*a, **k): raise SystemExit('CUDA initialized while importing the preload')\n"
            "def engine(*a, **k): raise SystemExit('autograd backward run while importing the preload')\n"
            "torch.cuda._lazy_init = trapped\n"
            "torch.autograd._engine_run_backward = torch.autograd.graph._engine_run_backward = engine\n"
            f"for name in {modules!r}: __import__(name)\n"
            "assert not torch.cuda.is_initialized()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _trap_cuda(monkeypatch):
    """This process sees one GPU; initializing CUDA, or asking the driver rather than NVML, raises."""
    import os

    def initialized(*args, **kwargs):
        raise AssertionError("CUDA initialized in a process that ranks are forked from")

    def available():
        if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":
            raise AssertionError("CUDA's availability asked of the driver (cuInit), not NVML")
        return True

    monkeypatch.setattr(torch.cuda, "_lazy_init", initialized)
    monkeypatch.setattr(torch.cuda, "get_device_properties", initialized)
    monkeypatch.setattr(torch.cuda, "is_available", available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_calibrating_a_gpu_never_initializes_cuda_in_the_calibrating_process(monkeypatch):
    """`plan --calibrate` on a GPU machine: the GPUs are counted through NVML and the machine described without
    touching CUDA; a GPU's name and memory come from a rank (`gpu_info`)."""
    from paratrain.distributed import visible_gpus
    from paratrain.plan import calibrate

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    _trap_cuda(monkeypatch)
    assert visible_gpus() == 1
    assert calibrate.choose_device(None, True, 1) == "cuda"
    info = calibrate.machine_info()
    assert "device_name" not in info and info["cores"] >= 1


def _cuda_check_of_a_rank(rank, world):
    import os

    return os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")


def test_the_worker_server_and_its_ranks_ask_nvml_whether_cuda_is_there():
    """A server that asked the CUDA driver whether a GPU is there (torch.cuda.is_available() without NVML) would
    give every rank forked from it "CUDA error: initialization error" at its first CUDA call."""
    from paratrain.testing import run_on_ranks

    assert run_on_ranks(_cuda_check_of_a_rank, 1) == ["1"]
