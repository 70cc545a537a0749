"""What a CLI user reads (issue 30 items 4, 7, 8, 9, 10, 16): one message for a bad strength everywhere, flags
never API keywords, one JSON error object, a quiet broken pipe, bake's count of tensors whose bits changed,
and the smaller items (error lines, -v after the command, demo --help, extract's exit status)."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from helpers.cli_inputs import CliInputs, cli_inputs
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraweave.cli import build_parser, main
from loraweave.errors import PromptAdapterError
from loraweave.request.prompt import parse_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["-p", "a cat", "--steps", "1", "-W", "32", "-H", "32"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> CliInputs:
    return cli_inputs(tmp_path_factory.mktemp("cli"), pipeline=True)


@pytest.fixture(scope="module")
def nowhere(tmp_path_factory) -> Path:
    """A LoRA whose one module exists in no model."""
    path = tmp_path_factory.mktemp("nowhere") / "nowhere.safetensors"
    save_file(
        {
            "lora_unet_nowhere.lora_down.weight": torch.ones(2, 8),
            "lora_unet_nowhere.lora_up.weight": torch.ones(8, 2),
        },
        path,
    )
    return path


def _run(argv: list) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:  # argparse usage errors
        return int(exc.code)


# ------------------------------------------------------------------------- item 7: strengths, --rank


STRENGTHS = {
    "abc": "strength 'abc' is not a number",
    "nan": "strength 'nan' is not a finite number",
    "-inf": "strength '-inf' is not a finite number",
    "1e400": "strength '1e400' is not a finite number",
    "1e9": "strength '1e9' is out of range (absolute value at most 10000)",
}


@pytest.mark.parametrize("text", list(STRENGTHS))
@pytest.mark.parametrize("command", ["bake", "generate"])
def test_a_bad_strength_reads_the_same_on_every_command(command, text, inputs, tmp_path, capsys):
    spec = f"{inputs.lora}:{text}"
    if command == "bake":
        argv = ["bake", inputs.single, spec, "-o", tmp_path / "out"]
    else:
        argv = ["generate", "--model", inputs.pipeline, "--lora", spec, *GENERATE, "-o", tmp_path / "out.png"]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert f"{inputs.lora}: {STRENGTHS[text]}" in err
    assert "invalid" not in err and "no such file" not in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("text", list(STRENGTHS))
def test_prompt_tags_give_the_same_strength_message(text, tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"")
    with pytest.raises(PromptAdapterError) as exc:
        parse_prompt(f"a cat <lora:x:{text}>", tmp_path)
    assert str(exc.value) == f"<lora:x:{text}>: {STRENGTHS[text]}"


def test_a_path_with_a_colon_is_still_a_path(tmp_path):
    from loraweave.arguments import parse_adapter_arg

    odd = tmp_path / "style:v2.safetensors"
    odd.write_bytes(b"")
    assert parse_adapter_arg(str(odd)) == (str(odd), 1.0)
    assert parse_adapter_arg(f"{odd}:0.5") == (str(odd), 0.5)


@pytest.mark.parametrize(
    "text, message",
    [
        ("1e9", "--rank must be an integer >= 1, got '1e9'"),
        ("2.5", "--rank must be an integer >= 1, got '2.5'"),
        ("1e-5", "--rank must be an integer >= 1, got '1e-5'"),
        ("abc", "--rank: 'abc' is not a number"),
        ("0", "--rank must be an integer >= 1, got 0"),
    ],
)
def test_rank_messages_are_true(text, message, inputs, tmp_path, capsys):
    assert _run(["resize", inputs.lora, "--rank", text, "-o", tmp_path / "out"]) == 2
    err = capsys.readouterr().err
    assert message in err and "not a number: '1e9'" not in err


# -------------------------------------------------------------------------- item 8: flags, not API words


def test_generate_names_allow_empty_and_has_it(inputs, nowhere, tmp_path, capsys):
    argv = ["generate", "--model", inputs.pipeline, "--lora", nowhere, *GENERATE]
    assert _run([*argv, "-o", tmp_path / "a.png"]) == 1
    err = capsys.readouterr().err
    assert "--allow-empty" in err and "allow_empty" not in err and "=True" not in err
    assert not (tmp_path / "a.png").exists()
    assert _run([*argv, "-o", tmp_path / "b.png", "--allow-empty"]) == 0
    assert (tmp_path / "b.png").is_file()


def test_every_command_that_writes_takes_allow_empty_and_force():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("bake", "convert", "extract", "resize", "generate"):
        flags = {o for a in sub.choices[name]._actions for o in a.option_strings}
        assert {"--allow-empty", "--force"} <= flags, name


# ----------------------------------------------------------------------------- item 4: bake LORA:0


def test_bake_counts_tensors_whose_bits_changed_and_refuses_an_unchanged_copy(inputs, tmp_path, capsys):
    out = tmp_path / "zero.safetensors"
    assert _run(["bake", inputs.single, f"{inputs.lora}:0", "-o", out]) == 1
    assert "change no tensor" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert _run(["bake", inputs.single, f"{inputs.lora}:0", "-o", out, "--allow-empty", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors_changed"] == 0
    assert load_file(out).keys() == load_file(inputs.single).keys()
    for name, tensor in load_file(out).items():
        assert torch.equal(tensor, load_file(inputs.single)[name])

    cast = (
        tmp_path / "cast.safetensors"
    )  # a --dtype cast is an effect: written, 0 tensors changed by adapters
    assert _run(["bake", inputs.single, f"{inputs.lora}:0", "-o", cast, "--dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors_changed"] == 0 and cast.is_file()

    half = tmp_path / "half.safetensors"
    assert _run(["bake", inputs.single, f"{inputs.lora}:0.5", "-o", half, "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)["tensors_changed"]
    base, baked = load_file(inputs.single), load_file(half)
    differ = [
        k
        for k in base
        if not torch.equal(base[k].view(-1).view(torch.uint8), baked[k].view(-1).view(torch.uint8))
    ]
    assert reported == len(differ) == 2  # to_q and proj_out


def _stored_count(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["loraweave.baked"])["tensors_changed"]


def _bits_differ(before: dict, after: dict) -> int:
    return sum(
        not torch.equal(t.view(-1).view(torch.uint8), after[k].view(-1).view(torch.uint8))
        for k, t in before.items()
    )


@pytest.mark.parametrize("strength", ["0", "0.5"])
def test_bake_stores_the_count_of_tensors_whose_bits_changed(strength, inputs, tmp_path, capsys):
    """The file's own metadata, not only the printed result: planned merges of strength 0 change no bit."""
    out = tmp_path / "out.safetensors"
    argv = ["bake", inputs.single, f"{inputs.lora}:{strength}", "-o", out, "--allow-empty", "--json"]
    assert _run(argv) == 0
    changed = _bits_differ(load_file(inputs.single), load_file(out))
    assert changed == (0 if strength == "0" else 2)
    assert _stored_count(out) == json.loads(capsys.readouterr().out)["tensors_changed"] == changed

    sharded = tmp_path / "sharded"  # a component folder in shards: every shard and the index say the total
    FluxTransformer2DModel.from_pretrained(inputs.folder).save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert (
        _run(["bake", sharded, f"{inputs.lora}:{strength}", "-o", tmp_path / "baked", "--allow-empty"]) == 0
    )
    baked = tmp_path / "baked"
    changed = sum(_bits_differ(load_file(s), load_file(baked / s.name)) for s in shards)
    assert changed == (0 if strength == "0" else 2)
    assert [_stored_count(baked / s.name) for s in shards] == [changed] * len(shards)
    index = json.loads((baked / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert json.loads(index["metadata"]["loraweave.baked"])["tensors_changed"] == changed


# ---------------------------------------------------------------------- item 9: inspect FILE --json


def test_inspect_json_of_a_truncated_file_is_one_error_object(inputs, tmp_path, capsys):
    data = inputs.lora.read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[: len(data) - 64])
    assert _run(["inspect", bad, "--json"]) == 2
    captured = capsys.readouterr()
    row = json.loads(captured.out)
    assert row["file"] == "cut.safetensors" and row["path"] == str(bad)
    assert "truncated" in row["error"] and "Error:" not in row["error"]
    assert captured.err.strip() == f"loraweave: error: {row['error']}"


# ------------------------------------------------------------------------------ item 10: broken pipe


@pytest.mark.parametrize("case", ["ok", "empty folder"])
def test_a_closed_pipe_ends_quietly(case, inputs, tmp_path):
    """The reader is gone before the command prints (`| head -c 0`): no traceback, no 'Exception ignored', and
    the command's own status (0 for a file; 1 for a folder without adapters, whose stderr line still
    shows)."""
    target, code = (inputs.lora, 0) if case == "ok" else (tmp_path, 1)
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "SDNQ_USE_TORCH_COMPILE": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraweave", "inspect", str(target), "--no-coverage"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == code, err
    assert err == ("" if code == 0 else f"loraweave: no adapter files in {tmp_path}\n")


# --------------------------------------------------------------------------- item 16: smaller items


def test_error_lines_name_the_file_once_without_a_class_name(tmp_path, capsys):
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    assert _run(["inspect", tmp_path]) == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("loraweave: error:"))
    assert line.count("junk.safetensors") == 1 and "Error:" not in line, line


