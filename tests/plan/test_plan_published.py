"""The planner against published large-scale training runs: one set of constants per GPU kind, ±15 %."""

import pytest

from paratrain.cli import main as cli_main
from paratrain.plan import HARDWARE_PRESETS
from paratrain.plan.published import EXCLUDED_RUNS, PUBLISHED_RUNS, published_rows

TOLERANCE = 0.15


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=[r.name for r in PUBLISHED_RUNS])
def test_predicted_per_gpu_throughput_is_within_15_percent_of_the_published_figure(run):
    hardware = HARDWARE_PRESETS[run.gpu]  # the preset of its GPU kind: no constant belongs to one run
    predicted = run.predicted_tflops(hardware)
    assert abs(predicted / run.tflops_per_gpu - 1) <= TOLERANCE, (run.name, predicted, run.tflops_per_gpu)


def test_the_runs_span_sizes_gpu_kinds_and_layouts():
    sizes = [r.model.num_params() for r in PUBLISHED_RUNS]
    assert min(sizes) < 2e9 and max(sizes) > 500e9
    assert {r.gpu for r in PUBLISHED_RUNS} == {"a100-80gb", "h100-80gb"}
    layouts = {(r.tp > 1, r.pp > 1, r.dp > 1) for r in PUBLISHED_RUNS}
    assert (False, False, True) in layouts and (True, True, True) in layouts and (True, True, False) in layouts
    for run in PUBLISHED_RUNS + tuple(r for r, _ in EXCLUDED_RUNS):
        assert run.source and run.assumed and run.gpus == run.dp * run.tp * run.pp


def test_each_run_counts_flops_as_its_source_does():
    """Narayanan et al.'s eq. 3 counts recomputation (96 = 4 × 24); Korthikanti et al.'s MFU does not (72)."""
    narayanan = next(r for r in PUBLISHED_RUNS if r.name.startswith("GPT 1008.0B"))
    l, h, s, v = 128, 25600, 2048, 51200
    assert narayanan.flops_per_token == pytest.approx(96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)))
    # its aggregate: 163 TFLOP/s × 3072 GPUs, the table's 502.0 PFLOP/s up to the per-GPU figure's rounding
    assert narayanan.tflops_per_gpu * narayanan.gpus / 1000 == pytest.approx(502.0, abs=1.6)
    korthikanti = next(r for r in PUBLISHED_RUNS if r.name.startswith("GPT 1T"))
    assert korthikanti.flops_per_token == pytest.approx(72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)))
    assert korthikanti.tflops_per_gpu == pytest.approx(0.563 * 312)


def test_plan_published_prints_every_run_and_the_excluded_ones(capsys):
    assert cli_main(["plan", "--published"]) == 0
    out = capsys.readouterr().out
    for run in PUBLISHED_RUNS:
        assert run.name in out
    assert out.count("(not checked)") == len(EXCLUDED_RUNS)
    assert f"{len(PUBLISHED_RUNS)} of {len(PUBLISHED_RUNS)} checked runs within ±15 %" in out
    rows = published_rows()
    assert all(abs(r["ratio"] - 1) > TOLERANCE for r in rows if r["excluded"])  # why they are not checked
