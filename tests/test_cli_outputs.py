"""Every CLI command that writes keeps the README's promises about its output: an existing output is refused
(exit 2, the file byte-identical) unless --force, and --force replaces only the command's own files, never
another file of the folder (issue 30 item 1: `convert --to peft -o victim --force` deleted victim's other
files; `-o . --force` deleted the current folder's). Missing folders are never created; outputs honour the
umask; an output of the wrong kind (a folder where a file is written) is one typed line, not '[Errno 21]'."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.cli_inputs import CliInputs, cli_inputs
from helpers.tiny_models import tiny_zimage
from safetensors.torch import load_file

from loraweave.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> CliInputs:
    return cli_inputs(tmp_path_factory.mktemp("cli"), pipeline=True)


@pytest.fixture
def tiny_demo(monkeypatch):
    """`demo` on a tiny Z-Image: the real sample-file writer, none of the minute-long runs."""
    import loraweave.tools.demo as demo_mod

    def run_demo(out_dir: Path) -> dict:
        paths = demo_mod.write_sample_loras(tiny_zimage(), out_dir)
        return {"files": {k: str(v) for k, v in paths.items()}}

    monkeypatch.setattr(demo_mod, "run_demo", run_demo)


@dataclass
class Case:
    kind: str  # "file" or "folder": what the command writes at its output path
    argv: Callable[[CliInputs, Path], list]  # the command line for output path OUT (no --force)
    own: Callable[[Path], list[Path]]  # the files the command writes for OUT


GENERATE = ["-p", "a cat", "--steps", "1", "-W", "32", "-H", "32"]
CASES = {
    "convert": Case(
        "file",
        lambda i, o: ["convert", i.lora, "--to", "kohya", "--model", i.folder, "-o", o],
        lambda o: [o],
    ),
    "convert --to peft": Case(
        "folder",
        lambda i, o: ["convert", i.lora, "--to", "peft", "--model", i.folder, "-o", o],
        lambda o: [o / "adapter_model.safetensors", o / "adapter_config.json"],
    ),
    "merge": Case(
        "file",
        lambda i, o: ["merge", f"{i.lora}:0.7", f"{i.lora}:0.5", "--model", i.folder, "-o", o],
        lambda o: [o],
    ),
    "bake": Case("file", lambda i, o: ["bake", i.single, f"{i.lora}:0.5", "-o", o], lambda o: [o]),
    "bake (folder)": Case(
        "folder",
        lambda i, o: ["bake", i.folder, i.lora, "-o", o],
        lambda o: [o / "config.json", o / "diffusion_pytorch_model.safetensors"],
    ),
    "extract": Case(
        "file", lambda i, o: ["extract", i.single, i.tuned, "--rank", "2", "-o", o], lambda o: [o]
    ),
    "resize": Case("file", lambda i, o: ["resize", i.lora, "--rank", "1", "-o", o], lambda o: [o]),
    "inspect --plot": Case(
        "file", lambda i, o: ["inspect", i.lora, "--model", i.folder, "--plot", o], lambda o: [o]
    ),
    "generate": Case(
        "file",
        lambda i, o: ["generate", "--model", i.pipeline, "--lora", i.sd_lora, *GENERATE, "-o", o],
        lambda o: [o, o.with_suffix(".json")],
    ),
    "demo": Case(
        "folder",
        lambda i, o: ["demo", "--json", "--out", o],
        lambda o: [o / "demo_lora_peft.safetensors", o / "demo_lora_kohya.safetensors"],
    ),
    "comfy demo": Case(
        "folder",
        lambda i, o: ["comfy", "demo", o, "--json"],
        lambda o: [
            o / "models" / "diffusion_models" / "loraweave_demo_flux.safetensors",
            o / "models" / "loras" / "loraweave_demo_lora.safetensors",
            o / "loraweave_demo_workflow.json",
            o / "extra_model_paths.yaml",
        ],
    ),
}
OUTPUT_FLAGS = {"output", "plot", "out"}  # dests of the options that name what a command writes


def _run(argv: list) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:  # argparse usage errors
        return int(exc.code)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(command line, parser) of every command, nested ones (`comfy demo`) too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, p in action.choices.items():
                yield f"{prefix}{name}", p
                yield from _commands(p, f"{prefix}{name} ")


def test_the_walk_covers_every_command_that_writes():
    writing = {
        name for name, p in _commands(build_parser()) if any(a.dest in OUTPUT_FLAGS for a in p._actions)
    }
    assert writing == {name.split(" --")[0].split(" (")[0] for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_existing_output_refused_without_force_replaced_alone_with_it(
    name, inputs, tmp_path, capsys, tiny_demo
):
    case = CASES[name]
    folder = tmp_path / "outs"
    folder.mkdir()
    out = folder / ("out.png" if name in ("inspect --plot", "generate") else "out")
    own = case.own(out)
    for path in own:  # every own output exists, next to files the command does not write
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"old " + path.name.encode())
        (path.parent / "notes.txt").write_text("keep me")
    (own[0].parent / "sub").mkdir()
    (own[0].parent / "sub" / "photo.jpg").write_bytes(b"\xff\xd8 keep me")
    before = _files(folder)

    assert _run(case.argv(inputs, out)) == 2
    err = capsys.readouterr().err
    assert "exists (pass --force to replace it)" in err and "Traceback" not in err
    assert _files(folder) == before  # byte-identical, nothing added

    assert _run([*case.argv(inputs, out), "--force"]) == 0, capsys.readouterr().err
    after = _files(folder)
    for rel, data in before.items():
        if folder / rel in own:
            assert after[rel] != data, f"{rel} not replaced"
        else:
            assert after[rel] == data, f"{rel} is not {name}'s to replace"
    assert not [p for p in after if p.endswith(".tmp")]


@pytest.mark.parametrize("name", list(CASES))
def test_missing_folder_is_refused_not_created(name, inputs, tmp_path, capsys, tiny_demo):
    out = tmp_path / "missing" / "deeper" / ("out.png" if name in ("inspect --plot", "generate") else "out")
    assert _run(CASES[name].argv(inputs, out)) == 2
    assert "its folder does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("name", list(CASES))
def test_output_of_the_other_kind_is_one_typed_line(name, inputs, tmp_path, capsys, tiny_demo):
    case = CASES[name]
    out = tmp_path / ("out.png" if name in ("inspect --plot", "generate") else "out")
    if case.kind == "file":  # a folder where a file is written: used to leak '[Errno 21]' and a temp name
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    else:
        out.write_text("keep me")
    before = _files(tmp_path)
    assert _run([*case.argv(inputs, out), "--force"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loraweave: error: output "), err
    assert "Errno" not in err and ".tmp" not in err
    assert f"is a {case.kind == 'file' and 'folder' or 'file'}" in err
    assert _files(tmp_path) == before


# ------------------------------------------------------------------------------- item 1: -o FOLDER / -o .


def _peft_argv(i: CliInputs, out) -> list:
    return ["convert", i.lora, "--to", "peft", "--model", i.folder, "-o", out, "--force"]


def _bake_argv(i: CliInputs, out) -> list:
    return ["bake", i.folder, i.lora, "-o", out, "--force"]


def _victim(folder: Path) -> dict[str, bytes]:
    """A user's folder: unrelated files, a subfolder, and a stale file under one of our output names."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "sub").mkdir()
    (folder / "sub" / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0 photo")
    (folder / ".hidden").write_text("dotfile")
    (folder / "adapter_config.json").write_text("{}")  # convert's own name: replaced by convert only
    (folder / "config.json").write_text("{}")  # bake's own name: replaced by bake only
    return _files(folder)


@pytest.mark.parametrize("argv", [_peft_argv, _bake_argv], ids=["convert", "bake"])
@pytest.mark.parametrize("target", ["folder", "cwd"])
def test_force_into_a_folder_keeps_every_other_file(argv, target, inputs, tmp_path, monkeypatch):
    fresh = tmp_path / "fresh"
    assert _run(argv(inputs, fresh)) == 0  # what the command writes into an empty place
    own = _files(fresh)
    victim = tmp_path / "victim"
    unrelated = {rel: data for rel, data in _victim(victim).items() if rel not in own}
    assert len(unrelated) >= 4
    if target == "cwd":
        monkeypatch.chdir(victim)
    assert _run(argv(inputs, "." if target == "cwd" else victim)) == 0
    after = _files(victim)
    for rel, data in unrelated.items():
        assert after.pop(rel) == data, rel
    assert set(after) == set(own)  # the rest is exactly what the command writes, no temp folder left
    for rel in own:
        if rel.endswith(".safetensors"):
            got, want = load_file(victim / rel), load_file(fresh / rel)
            assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)
        else:
            assert json.loads(after[rel]) == json.loads(own[rel])


