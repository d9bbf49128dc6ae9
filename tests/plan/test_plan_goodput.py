"""The planner's goodput under failures: Young/Daly's waste and interval, the failure rate, the CLI's answer."""

import json
import math

import pytest

from paratrain.cli import main as cli_main
from paratrain.plan import Layout, Workload, estimate_memory, get_hardware
from paratrain.plan.goodput import best_steps, checkpoint_bytes, failures_per_day, goodput, optimal_interval, waste

SEVEN_B = ["--model", "llama2-7b", "--dp", "8", "--zero", "1", "--seq-len", "4096", "--global-batch", "64",
           "--tokens", "100B"]


def run_plan(capsys, *argv):
    code = cli_main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def young_daly_waste(c, t, r, m):
    # the expected loss per second: a save of c every t, and per failure (one per m) t/2 of work plus r
    return (c * (m / t) + t / 2 + r) / m


def test_optimal_interval_is_the_minimum_of_the_waste():
    c, r, m = 20.0, 300.0, 3 * 3600.0
    t = optimal_interval(c, m)
    assert t == pytest.approx(math.sqrt(2 * 20 * 10800))
    assert waste(c, t, r, m) == pytest.approx(young_daly_waste(c, t, r, m))
    for factor in (0.9, 0.99, 1.01, 1.1):
        assert waste(c, t * factor, r, m) > waste(c, t, r, m)


@pytest.mark.parametrize("c, step, r, m", [(20.0, 3.0, 300.0, 10800.0), (0.5, 1.3, 60.0, 86400.0),
                                           (25.0, 62.4, 320.0, 2.85e6), (1.0, 1.0, 0.0, 50.0),
                                           (20.0, 100.0, 0.0, 10800.0)])
def test_whole_step_interval_wastes_no_more_than_its_neighbours(c, step, r, m):
    n = best_steps(c, step, r, m)
    assert n >= 1
    here = young_daly_waste(c, n * step, r, m)
    assert here <= young_daly_waste(c, (n + 1) * step, r, m)
    if n > 1:
        assert here <= young_daly_waste(c, (n - 1) * step, r, m)


def test_the_interval_may_round_up():
    # T_opt = sqrt(2·20·10800) = 657 s, 6.57 steps of 100 s: 6 steps waste 20/600 + 300/10800 = 0.06111,
    # 7 steps 20/700 + 350/10800 = 0.06098
    assert best_steps(20.0, 100.0, 0.0, 10800.0) == 7


def test_an_optimum_shorter_than_a_step_saves_every_step():
    assert optimal_interval(0.01, 100.0) < 10.0
    assert best_steps(0.01, 10.0, 0.0, 100.0) == 1


def test_failure_rate_from_gpus_defaults_to_llama3():
    # Llama 3: 419 interruptions in 54 days on 16,384 GPUs
    assert failures_per_day(16384) == pytest.approx(419 / 54)
    assert failures_per_day(1024, 0.5) == pytest.approx(1024 * 0.5 / 365)


def test_snapshots_beat_disk_when_the_copy_is_faster():
    g = goodput(20e9, 2.0, 8.0, 1e9, 20e9 / 50e9, 120.0)
    m = 86400 / 8
    assert g.disk.save_s == pytest.approx(20.0) and g.disk.restart_s == pytest.approx(140.0)
    assert g.disk.waste == pytest.approx(young_daly_waste(20.0, g.disk.interval_s, 140.0, m))
    snap = young_daly_waste(0.4, g.snapshot.interval_s, 120.4, m) + 20.0 / g.disk.interval_s
    assert g.snapshot.waste == pytest.approx(snap)
    assert g.snapshot.interval_steps < g.disk.interval_steps
    assert g.snapshot.waste < g.disk.waste


def test_cli_prices_the_layout_by_the_formula(capsys):
    code, out, _ = run_plan(capsys, *SEVEN_B, "--failures-per-day", "8", "--restart-s", "120",
                            "--disk-write-gbps", "2", "--gpu-hour-price", "3", "--json")
    assert code == 0
    doc = json.loads(out)
    g, b = doc["goodput"], doc["budget"]
    psi = doc["workload"]["num_params"]
    s = 2 * psi + 12 * psi / 8  # bf16 parameters; fp32 master and Adam moments sharded over dp=8 by ZeRO-1
    assert g["checkpoint_bytes_per_rank"] == pytest.approx(s)
    assert g["mtbf_s"] == pytest.approx(86400 / 8)
    assert g["copy_bytes_per_s"] == pytest.approx(get_hardware("h100-80gb").pcie_bytes_per_s)
    step, m = b["step_s"], g["mtbf_s"]
    c_disk, c_snap = s / 2e9, s / g["copy_bytes_per_s"]
    disk, snap = g["disk_only"], g["snapshots"]
    assert disk["save_s"] == pytest.approx(c_disk) and snap["save_s"] == pytest.approx(c_snap)
    n, k = disk["interval_steps"], snap["interval_steps"]
    for steps, c, r in ((n, c_disk, 120 + c_disk), (k, c_snap, 120 + c_snap)):
        best = young_daly_waste(c, steps * step, r, m)
        assert best <= young_daly_waste(c, (steps + 1) * step, r, m)
        assert steps == 1 or best <= young_daly_waste(c, (steps - 1) * step, r, m)
        assert abs(steps * step - math.sqrt(2 * c * m)) <= step
    assert disk["goodput"] == pytest.approx(1 - young_daly_waste(c_disk, n * step, 120 + c_disk, m))
    assert snap["goodput"] == pytest.approx(1 - young_daly_waste(c_snap, k * step, 120 + c_snap, m)
                                            - c_disk / (n * step))
    assert 0 < disk["goodput"] < snap["goodput"] < 1


