"""Every benchmark script starts and explains itself: one that no longer imports would otherwise go unseen
(they run on demand, not in the suite)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_answers_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def _bench_gpu(tmp_path, *args):
    script = Path(__file__).parent.parent / "benchmarks" / "bench_gpu.py"
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--size", "tiny", "--steps", "2",
                             "--warmup", "1", "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (path,) = tmp_path.glob("gpu-bench-*.json")
    assert path.with_suffix(".md").exists()
    return json.loads(path.read_text())["rows"]


def test_bench_gpu_dry_run_on_cpu(tmp_path):
    """The GPU benchmark's rows run end to end on a tiny model on the CPU (compiled rows left out: inductor's
    CPU compilation alone takes longer than the rest); rows this build cannot run say so instead of failing."""
    rows = _bench_gpu(tmp_path, "--no-compile")
    ran = {r["row"]: r for r in rows if r["status"] == "ok"}
    assert {"plain PyTorch eager", "FSDP2 eager", "paratrain ZeRO-0 eager", "paratrain ZeRO-3 eager"} <= set(ran)
    for r in ran.values():
        s = r["step_s"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and len(s["all"]) == 2
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / s["median"])
        assert r["predicted"]["peak_bytes"] > 0  # the planner's estimate of the same layout
    compiled = [r for r in rows if r["compile"]]
    assert compiled and all(r["status"] == "skipped: --no-compile" for r in compiled)
    assert all(r["status"] == "ok" or r["status"].startswith(("skipped", "not available in this build"))
               for r in rows)
    large = [r for r in rows if r["model"] == "large" and not r["compile"]]
    assert large and all(r["status"] == "skipped: the large model needs a CUDA device" for r in large)


def test_bench_gpu_starts_no_row_after_its_budget(tmp_path):
    rows = _bench_gpu(tmp_path, "--budget-s", "0")
    assert rows and all(r["status"].startswith("skipped: budget spent") for r in rows)
