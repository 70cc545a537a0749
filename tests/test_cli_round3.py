"""Issue 42's CLI defects (round 3 of a new user's trial): each test failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file as save_np

import loraweave
from loraweave.arch.catalog import CATALOG, aliases, canonical
from loraweave.cli import main
from loraweave.errors import ArgumentError, CheckpointError, WriteError
from loraweave.tools.bake import bake
from loraweave.tools.checkpoint import open_checkpoint


def _dot_runs(text: str) -> int:
    """Runs of ink columns in `text`'s column label (turned back to horizontal) that are a dot: set apart by
    blank columns, at most 2 wide and 3 tall (an underscore is wider)."""
    from loraweave.tools.heatmap import default_font, vertical_label

    strip = np.asarray(vertical_label(text, default_font(10), 400).rotate(-90, expand=True))[:, :, 3]
    ink = strip > 128
    cols = ink.any(axis=0)
    runs, start = [], None
    for x, on in enumerate([*cols, False]):
        if on and start is None:
            start = x
        elif not on and start is not None:
            runs.append(ink[:, start:x])
            start = None
    rows = [np.flatnonzero(r.any(axis=1)) for r in runs]
    return sum(
        1 for r, y in zip(runs, rows, strict=True) if r.shape[1] <= 2 and np.ptp(y) < 3 and r.sum() >= 2
    )


def test_heatmap_column_labels_keep_their_dots():  # item 21
    for label in ("attn1.to_out.0", "ff.net.0.proj", "attn2.to_k"):
        assert _dot_runs(label) == label.count("."), label


SRC = str(Path(loraweave.__file__).resolve().parents[1])

# Each refusal in turn in one child process: its exit status, and whether torch was imported by then.
REFUSALS_PROBE = """
import json, sys
from loraweave.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out.append([code, "torch" in sys.modules])
print(json.dumps(out))
"""


def _tiny_lora(path: Path) -> Path:
    stem = "lora_unet_down_blocks_0_attentions_0_proj_in"
    save_np(
        {
            f"{stem}.lora_down.weight": np.ones((2, 320), np.float32),
            f"{stem}.lora_up.weight": np.ones((320, 2), np.float32),
        },
        str(path),
    )
    return path


def _refusals(cases: list[list[str]], cwd: Path) -> list[list]:
    proc = subprocess.run(
        [sys.executable, "-c", REFUSALS_PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": SRC},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_refusals_come_before_torch_is_imported(tmp_path):  # item 15
    lora = str(_tiny_lora(tmp_path / "a.safetensors"))
    for name in ("exists.png", "exists.safetensors"):
        (tmp_path / name).write_text("the user's file")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    cases = [
        ["inspect", lora, "--plot", "p.jpg"],
        ["inspect", lora, "--plot", "exists.png"],
        ["generate", "-m", "pipe", "-p", "x", "--lora", f"{lora}:inf"],
        ["generate", "-m", "pipe", "-p", "x", "-o", "exists.png"],
        ["bake", "pipe", lora, "-o", "exists.safetensors"],
        ["extract", lora, lora, "-o", "exists.safetensors", "--rank", "2"],
        ["resize", lora, "-o", "exists.safetensors", "--rank", "2"],
        ["convert", lora, "--to", "kohya", "-o", "exists.safetensors"],
        ["merge", lora, f"{lora}:inf", "-o", "o.safetensors"],
        ["merge", f"{lora}:0.7", lora, "-o", "exists.safetensors"],
    ]
    got = _refusals(cases, tmp_path)
    assert [code for code, _ in got] == [2] * len(cases)
    assert [argv[0] for argv, (_, torch_in) in zip(cases, got, strict=True) if torch_in] == []
    assert (tmp_path / "exists.png").read_text() == "the user's file"


def test_bake_of_a_folder_refuses_a_single_file_name(tmp_path):  # item 10
    lora = str(_tiny_lora(tmp_path / "a.safetensors"))
    unet = tmp_path / "pipe" / "unet"
    unet.mkdir(parents=True)
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    (unet / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    weight = "down_blocks.0.attentions.0.proj_in.weight"
    save_np({weight: np.zeros((320, 320), np.float32)}, str(unet / "diffusion_pytorch_model.safetensors"))
    code = main(["bake", str(tmp_path / "pipe"), lora, "-o", str(tmp_path / "bk.safetensors")])
    assert code == 2 and not (tmp_path / "bk.safetensors").exists()
    with pytest.raises(WriteError, match=r"bk\.safetensors.*name a folder"):
        bake(str(tmp_path / "pipe"), [(lora, 1.0)], str(tmp_path / "bk.safetensors"))
    assert not (tmp_path / "bk.safetensors").exists()


def test_inspect_refuses_an_adapter_given_as_the_model(tmp_path, capsys):  # item 12
    lora = str(_tiny_lora(tmp_path / "a.safetensors"))
    assert main(["inspect", lora, "--model", lora]) == 2
    err = capsys.readouterr().err
    assert "a.safetensors: an adapter file" in err and "not a model checkpoint" in err
    with pytest.raises(CheckpointError, match="not a model checkpoint"):
        open_checkpoint(lora)
    model = tmp_path / "model.safetensors"  # a model file is still read as one
    save_np({"down_blocks.0.attentions.0.proj_in.weight": np.zeros((320, 320), np.float32)}, str(model))
    assert main(["inspect", lora, "--model", str(model), "--strict"]) == 0


class _Evil:
    def __reduce__(self):
        return (print, ("a pickle ran code",))


def test_pickle_refusal_never_relays_torchs_advice(tmp_path, capsys):  # item 19
    import torch

    evil = tmp_path / "evil.pt"
    torch.save({"fc.lora_down.weight": torch.zeros(2, 4), "payload": _Evil()}, evil)
    assert main(["inspect", str(evil), "--allow-pickle"]) == 2
    out = capsys.readouterr()
    assert "a pickle ran code" not in out.out + out.err
    assert "evil.pt" in out.err and "Unsupported global" in out.err
    for advice in ("weights_only` set to `False", "weights_only=False", "safe_globals", "allowlist", "\x1b["):
        assert advice not in out.err, advice


def test_inspect_help_lists_every_accepted_arch(monkeypatch, capsys):  # item 17
    monkeypatch.setenv("COLUMNS", "2000")  # one line per option: no name broken at a hyphen
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.lstrip().startswith("--arch"))
    listed = {n.strip() for n in line.split("detected one:")[1].replace("; aliases:", ",").split(",")}
    accepted = set(CATALOG) | {alias for alias, name in aliases().items() if name in CATALOG}
    assert listed == accepted and len(accepted) > 14
    assert all(canonical(n) in CATALOG for n in listed)
    readme = (Path(SRC).parent / "README.md").read_text()
    if "HiDream" in readme:  # the README lists it: --arch takes it, or the README says it does not
        try:
            canonical("hidream")
        except ArgumentError:
            assert "HiDream (no built-in skeleton: `inspect --model`, not\n  `--arch`)" in readme


def test_inspect_takes_several_paths(tmp_path, capsys):  # item 18
    a = str(_tiny_lora(tmp_path / "a.safetensors"))
    b = tmp_path / "b.safetensors"
    save_np({"no_such_module.lora_down.weight": np.ones((2, 8), np.float32)}, str(b))
    assert main(["inspect", a, str(b), "--json", "--arch", "sd1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in rows] == [a, str(b)]
    for row in rows:
        assert main(["inspect", row["path"], "--json", "--arch", "sd1"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert row["coverage"]["keys_applied"] == alone["coverage"]["keys_applied"]
        assert row["coverage"]["unmatched"] == alone["coverage"]["unmatched"]
    assert rows[0]["coverage"]["complete"] and not rows[1]["coverage"]["complete"]
    assert main(["inspect", a, str(b), "--strict", "--arch", "sd1"]) == 1
    assert main(["inspect", a, str(b), "--plot", str(tmp_path / "p.png")]) == 2


def test_json_failure_is_one_error_object_for_every_command(tmp_path, capsys):  # item 16
    lora = str(_tiny_lora(tmp_path / "a.safetensors"))
    missing = str(tmp_path / "missing")
    cases = [
        ["bake", missing, lora, "-o", str(tmp_path / "o.safetensors")],
        ["generate", "-m", missing, "-p", "x", "-o", str(tmp_path / "o.png")],
        ["inspect", missing + ".safetensors"],
        ["extract", missing, lora, "--rank", "1", "-o", str(tmp_path / "o.safetensors")],
        ["resize", missing + ".safetensors", "--rank", "1", "-o", str(tmp_path / "o.safetensors")],
        ["merge", f"{lora}:0.7", missing + ".safetensors", "-o", str(tmp_path / "o.safetensors")],
    ]
    for argv in cases:
        code = main([*argv, "--json"])
        out = capsys.readouterr()
        assert code == 2, argv
        obj = json.loads(out.out)
        assert obj["exit_status"] == code and out.err.strip() == f"loraweave: error: {obj['error']}", argv
        assert "missing" in obj["error"], argv


def test_extract_warns_of_layers_that_differ_only_by_fp16_rounding(tmp_path, capsys):  # item 11
    g = np.random.default_rng(0)
    base = {f"blocks.{i}.proj.weight": g.standard_normal((16, 16)).astype(np.float32) for i in range(3)}
    tuned = {k: v.astype(np.float16) for k, v in base.items()}  # fp16 copies: only rounding differs
    tuned["blocks.1.proj.weight"] = (base["blocks.1.proj.weight"] + 0.1).astype(np.float16)  # fine-tuned
    save_np(base, str(tmp_path / "base.safetensors"))
    save_np(tuned, str(tmp_path / "tuned.safetensors"))
    argv = ["extract", str(tmp_path / "base.safetensors"), str(tmp_path / "tuned.safetensors"), "--rank", "2"]
    assert main([*argv, "-o", str(tmp_path / "all.safetensors"), "--json"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out)["layers"]) == 3  # written as before, and said
    assert "rounding_only=2 layers=3" in out.err and "float16" in out.err and "--skip-rounding" in out.err
    assert main([*argv, "-o", str(tmp_path / "tuned_only.safetensors"), "--skip-rounding", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [la["name"] for la in res["layers"]] == ["diffusion_model.blocks.1.proj"]
    assert res["skipped"] == {"differs only by rounding to float16": 2}


def _kohya(path: Path, stem: str, down: tuple[int, ...], up: tuple[int, ...], meta=None) -> str:
    arrays = {f"{stem}.lora_down.weight": np.zeros(down, np.float32), f"{stem}.lora_up.weight": np.ones(up)}
    save_np({k: v.astype(np.float32) for k, v in arrays.items()}, str(path), metadata=meta)
    return str(path)


def test_inspect_architecture_evidence_is_honest(tmp_path):  # item 9
    from loraweave.tools.inspect import format_table, inspect_adapter
    from loraweave.tools.skeleton import reuse

    with reuse():  # the three UNet skeletons built once for both files
        kohya_sd1 = {"ss_base_model_version": "sd_v1", "ss_sd_model_name": "v1-5-pruned-emaonly.safetensors"}
        conv = "lora_unet_down_blocks_0_resnets_0_conv1"  # no cross-attention: the shape fit names the UNet
        sd1 = inspect_adapter(
            _kohya(tmp_path / "sd1.safetensors", conv, (4, 320, 3, 3), (320, 4, 1, 1), kohya_sd1)
        )
        assert sd1["architecture"]["name"] == "sd1" and sd1["coverage"]["complete"]
        said = [e for e in sd1["architecture"]["evidence"] if e.startswith("metadata ")]
        assert len(said) == 1 and said[0].endswith("names sd1: agrees"), said

        odd = inspect_adapter(_kohya(tmp_path / "odd.safetensors", conv, (4, 321, 3, 3), (333, 4, 1, 1)))
        assert odd["architecture"]["name"] not in ("sd1", "sd2", "sdxl")  # 0 keys land on each: none is named
        assert odd["architecture"]["evidence"][-1].endswith("-> none of them")
        assert odd["coverage"]["against"] is None and odd["coverage"]["keys_applied"] == 0

    g = np.random.default_rng(0)
    flux = {}
    for i in range(7, 21):
        stem = f"lora_unet_single_blocks_{i}_linear1"
        flux[f"{stem}.lora_down.weight"] = g.standard_normal((4, 3072)).astype(np.float32)
        flux[f"{stem}.lora_up.weight"] = g.standard_normal((21504, 4)).astype(np.float32)
    save_np(flux, str(tmp_path / "flux.safetensors"))
    table = format_table(inspect_adapter(tmp_path / "flux.safetensors", coverage=False))
    variant = next(x for x in table.splitlines() if x.strip().startswith("variant"))
    assert "single blocks 7-20" in variant and "21 single" not in variant, variant
