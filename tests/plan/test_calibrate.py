"""`paratrain plan --calibrate`: the fits recover known constants; a real (quick) calibration writes a
profile that `plan --hardware FILE` uses. No timing is asserted (benchmarks/bench_plan.py measures)."""

import dataclasses
import json

import pytest

from paratrain.cli import main as cli_main
from paratrain.models import get_model_config
from paratrain.parallel.rules import DEFAULT_LOSS_CHUNK
from paratrain.plan import (
    COLLECTIVE_KINDS,
    HARDWARE_PRESETS,
    Collective,
    GemmCurve,
    Layout,
    PlanError,
    Workload,
    get_hardware,
    load_profile,
    save_profile,
    step_time,
)
from paratrain.plan.calibrate import CalibrationPlan, choose_device
from paratrain.plan.fit import CalibrationError, fit_flash_attention, fit_gemm_curve, fit_link
from paratrain.plan.ops import FLASH_BACKWARD_MATMULS, Shape, attention_seconds
from paratrain.plan.measure import _sample, device_sync
from paratrain.plan.hardware import ELEMENTWISE_ACCESSES, hardware_to_dict


def test_gemm_fit_recovers_plateau_and_half_size():
    plateau, half = 90e9, 40.0
    curve = GemmCurve(1.0, half)
    shapes = [(64, 64, 64), (128, 512, 256), (512, 64, 256), (1024, 1024, 1024), (4096, 512, 512)]
    rows = [(m, n, k, 2 * m * n * k / (plateau * curve.efficiency(m, n, k))) for m, n, k in shapes]
    peak, fitted = fit_gemm_curve(rows)
    assert peak == pytest.approx(plateau) and fitted.half_size == pytest.approx(half)
    assert fit_gemm_curve(rows[:1])[1] == GemmCurve(1.0, 0.0)  # one shape: its throughput is the plateau


def test_link_fit_recovers_latency_and_bandwidth():
    alpha, beta = 0.4e-3, 1.5e9
    sizes = [2**14, 2**18, 2**20, 2**22, 2**24]
    for kind in COLLECTIVE_KINDS:
        rows = [(size, Collective(kind, size, 2).seconds(beta, alpha)) for size in sizes]
        cost = fit_link(kind, 2, rows)
        assert cost.latency_s == pytest.approx(alpha) and cost.bytes_per_s == pytest.approx(beta)
    flat = [(size, 1e-3) for size in sizes]  # no growth with size: nothing to fit a bandwidth to
    assert fit_link("all_reduce", 2, flat).latency_s == 0.0
    with pytest.raises(CalibrationError, match="--nproc must be an integer of at least 2"):
        CalibrationPlan(nproc=1)


def test_flash_attention_fit_separates_the_kernel_from_its_per_call_overhead():
    """A GPU's attention call at calibration sizes is mostly launches: read as a slow kernel, the first
    H200 profile predicted the 1B step at 0.70 of its time (efficiency 0.19 where the kernel runs at ~1.2)."""
    efficiency, overhead = 1.15, 90e-6
    hw = dataclasses.replace(HARDWARE_PRESETS["h200"], attention_efficiency=efficiency, attention_overhead_s=overhead)
    shapes = [(1, 16, 2048, 128), (4, 16, 2048, 128), (1, 32, 4096, 128)]
    rows = []
    for b, h, s, d in shapes:
        x = Shape(tokens=float(b * s), seq_len=s, batch=b, hidden=h * d, q_width=float(h * d), kv_width=float(h * d),
                  ffn=0.0, local_heads=float(h), head_dim=d, vocab=0.0, residual=float(h * d), dtype="bf16",
                  flash=True)
        rows.append((b, h, s, d, attention_seconds(hw, x, 2)
                     + attention_seconds(hw, x, FLASH_BACKWARD_MATMULS, backward=True)))
    fitted, per_pass = fit_flash_attention(rows, HARDWARE_PRESETS["h200"], "bf16")
    assert fitted == pytest.approx(efficiency) and per_pass == pytest.approx(overhead)
    # one shape cannot tell the two apart: no overhead, its whole time read as the kernel's
    alone, none = fit_flash_attention(rows[:1], HARDWARE_PRESETS["h200"], "bf16")
    assert none == 0.0 and alone < efficiency
    assert len({b * h * s * s for b, h, s, d in CalibrationPlan.gpu(1, quick=True).attention_shapes}) >= 2


def test_a_gpu_is_calibrated_where_there_is_one_and_the_cpu_elsewhere():
    assert choose_device(None, cuda_available=True, gpus=8) == "cuda"
    assert choose_device(None, cuda_available=False, gpus=0) == "cpu"
    assert choose_device(None, cuda_available=True, gpus=0) == "cpu"  # CUDA built in, no device visible
    assert choose_device("cpu", cuda_available=True, gpus=8) == "cpu"
    with pytest.raises(CalibrationError, match="torch sees no GPU"):
        choose_device("cuda", cuda_available=False, gpus=0)
    with pytest.raises(CalibrationError, match="not one of: cpu, cuda"):
        choose_device("tpu", cuda_available=False, gpus=0)


