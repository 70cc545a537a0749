"""The layout of tests/: a test module imports shared builders, constants and checks from helpers/ (fixtures
from conftest.py), never from another test module, so that test files do not depend on each other."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(path: Path) -> list[str]:
    """Every `import test_x` and `from test_x import ...` in the file, at module level or in a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0].startswith("test_")
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0].startswith("test_"):
                found.append(f"{node.lineno}: from {node.module} import ...")
    return found


FILES = sorted(TESTS.rglob("*.py"))


def test_the_walk_sees_the_test_files_and_helpers():
    names = {p.relative_to(TESTS).as_posix() for p in FILES}
    assert {"conftest.py", "test_test_layout.py", "helpers/common.py"} <= names


def test_the_check_finds_both_import_forms(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import test_a\nfrom test_b import x\n\n\ndef f():\n    from test_c.sub import y\n")
    assert imported_test_modules(probe) == [
        "1: import test_a",
        "2: from test_b import ...",
        "6: from test_c.sub import ...",
    ]


def test_no_file_under_tests_imports_a_test_module():
    offenders = {p.relative_to(TESTS).as_posix(): found for p in FILES if (found := imported_test_modules(p))}
    assert offenders == {}, "move what a test module shares to helpers/ (fixtures to conftest.py)"