def test_cli_text_gives_the_lost_days_and_dollars(capsys):
    argv = [*SEVEN_B, "--gpu-failures-per-year", "40", "--gpu-hour-price", "2"]
    code, out, _ = run_plan(capsys, *argv, "--json")
    doc = json.loads(out)
    assert doc["goodput"]["failures_per_day"] == pytest.approx(8 * 40 / 365)
    days, cost = doc["budget"]["days"], doc["budget"]["cost"]
    code, text, _ = run_plan(capsys, *argv)
    assert code == 0
    for key in ("disk_only", "snapshots"):
        gp = doc["goodput"][key]["goodput"]
        # the work takes `days`; at goodput gp the run takes days / gp
        line = next(l for l in text.splitlines() if f"every {doc['goodput'][key]['interval_steps']:,} steps" in l)
        assert f"+{days / gp - days:,.2f} days" in line and f"${cost / gp - cost:,.0f}" in line
        assert f"goodput {gp:.1%}" in line


def test_goodput_is_off_without_a_failure_option(capsys):
    _, out, _ = run_plan(capsys, *SEVEN_B, "--json")
    assert "goodput" not in json.loads(out)
    _, out, _ = run_plan(capsys, *SEVEN_B, "--goodput", "--json")
    # the default: the layout's 8 GPUs at Llama 3's rate
    assert json.loads(out)["goodput"]["failures_per_day"] == pytest.approx(8 * 419 / 54 / 16384)


def test_search_prices_the_best_layout(capsys):
    code, out, _ = run_plan(capsys, "--model", "llama2-7b", "--gpus", "16", "--seq-len", "4096",
                            "--global-batch", "64", "--tokens", "100B", "--goodput", "--top", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["goodput"]["failures_per_day"] == pytest.approx(failures_per_day(16))
    assert doc["goodput"]["step_s"] == pytest.approx(doc["layouts"][0]["step_time_s"])


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--dp", "2", "--failures-per-day", "3"], "--failures-per-day needs --tokens"),
    (["--model", "tiny", "--dp", "2", "--goodput"], "--goodput needs --tokens"),
    (["--model", "tiny", "--dp", "2", "--tokens", "1B", "--failures-per-day", "0"],
     "--failures-per-day must be a positive finite number"),
    (["--model", "tiny", "--dp", "2", "--tokens", "1B", "--gpu-failures-per-year", "-1"],
     "--gpu-failures-per-year must be a positive finite number"),
    (["--model", "tiny", "--dp", "2", "--tokens", "1B", "--disk-write-gbps", "inf"],
     "--disk-write-gbps must be a positive finite number"),
    (["--model", "tiny", "--dp", "2", "--tokens", "1B", "--restart-s", "-5"],
     "--restart-s must be a non-negative finite number"),
    (["--model", "tiny", "--dp", "2", "--tokens", "1B", "--failures-per-day", "3", "--gpu-failures-per-year", "1"],
     "not both"),
])
def test_bad_failure_options_are_one_line(capsys, argv, message):
    code, out, err = run_plan(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_failure_options_have_help(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--goodput", "--failures-per-day", "--gpu-failures-per-year", "--disk-write-gbps", "--restart-s"):
        assert flag in help_text


@pytest.mark.parametrize("layout, per_param", [
    (Layout(dp=8, zero=1), 2 + 12 / 8),  # bf16 parameters; fp32 master and moments sharded
    (Layout(dp=8, zero=1, offload="optimizer"), 2 + 12 / 8),  # the same state, its optimizer in host memory
    (Layout(dp=8, zero=3), 12 / 8),  # the fp32 shard is the parameter and the master, with its moments
])
def test_checkpoint_bytes_are_parameters_master_and_moments(layout, per_param):
    psi = 8e9
    assert checkpoint_bytes(estimate_memory(Workload.for_params(psi), layout)) == pytest.approx(per_param * psi)