def test_a_gpu_plan_measures_its_kernels_and_nccl_collectives_only_between_gpus():
    one, eight = CalibrationPlan.gpu(1), CalibrationPlan.gpu(8)
    assert one.device == eight.device == "cuda" and one.attention_dtype == "bf16"
    # one GPU: no peer to measure links with; the host's step and copies for offload
    assert one.phases == ("gemm", "attention", "memory", "elementwise", "host_ops", "host")
    assert eight.phases == one.phases + ("collectives",) and eight.nproc == 8
    assert CalibrationPlan().phases[-4:] == ("collectives", "collectives_shared", "overlap", "host")  # the CPU's
    assert CalibrationPlan.gpu(2, quick=True).device == "cuda"
    with pytest.raises(CalibrationError, match="at least 1 on cuda"):
        CalibrationPlan.gpu(0)


def test_each_timing_waits_for_the_device_before_reading_the_clock(monkeypatch):
    """A GPU queues kernels and returns: every clock reading of a sample must follow a synchronize."""
    import paratrain.plan.measure as measure

    events = []
    clock = iter(range(10**6))
    monkeypatch.setattr(measure.time, "perf_counter", lambda: events.append("clock") or next(clock) * 1e-3)
    seconds = _sample(lambda: events.append("op"), min_seconds=0.01, repeats=3, sync=lambda: events.append("sync"))
    assert seconds > 0
    readings = [i for i, e in enumerate(events) if e == "clock"]
    assert events[readings[0] - 1] == "sync" and all(events[i - 1] in ("sync", "clock") for i in readings)
    assert events[-2:] == ["sync", "clock"]  # the final reading waits for the last queued call
    assert device_sync("cpu")() is None  # a CPU has nothing to wait for
    import torch

    assert device_sync("cuda") is torch.cuda.synchronize


