"""`--module-share K/N` (tests/helpers/module_share.py): scripts/test.sh runs the newest-tree comfy tests as
two shares, one per process; every selected module must run in exactly one share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.module_share import SECONDS, deal, parse_share

ROOT = Path(__file__).resolve().parents[1]


def test_deal_splits_every_module_once_longest_first():
    seconds = {"a": 50.0, "b": 40.0, "c": 30.0, "d": 20.0}
    counts = {"a": 5, "b": 4, "c": 3, "d": 2, "new": 10}  # "new" is not measured: 10 tests at 10 s a test
    shares = deal(counts, 2, seconds)
    assert set().union(*shares) == set(counts) and sum(len(s) for s in shares) == len(counts)
    assert shares == [{"new", "d"}, {"a", "b", "c"}] or shares == [{"new", "c"}, {"a", "b", "d"}], shares
    assert deal(counts, 1, seconds) == [set(counts)]


@pytest.mark.parametrize("bad", ["", "1", "0/2", "3/2", "a/2", "1/0", "-1/2"])
def test_a_malformed_share_is_refused(bad):
    with pytest.raises(ValueError, match="K/N"):
        parse_share(bad)


def test_measured_seconds_name_only_test_modules():
    seconds = json.loads(SECONDS.read_text())
    missing = [name for name in seconds if not (ROOT / "tests" / f"{name}.py").is_file()]
    assert not missing, f"module_seconds.json names modules that are gone: {missing}"


def collected(*extra: str) -> set[str]:
    files = ["tests/test_comfy_errors.py", "tests/test_comfy_harness.py", "tests/test_module_share.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *files, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode in (0, 5), run.stdout + run.stderr
    return {line for line in run.stdout.splitlines() if "::" in line}


def test_the_shares_of_a_run_are_its_tests_split_by_module():
    whole = collected()
    one, two = collected("--module-share", "1/2"), collected("--module-share", "2/2")
    assert one and two and not one & two and one | two == whole
    for share in (one, two):  # a module is never split
        modules = {t.split("::")[0] for t in share}
        assert not any(t.split("::")[0] in modules for t in whole - share)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "--module-share",
            "3/2",
            "tests/test_module_share.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 4 and "K/N" in bad.stderr, bad.stderr