def test_a_file_of_ours_blocked_by_a_folder_is_refused_before_anything_moves(inputs, tmp_path, capsys):
    victim = tmp_path / "victim"
    (victim / "adapter_model.safetensors").mkdir(parents=True)  # a folder where our file goes
    (victim / "adapter_model.safetensors" / "keep.txt").write_text("keep")
    (victim / "adapter_config.json").write_text("{}")
    before = _files(victim)
    assert _run(_peft_argv(inputs, victim)) == 2
    assert "is in the way of adapter_model.safetensors" in capsys.readouterr().err
    assert _files(victim) == before and not [p for p in victim.iterdir() if p.name.endswith(".tmp")]


def test_a_file_where_one_of_our_folders_goes_is_refused_before_anything_moves(tmp_path):
    from loraweave.errors import WriteError
    from loraweave.io.write import atomic_path

    target = tmp_path / "out"
    target.mkdir()
    (target / "unet").write_text("a file where our unet/ folder goes")
    (target / "model_index.json").write_text("{}")
    before = _files(target)
    with pytest.raises(WriteError, match="unet is in the way of unet/w.safetensors"):
        with atomic_path(target, folder=True) as tmp:
            (tmp / "model_index.json").write_text('{"new": 1}')
            (tmp / "unet").mkdir()
            (tmp / "unet" / "w.safetensors").write_bytes(b"weights")
    assert _files(target) == before and sorted(p.name for p in target.iterdir()) == [
        "model_index.json",
        "unet",
    ]


# ------------------------------------------------------------------------------------ item 6: permissions


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_honour_the_umask(umask, inputs, tmp_path):
    old = os.umask(umask)
    try:
        assert _run(_peft_argv(inputs, tmp_path / "peft")) == 0
        assert (
            _run(["convert", inputs.lora, "--to", "kohya", "--model", inputs.folder, "-o", tmp_path / "k"])
            == 0
        )
        assert _run(_bake_argv(inputs, tmp_path / "baked")) == 0
        assert _run(["bake", inputs.single, inputs.lora, "-o", tmp_path / "b.safetensors"]) == 0
    finally:
        os.umask(old)
    for path in tmp_path.rglob("*"):
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == want, (path, oct(path.stat().st_mode))
