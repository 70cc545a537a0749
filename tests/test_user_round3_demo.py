"""Issue 42, a new user's third run-through: `demo --generate` and the user's files (item 1), the umask
(item 14) and progress bars on a non-terminal stderr (item 22)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from PIL import Image

from loraweave.cli import main
from loraweave.tools import tiny_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

USER = b"the user's own bytes"


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _users_folder(tmp_path: Path, which: str) -> Path:
    """A folder of the user's with one file where the demo writes (`which`) and one beside it."""
    work = tmp_path / "work"
    (work / "loras").mkdir(parents=True)
    (work / "loras" / "mine.safetensors").write_bytes(USER)
    files = {
        "lora": work / "loras" / "demo.safetensors",
        "pipeline": work / "pipeline" / "model_index.json",
        "png": tmp_path / "cat.png",
        "sidecar": tmp_path / "cat.json",
    }
    files[which].parent.mkdir(exist_ok=True)
    files[which].write_bytes(USER)
    return work


@pytest.mark.parametrize("which", ["lora", "pipeline", "png", "sidecar"])
def test_demo_generate_refuses_a_folders_files_before_building(which, tmp_path, capsys, monkeypatch):
    """Item 1: DIR/loras/demo.safetensors, DIR/pipeline/*, the PNG or its sidecar already there: exit 2
    before anything is built (the builder would raise), every file unchanged."""

    def never(*_a, **_k):
        raise AssertionError("the demo built before refusing")

    monkeypatch.setattr(tiny_pipeline, "tiny_sd15", never)
    work = _users_folder(tmp_path, which)
    before = _tree(tmp_path)
    assert main(["demo", "--generate", str(tmp_path / "cat.png"), "--out", str(work)]) == 2
    err = capsys.readouterr().err
    assert "exists (pass --force to replace it)" in err, err
    assert _tree(tmp_path) == before


def test_demo_generate_force_replaces_only_its_files(tmp_path, capsys):
    """Item 1: `--force` with an existing PNG, sidecar, pipeline and LoRA is accepted and replaces those,
    never the folder's other files. Item 14: what it writes gets the umask's modes (0640 / 0750 under 027;
    safetensors alone writes 0600). Item 22: stderr is not a terminal here: no progress bar, no escape."""
    work = _users_folder(tmp_path, "lora")
    (work / "pipeline").mkdir()
    (work / "pipeline" / "model_index.json").write_bytes(USER)
    (work / "pipeline" / "notes.txt").write_bytes(USER)
    for name in ("cat.png", "cat.json"):
        (tmp_path / name).write_bytes(USER)
    old = os.umask(0o027)
    try:
        rc = main(["demo", "--generate", str(tmp_path / "cat.png"), "--out", str(work), "--force"])
    finally:
        os.umask(old)
    err = capsys.readouterr().err
    assert rc == 0, err
    after = _tree(tmp_path)
    kept = {"work/loras/mine.safetensors", "work/pipeline/notes.txt"}
    assert all(after[k] == USER for k in kept)
    replaced = {"cat.png", "cat.json", "work/loras/demo.safetensors", "work/pipeline/model_index.json"}
    assert all(after[k] != USER for k in replaced), [k for k in replaced if after[k] == USER]
    assert Image.open(tmp_path / "cat.png").text["parameters"].startswith("a cat <lora:demo:1>")
    users = kept | {"work", "work/loras", "work/pipeline"}  # made by the test, not by the demo
    written = [p for p in tmp_path.rglob("*") if p.relative_to(tmp_path).as_posix() not in users]
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in written}
    wrong = {k: oct(m) for k, m in modes.items() if m != (0o750 if (tmp_path / k).is_dir() else 0o640)}
    assert not wrong and "work/pipeline/unet/diffusion_pytorch_model.safetensors" in modes, wrong
    assert "\r" not in err and "\x1b" not in err and "it/s" not in err, err[-500:]