def test_profiles_round_trip_as_json_and_refuse_unknown_fields(tmp_path):
    hw = dataclasses.replace(get_hardware("a100-80gb"), name="custom", host_cores=4,
                             elementwise={"binary": ((1e4, 1e9), (1e6, 2e9))})
    path = save_profile(hw, tmp_path / "p.json")
    assert load_profile(path) == hw
    data = json.loads(path.read_text())
    data["turbo"] = True
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="unknown field 'turbo'"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(PlanError, match="is not readable JSON"):
        load_profile(tmp_path / "junk.json")
    (tmp_path / "old.json").write_text(json.dumps({**hardware_to_dict(hw), "format": 0}))
    with pytest.raises(PlanError, match="not a paratrain hardware profile"):
        load_profile(tmp_path / "old.json")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One real calibration, quick plan, on 2 gloo ranks, through the command line."""
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    assert cli_main(["plan", "--calibrate", "--quick", "--nproc", "2", "--out", str(path), "--json"]) == 0
    return path


def test_calibration_writes_a_complete_cpu_profile(calibrated, capsys):
    capsys.readouterr()
    hw = load_profile(calibrated)
    assert hw.host_cores == hw.gpus_per_node >= 1
    assert set(hw.collectives) == set(hw.collectives_shared) == set(COLLECTIVE_KINDS)
    assert set(hw.elementwise) == set(ELEMENTWISE_ACCESSES) and hw.op_overhead_s > 0
    for dtype in ("fp32", "bf16", "fp16"):
        assert hw.peak(dtype) > 0 and 0 < hw.gemm(dtype).peak_efficiency <= 1
    assert 0 <= hw.comm_overlap <= 1 and hw.attention_efficiency > 0
    assert "paratrain plan --calibrate" in hw.source and "2 ranks" in hw.source
    # the offloaded step's host traffic, measured (a CPU's copies stay in its memory: no host link)
    assert hw.host_bytes_per_s > 1e8 and hw.pcie_bytes_per_s == 0
    # the host's work per eager operation, and what selective recomputation's dispatch mode adds to it
    assert 1e-7 < hw.host_op_s < 1e-3 and hw.host_selective_op_s > 0


def test_plan_uses_the_calibrated_profile(calibrated, capsys):
    hw = load_profile(calibrated)
    argv = ["plan", "--model", "tiny", "--dp", "2", "--zero", "1", "--micro-batch", "4", "--seq", "128",
            "--global-batch", "16", "--precision", "fp32", "--json"]
    assert cli_main([*argv, "--hardware", str(calibrated)]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    work = Workload.for_model(get_model_config("tiny"), seq_len=128, global_batch=16, precision="fp32",
                              loss_chunk=DEFAULT_LOSS_CHUNK)  # the trainer's fused loss, as `plan` prices it
    expected = step_time(work, Layout(dp=2, zero=1, micro_batch=4), hw)
    assert row["step_time_s"] == pytest.approx(expected.total)
    assert cli_main(argv) == 0  # the default preset predicts something else
    assert json.loads(capsys.readouterr().out)["layouts"][0]["step_time_s"] != pytest.approx(expected.total)
    assert cli_main(["plan", "--model", "tiny", "--hardware", str(calibrated)]) == 0
    assert f"× {hw.name} (" in capsys.readouterr().out


def test_the_host_measurement_is_the_fused_adamw_traffic_of_every_rank_at_once():
    """`measure_host` times torch's fused CPU AdamW (28 bytes per parameter); the profile's node rate is the
    slowest rank's times the ranks, and the planner's host step follows it."""
    from paratrain.plan.calibrate import _host_rate, _reduce
    from paratrain.plan.hardware import HARDWARE_PRESETS
    from paratrain.plan.measure import measure_host

    plan = CalibrationPlan.quick()
    rate = measure_host(0, 2, plan)["adamw"]
    assert 1e8 < rate < 1e13
    reduced = _reduce("host", [{"adamw": 3e9}, {"adamw": 2e9}])
    assert reduced == {"adamw": 2e9} and _host_rate({"host": reduced}, plan) == 4e9
    import dataclasses

    hw = dataclasses.replace(HARDWARE_PRESETS["h100-80gb"], host_bytes_per_s=4e9)
    assert hw.host_seconds(28e9, 2) == pytest.approx(14.0)  # two ranks of a node share its 4 GB/s


def test_host_fit_recovers_the_costs_it_was_made_with():
    """`fit_host` inverts the planner's host rule: timings made by that rule with known costs give them back."""
    from paratrain.plan.fit import fit_host
    from paratrain.plan.host import host_times
    from paratrain.plan.measure import HOST_VARIANTS
    from paratrain.plan.memory import Recompute

    costs = dict(host_op_s=12e-6, host_full_op_s=7e-6, host_selective_op_s=40e-6, host_unit_s=300e-6)
    hw = dataclasses.replace(HARDWARE_PRESETS["h200"], **costs)
    x = Shape.of(get_model_config("tiny"), 1, 32, 1, False, "bf16", True)
    measured = {"layers": 4}
    for name, (zero, recompute) in HOST_VARIANTS.items():
        times = host_times(hw, x, 4, Recompute(recompute), zero == 3, True, True).total
        measured[name] = (times.forward, times.backward)
    fitted = fit_host(measured, HARDWARE_PRESETS["h200"])
    assert fitted == pytest.approx(costs)
    noisy = {**measured, "full": measured["none"]}  # full recomputation measured no dearer than none: noise
    assert fit_host(noisy, HARDWARE_PRESETS["h200"])["host_full_op_s"] == 0.0


@pytest.fixture
def one_thread():
    """One thread, as a calibrating rank runs (on a busy machine more threads wait for each other)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_host_measurement_predicts_a_deeper_models_host_time(one_thread):
    """The costs measured on the 4-block model predict the host's time of a 16-block one, the 1B's depth (forward
    + backward, as it is and with selective recomputation), within a factor 2 on this CPU (0.8-1.4 measured on a
    loaded machine): costs per operation; a cost per step would be ~3.5x short."""
    import torch

    from paratrain.mesh import Mesh, MeshShape
    from paratrain.models.configs import ModelConfig
    from paratrain.models.llama import Transformer
    from paratrain.parallel.api import parallelize
    from paratrain.plan.fit import fit_host
    from paratrain.plan.host import host_times
    from paratrain.plan.measure import HOST_MODEL, _host_step, measure_host_ops
    from paratrain.plan.memory import Recompute

    costs = fit_host(measure_host_ops(0, 1, CalibrationPlan.quick()), HARDWARE_PRESETS["h200"])
    hw = dataclasses.replace(HARDWARE_PRESETS["h200"], **costs)
    cfg = ModelConfig(**{**HOST_MODEL, "n_layers": 16})
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1))
    x = Shape.of(cfg, 1, cfg.max_seq_len, 1, False, "bf16", True)
    for recompute in ("none", "selective"):
        with torch.device("meta"):
            model = Transformer(cfg)
        model, _ = parallelize(model, Mesh(shape=MeshShape(), rank=0, groups={}), activation_checkpointing=recompute,
                               precision="bf16")
        samples = sorted(sum(_host_step(model, tokens[:, :-1], tokens[:, 1:], device_sync("cpu"))) for _ in range(9))
        predicted = host_times(hw, x, 16, Recompute(recompute), False, True, True).total
        ratio = samples[4] / (predicted.forward + predicted.backward)
        assert 0.5 < ratio < 2.0, (recompute, ratio)
