"""The version is stated once, in pyproject.toml; `loraweave.__version__`, the installed metadata and
`loraweave --version` all read it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import loraweave

ROOT = Path(__file__).resolve().parents[1]
STATED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_matches_pyproject_and_the_installed_metadata():
    assert loraweave.__version__ == STATED
    assert importlib.metadata.version("loraweave") == STATED


def test_version_is_written_nowhere_else_in_the_package():
    stated_in = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "src").rglob("*"))
        if p.is_file() and p.suffix in (".py", ".toml", ".txt", ".cfg") and STATED in p.read_text()
    ]
    assert stated_in == []


def test_cli_version_prints_it():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(
        [sys.executable, "-m", "loraweave.cli", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"loraweave {STATED}"