def test_os_errors_read_path_colon_reason(monkeypatch, capsys, tmp_path):
    import loraweave.tools.inspect as inspect_mod

    def fail(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/data/x.safetensors")

    monkeypatch.setattr(inspect_mod, "inspect_adapter", fail)
    assert main(["inspect", str(tmp_path / "x.safetensors")]) == 3
    assert capsys.readouterr().err.strip() == "loraweave: error: /data/x.safetensors: Permission denied"


def test_converting_a_file_of_no_known_architecture_says_what_to_pass(nowhere, tmp_path, capsys):
    assert _run(["convert", nowhere, "--to", "kohya", "-o", tmp_path / "out"]) == 2
    err = capsys.readouterr().err
    assert "no known architecture; pass --arch NAME or --model CHECKPOINT" in err
    assert "'unknown'" not in err


def test_extract_with_an_adapter_as_tuned_is_bad_input(inputs, tmp_path, capsys):
    assert _run(["extract", inputs.single, inputs.lora, "--rank", "1", "-o", tmp_path / "out"]) == 2
    err = capsys.readouterr().err  # named as what it is (issue 42 item 12), not as "no name in common"
    assert f"{inputs.lora}: an adapter file" in err and "not a model checkpoint" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv, verbose",
    [
        (["inspect", "f"], False),
        (["-v", "inspect", "f"], True),
        (["inspect", "f", "-v"], True),
        (["inspect", "--verbose", "f"], True),
        (["bake", "m", "l", "-o", "o", "-v"], True),
    ],
)
def test_verbose_before_or_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_demo_help_describes_the_demo(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "Z-Image transformer" in out and "nothing is downloaded" in out


def test_readme_tells_of_the_skeleton_cache():
    readme = (ROOT / "README.md").read_text()
    assert "LORAWEAVE_CACHE" in readme and "LORAWEAVE_CACHE=0" in readme
    assert "~/.cache/loraweave/skeletons" in readme
    from loraweave.tools.skeleton import CACHE_ENV

    assert CACHE_ENV == "LORAWEAVE_CACHE"


# ------------------------------------------------- item 13: an original-named adapter on a bare diffusers
# file


def test_bake_says_to_convert_when_the_layouts_differ(inputs, tmp_path, capsys):
    """A diffusers-named UNet file of no catalog size, no config.json beside it: a comfy (ldm-named) adapter
    lands nothing; the refusal names the command that converts it, and following it (or putting the config
    beside the file) bakes bit for bit what the diffusers-named adapter bakes."""
    unet = inputs.pipeline / "unet"
    comfy, back = tmp_path / "comfy.safetensors", tmp_path / "back.safetensors"
    assert _run(["convert", inputs.sd_lora, "--to", "comfy", "--model", unet, "-o", comfy]) == 0
    bare = tmp_path / "bare" / "unet.safetensors"
    bare.parent.mkdir()
    shutil.copyfile(unet / "diffusion_pytorch_model.safetensors", bare)
    capsys.readouterr()
    assert _run(["bake", bare, comfy, "-o", tmp_path / "none.safetensors"]) == 1
    err = capsys.readouterr().err
    assert f"{comfy} names modules in the original layout and {bare} in the diffusers one" in err
    assert f"loraweave convert {comfy} --to diffusers --model FOLDER" in err and "config.json beside" in err
    assert not (tmp_path / "none.safetensors").exists()

    assert _run(["convert", comfy, "--to", "diffusers", "--model", unet, "-o", back]) == 0
    assert _run(["bake", bare, back, "-o", tmp_path / "converted.safetensors"]) == 0
    assert _run(["bake", bare, inputs.sd_lora, "-o", tmp_path / "direct.safetensors"]) == 0
    shutil.copyfile(unet / "config.json", bare.parent / "config.json")
    assert _run(["bake", bare, comfy, "-o", tmp_path / "configured.safetensors"]) == 0
    direct = load_file(tmp_path / "direct.safetensors")
    assert _bits_differ(load_file(bare), direct) == 40  # every attention Linear of the tiny UNet
    for name in ("converted", "configured"):
        assert _bits_differ(direct, load_file(tmp_path / f"{name}.safetensors")) == 0, name


# ------------------------------------------------------------- the README walk: promises each command keeps


def test_a_file_that_is_not_safetensors_is_not_called_a_pickle(inputs, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    for argv in (["inspect", notes], ["bake", inputs.single, notes, "-o", tmp_path / "o.safetensors"]):
        assert _run(argv) == 2
        err = capsys.readouterr().err
        assert f"{notes}: not a .safetensors file" in err and "pickle file" not in err, err
    pickle = tmp_path / "old.pt"
    torch.save({"x": torch.zeros(1)}, pickle)
    assert _run(["inspect", pickle]) == 2
    assert "a pickle file (.pt/.ckpt/.bin/.pth) can run arbitrary code" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["out.jpg", "out.webp", "out"])
def test_generate_and_demo_write_only_png(name, inputs, tmp_path, capsys):
    """The parameters text lives in the PNG's text chunk: PIL would write a JPEG (or fail) for other names."""
    out = tmp_path / name
    assert _run(["generate", "--model", inputs.pipeline, *GENERATE, "-o", out]) == 2
    assert f"{out}: the output must be a .png file" in capsys.readouterr().err
    assert _run(["demo", "--generate", out]) == 2
    assert f"{out}: the output must be a .png file" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
