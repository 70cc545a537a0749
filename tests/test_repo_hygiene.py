"""The tracked text files carry no merge-conflict markers (a merge once left some in the README)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)


def test_no_conflict_markers_in_tracked_files():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = (
        listed.stdout.split()
        if listed.returncode == 0
        else [  # not a git checkout: the project's own folders
            str(p.relative_to(ROOT))
            for d in ("src", "tests", "benchmarks", "scripts", "docs")
            for p in (ROOT / d).rglob("*")
            if p.is_file()
        ]
        + ["README.md", "pyproject.toml"]
    )
    hits = [
        f
        for f in files
        if f.endswith((".py", ".md", ".toml", ".sh", ".txt", ".cfg"))
        and MARKER.search((ROOT / f).read_text(encoding="utf-8", errors="replace"))
    ]
    assert hits == []


def test_the_marker_pattern_finds_a_marker():
    assert MARKER.search("text\n" + "<" * 7 + " HEAD\nmore\n")
