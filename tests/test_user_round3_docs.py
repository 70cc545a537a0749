"""Issue 42 item 7: the README says what the full suite costs, the Python version and that `test.sh` re-runs
the set-up, and `scripts/test.sh --quick` is a quick tier (run here against stub tools: what it calls)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "{log}"
"""


def test_readme_states_the_suites_cost_python_and_set_up():
    setup = ROOT.joinpath("README.md").read_text().split("## Set-up (fresh machine)")[1].split("\n## ")[0]
    for said in (
        "Python 3.11",
        "re-runs the set-up",
        "19 min",
        "80 min",
        "6.2 GB",
        "bash scripts/test.sh --quick",
    ):
        assert said in setup, said


def test_quick_tier_runs_one_pytest_without_set_up_or_the_heavy_tiers(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    log = tmp_path / "calls.log"
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for tool in (
        tmp_path / "scripts" / "setup.sh",
        *(tmp_path / ".venv" / "bin" / n for n in ("python", "ruff", "mypy")),
    ):
        tool.write_text(STUB.format(log=log))
        tool.chmod(0o755)
    run = subprocess.run(
        ["bash", "scripts/test.sh", "--quick", "-x"], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    assert calls == [
        "python -m pytest tests -q -p no:cacheprovider -m not slow and not realsize and not comfy -x"
    ], calls
