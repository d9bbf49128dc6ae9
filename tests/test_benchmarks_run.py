"""Every benchmark script starts and explains itself: one that no longer imports would otherwise go unseen
(they run on demand, not in the suite)."""

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
