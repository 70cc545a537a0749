"""Benchmark command lines refuse counts below 1 with argparse's usage error (exit 2, the option named), not a
ValueError from an empty median after the run has started (bench_sdxl.py --repeats 0 did)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize(
    "option, value",
    [("--repeats", "0"), ("--repeats", "-1"), ("--width-divisor", "0")],
)
def test_bench_sdxl_refuses_counts_below_one(option, value):
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_sdxl.py"), f"{option}={value}"],
        capture_output=True,
        text=True,
        env={**os.environ, "LORAWEAVE_BENCH_NO_REEXEC": "1"},
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"argument {option}: must be an integer >= 1, got {value!r}" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
