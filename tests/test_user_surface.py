"""Issue 19: what a new user meets. Loud coverage, validated arguments, tools that refuse to write nothing,
positional files in bake/resize, remove() releasing memory, and the small things (one test per numbered
item)."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from conftest import REALDATA
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.arguments import parse_adapter_arg
from loraweave.cli import main
from loraweave.errors import ArgumentError, EmptyOutputError, NoKeysLandedError, StrictApplyError
from loraweave.tools.bake import bake
from loraweave.tools.extract import extract
from loraweave.tools.resize import resize

sys.path.insert(0, str(Path(__file__).parent))
from helpers.tiny_models import tiny_flux, tiny_sdxl_unet  # noqa: E402

SRC = str(Path(loraweave.__file__).resolve().parents[1])
CLONEOFSIMO = REALDATA / "lora" / "cloneofsimo__lora__analog_svd_rank4.safetensors"
BLOCK = "down_blocks.1.attentions.0.transformer_blocks.0"


def _pair(sd: dict, stem: str, rows: int, cols: int, seed: int, rank: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd[f"{stem}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.1
    sd[f"{stem}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.1
    return sd


def sd15_named_lora() -> dict[str, torch.Tensor]:
    """kohya SD1.5 UNet names: nothing of it exists on a Flux transformer."""
    sd = {}
    for i, proj in enumerate(("to_q", "to_k")):
        stem = f"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_{proj}"
        g = torch.Generator().manual_seed(i)
        sd[f"{stem}.lora_down.weight"] = torch.randn(4, 320, generator=g)
        sd[f"{stem}.lora_up.weight"] = torch.randn(320, 4, generator=g)
    return sd


def sd2_on_sd1_lora() -> dict[str, torch.Tensor]:
    """Self-attention fits; cross-attention k/v were trained on 48-wide text features, the model takes 32."""
    sd: dict = {}
    _pair(sd, f"unet.{BLOCK}.attn1.to_q", 32, 32, 1)
    _pair(sd, f"unet.{BLOCK}.attn1.to_v", 32, 32, 2)
    _pair(sd, f"unet.{BLOCK}.attn2.to_k", 32, 48, 3)
    _pair(sd, f"unet.{BLOCK}.attn2.to_v", 32, 48, 4)
    return sd


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------- 1. loud coverage


def test_item1_no_key_landed_raises_typed_error_and_touches_nothing(caplog):
    model = tiny_flux()
    before = _state(model)
    with pytest.raises(NoKeysLandedError) as err:
        loraweave.apply(model, sd15_named_lora())
    assert err.value.report.keys_applied == 0 and err.value.report.keys_total == 4
    assert "landed=0/4" in str(err.value) and "allow_empty=True" in str(err.value)
    assert _unchanged(model, before)
    # The explicit opt-out: a handle, and the WARNING line.
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        handle = loraweave.apply(model, sd15_named_lora(), allow_empty=True)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "incomplete" in r.getMessage()
    ]
    assert len(lines) == 1 and "landed=0/4" in lines[0] and "no_such_modulex4" in lines[0]
    handle.remove()
    assert _unchanged(model, before)


def _ours(caplog) -> list[logging.LogRecord]:
    """loraweave's own records: a third-party import done first in this process (bitsandbytes, torch) logs
    its own warnings into caplog too."""
    return [r for r in caplog.records if r.name == "loraweave" or r.name.startswith("loraweave.")]


def test_item1_partial_apply_logs_one_warning_line(caplog):
    model = tiny_sdxl_unet()
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        handle = loraweave.apply(model, loraweave.load_adapter(sd2_on_sd1_lora(), name="sd2"))
    warnings = [r.getMessage() for r in _ours(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert "adapter='sd2'" in line and "landed=4/8" in line and "shape_mismatchx4" in line
    assert "example='unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight'" in line
    assert handle.report.keys_applied == 4
    handle.remove()
    # A complete apply is silent; strict=True still means every key or nothing.
    caplog.clear()
    ok = {k: v for k, v in sd2_on_sd1_lora().items() if "attn1" in k}
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        loraweave.apply(model, ok).remove()
    assert not [r for r in _ours(caplog) if r.levelno >= logging.WARNING]
    with pytest.raises(StrictApplyError):
        loraweave.apply(model, sd2_on_sd1_lora(), strict=True)


# -------------------------------------------------------------------------------- 2. bake strength validation


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "2e4"])
def test_item2_bake_refuses_non_finite_strengths(tmp_path, text, capsys):
    ckpt, lora = _flux_checkpoint_and_lora(tmp_path)
    out = tmp_path / "out.safetensors"
    with pytest.raises(SystemExit) as usage:  # a bad FILE:S is a usage error of the argument's type
        main(["bake", str(ckpt), f"{lora}:{text}", "-o", str(out)])
    assert usage.value.code == 2
    assert "strength" in capsys.readouterr().err and not out.exists()
    with pytest.raises(ArgumentError):
        parse_adapter_arg(f"{lora}:{text}")
    with pytest.raises(ArgumentError):
        bake(ckpt, [(str(lora), float(text))], out)
    assert not out.exists()
    assert parse_adapter_arg(f"{lora}:0.5") == (str(lora), 0.5)


def _flux_checkpoint_and_lora(tmp_path: Path) -> tuple[Path, Path]:
    model = tiny_flux(seed=3)
    ckpt = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, ckpt)
    lora = tmp_path / "flux_lora.safetensors"
    save_file(_pair({}, "transformer.transformer_blocks.0.attn.to_q", 32, 32, 5), lora)
    return ckpt, lora


# ------------------------------------------------------------------------------------ 3. zero-effect outputs


def test_item3_bake_with_no_key_landing_refuses(tmp_path, capsys):
    ckpt, _ = _flux_checkpoint_and_lora(tmp_path)
    wrong = tmp_path / "sd15.safetensors"
    save_file(sd15_named_lora(), wrong)
    out = tmp_path / "out.safetensors"
    assert main(["bake", str(ckpt), str(wrong), "-o", str(out)]) == 1
    assert "0/4" in capsys.readouterr().err and not out.exists()
    with pytest.raises(EmptyOutputError):
        bake(ckpt, [(str(wrong), 1.0)], out)
    assert main(["bake", str(ckpt), str(wrong), "-o", str(out), "--allow-empty"]) == 0
    assert out.exists()


def test_item3_extract_of_identical_files_refuses(tmp_path, capsys):
    ckpt, _ = _flux_checkpoint_and_lora(tmp_path)
    out = tmp_path / "x.safetensors"
    assert main(["extract", str(ckpt), str(ckpt), "--rank", "4", "-o", str(out)]) == 1
    assert "no layer to write" in capsys.readouterr().err and not out.exists()
    assert main(["extract", str(ckpt), str(ckpt), "--rank", "4", "-o", str(out), "--allow-empty"]) == 0
    assert out.exists() and load_file(out) == {}


def test_item3_resize_with_nothing_resizable_refuses(tmp_path):
    src = tmp_path / "oft.safetensors"
    save_file({"lora_unet_x.oft_blocks": torch.zeros(2, 4, 4), "lora_unet_x.alpha": torch.tensor(0.0)}, src)
    out = tmp_path / "r.safetensors"
    assert main(["resize", str(src), "--rank", "2", "-o", str(out)]) == 1
    assert not out.exists()
    with pytest.raises(EmptyOutputError):
        resize(src, out, rank=2)


# ------------------------------------------------------------------------- 4. positional files in bake/resize


def _sd15_first_block(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A component folder holding only SD1.5's first transformer block (C=320, text width 768); no config.json
    (a partial UNet2DConditionModel folder trips the original-name table, which wants every resnet)."""
    g = torch.Generator().manual_seed(11)
    stem = "down_blocks.0.attentions.0.transformer_blocks.0"
    shapes = {
        "attn1.to_q": (320, 320),
        "attn1.to_k": (320, 320),
        "attn1.to_v": (320, 320),
        "attn1.to_out.0": (320, 320),
        "ff.net.0.proj": (2560, 320),
        "ff.net.2": (320, 1280),
        "attn2.to_q": (320, 320),
        "attn2.to_k": (320, 768),
        "attn2.to_v": (320, 768),
        "attn2.to_out.0": (320, 320),
    }
    sd = {f"{stem}.{name}.weight": torch.randn(*shape, generator=g) for name, shape in shapes.items()}
    folder = tmp_path / "unet"
    folder.mkdir()
    save_file(sd, folder / "diffusion_pytorch_model.safetensors")
    return folder, sd


def test_item4_bake_resolves_cloneofsimo_positions(tmp_path):
    folder, base = _sd15_first_block(tmp_path)
    out = tmp_path / "baked"
    res = bake(folder, [(str(CLONEOFSIMO), 1.0)], out)
    # The trainer's order (lora_diffusion: CrossAttention/Attention/GEGLU ancestors, in the old child order
    # attn1, ff, attn2): unet:0-3 = attn1 q/k/v/out, unet:4 = the GEGLU proj, unet:5-8 = attn2 q/k/v/out.
    # The shapes prove it independently: 2560 rows for the GEGLU proj, 768 columns for attn2's k/v.
    order = [
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "ff.net.0.proj",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
    ]
    lora = load_file(CLONEOFSIMO)
    merged = load_file(out / "diffusion_pytorch_model.safetensors")
    assert res.keys_applied == 2 * len(order)
    for i, name in enumerate(order):
        key = f"down_blocks.0.attentions.0.transformer_blocks.0.{name}.weight"
        delta = lora[f"unet:{i}:up"].double() @ lora[f"unet:{i}:down"].double()  # no alpha: scale 1
        want = (base[key].double() + delta).float()
        assert torch.allclose(merged[key], want, atol=1e-6, rtol=0), name
    assert torch.equal(
        merged["down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2.weight"],
        base["down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2.weight"],
    )


def test_item4_resize_names_cloneofsimo_parts(tmp_path):
    out = tmp_path / "r.safetensors"
    res = resize(CLONEOFSIMO, out, rank=2)
    assert len(res.layers) == 192 and not res.skipped
    assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q" in {
        la["name"] for la in res.layers
    }
    from loraweave.tools.skeleton import skeleton

    report = loraweave.plan(skeleton("sd1"), str(out))
    assert report.keys_applied == report.keys_total == 3 * 192, report.reasons()


# ------------------------------------------------------------------------------- 5. numeric argument checks


@pytest.mark.parametrize(
    "argv",
    [
        ["resize", "F", "-o", "O", "--rank", "0"],
        ["resize", "F", "-o", "O", "--rank", "-3"],
        ["resize", "F", "-o", "O", "--energy", "1.5"],
        ["resize", "F", "-o", "O", "--energy", "0"],
        ["resize", "F", "-o", "O", "--energy", "nan"],
        ["extract", "B", "T", "-o", "O", "--rank", "0"],
        ["extract", "B", "T", "-o", "O", "--rank", "4", "--min-diff", "-1"],
        ["inspect", "F", "--limit", "-1"],
    ],
)
def test_item5_cli_numeric_arguments_are_validated(argv, tmp_path, capsys):
    argv = [str(tmp_path / a) if a in ("F", "O", "B", "T") else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "must be" in err or "is not a finite number" in err  # 'nan': the strength rule's words
    assert not (tmp_path / "O").exists()


@pytest.mark.parametrize("kw", [{"rank": 0}, {"rank": -3}, {"energy": 1.5}, {"energy": 0.0}, {"rank": 2.5}])
def test_item5_api_low_rank_arguments_are_validated(kw, tmp_path):
    ckpt, lora = _flux_checkpoint_and_lora(tmp_path)
    with pytest.raises(ArgumentError):
        resize(lora, tmp_path / "r.safetensors", **kw)
    with pytest.raises(ArgumentError):
        extract(ckpt, ckpt, tmp_path / "e.safetensors", **kw)
    assert not list(tmp_path.glob("[re].safetensors"))


# ------------------------------------------------------------------------------- 6. remove() releases memory


def _reachable_tensors(root: object, skip: set[int]) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through gc referents, not passing through objects in `skip`."""
    seen, stack, found = set(skip), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        stack.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_item6_removed_handle_holds_nothing_but_its_report(mode):
    model = tiny_sdxl_unet()
    sd = {k: v for k, v in sd2_on_sd1_lora().items() if "attn1" in k}
    handle = loraweave.apply(model, sd, mode=mode)
    records = handle.merged_layers if mode == "merge" else handle.runtime_paths
    assert records
    watched = [weakref.ref(r) for r in records]
    if mode == "merge":
        watched += [weakref.ref(r.record) for r in records]  # the undo records (mechanisms/merge/undo.py)
    del records
    assert _reachable_tensors(handle, {id(handle.report)}), "the live handle should hold its backups/factors"
    handle.remove()
    gc.collect()
    assert all(w() is None for w in watched), "undo records / backups outlive remove()"
    assert _reachable_tensors(handle, {id(handle.report)}) == []
    assert handle.report.keys_applied == 4 and handle.strengths  # the report (and strengths) stay
    handle.remove()  # idempotent
    with pytest.raises(RuntimeError, match="removed"):
        handle.set_strength(next(iter(handle.strengths)), 0.5)


# ------------------------------------------------------------------------------------------ 7. pickle option


def test_item7_pickle_error_names_real_options(tmp_path, capsys):
    path = tmp_path / "lora.pt"
    torch.save(_pair({}, "transformer.transformer_blocks.0.attn.to_q", 32, 32, 1), path)
    with pytest.raises(loraweave.UnsafeFormatError) as err:
        loraweave.apply(tiny_flux(), str(path))
    assert "load_adapter(path, allow_pickle=True)" in str(err.value)
    import inspect as pyinspect

    assert "allow_pickle" in pyinspect.signature(loraweave.load_adapter).parameters
    assert main(["inspect", str(path), "--arch", "flux"]) == 2
    err_text = capsys.readouterr().err
    assert "--allow-pickle" in err_text and "allow_pickle=True" not in err_text
    assert main(["inspect", str(path), "--arch", "flux", "--allow-pickle", "--json"]) == 0


# ------------------------------------------------------------------------------------------------ 8. Krea2


def test_item8_krea2_is_selectable(tmp_path, capsys):
    from loraweave.arch.catalog import canonical

    assert canonical("krea2") == "krea2"
    path = tmp_path / "k.safetensors"
    save_file(_pair({}, "transformer.transformer_blocks.0.attn.to_q", 6144, 6144, 1), path)
    assert main(["inspect", str(path), "--arch", "krea2", "--json", "--no-text-encoders"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["coverage"]["against"].startswith("architecture krea2")
    assert info["coverage"]["keys_applied"] == 2, info["coverage"]["unmatched"]


# ------------------------------------------------------------------------------------- 9. consistent codes


def test_item9_strict_is_exit_1_for_inspect_and_bake(tmp_path):
    empty = tmp_path / "empty.safetensors"
    save_file({}, empty)
    assert main(["inspect", str(empty), "--arch", "flux", "--no-text-encoders"]) == 0
    assert main(["inspect", str(empty), "--arch", "flux", "--no-text-encoders", "--strict"]) == 1
    ckpt, lora = _flux_checkpoint_and_lora(tmp_path)
    partial = tmp_path / "partial.safetensors"
    save_file({**load_file(lora), **sd15_named_lora()}, partial)
    out = tmp_path / "o.safetensors"
    assert main(["bake", str(ckpt), str(partial), "-o", str(out), "--strict"]) == 1 and not out.exists()
    assert main(["bake", str(ckpt), str(partial), "-o", str(out)]) == 0 and out.exists()


# ------------------------------------------------------------------------------------------- 10. API edges


@pytest.mark.parametrize("strength", ["0.5", True, 1e308, float("nan")])
def test_item10_strength_rules_match_adapter_spec(strength):
    model = tiny_flux()
    before = _state(model)
    sd = _pair({}, "transformer.transformer_blocks.0.attn.to_q", 32, 32, 1)
    with pytest.raises(ArgumentError) as api_err:
        loraweave.apply(model, sd, strength=strength)
    with pytest.raises(ArgumentError) as spec_err:
        loraweave.AdapterSpec(sd, strength)
    assert str(spec_err.value) == f"AdapterSpec {api_err.value}"
    handle = loraweave.apply(model, sd)
    with pytest.raises(ArgumentError):
        handle.set_strength(handle.report.adapters[0]["name"], strength)
    handle.remove()
    assert _unchanged(model, before)


@pytest.mark.parametrize("source, phrase", [(None, "got None"), ("", "path is empty"), ([None], "None")])
def test_item10_missing_sources_are_typed(source, phrase):
    with pytest.raises(ArgumentError, match=phrase):
        loraweave.apply(tiny_flux(), source)


def test_item10_duplicate_names_refused_and_doubled_file_warned(tmp_path, caplog):
    model = tiny_flux()
    path = tmp_path / "a.safetensors"
    save_file(_pair({}, "transformer.transformer_blocks.0.attn.to_q", 32, 32, 1), path)
    specs = [loraweave.AdapterSpec(str(path), name="x"), loraweave.AdapterSpec(str(path), 0.5, name="x")]
    with pytest.raises(ArgumentError, match="'x'"):
        loraweave.apply(model, specs)
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        handle = loraweave.apply(model, [str(path), str(path)])
    line = next(r.getMessage() for r in caplog.records if "duplicate_adapter" in r.getMessage())
    assert "times=2" in line and "add up" in line and str(path.resolve()) in line
    handle.remove()
    caplog.clear()
    ckpt, _ = _flux_checkpoint_and_lora(tmp_path)  # bake warns the same way
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        bake(ckpt, [(str(path), 1.0), (str(path), 0.5)], tmp_path / "twice.safetensors")
    assert any("duplicate_adapter" in r.getMessage() and "times=2" in r.getMessage() for r in caplog.records)


def test_item10_stream_budget_accepts_size_strings():
    from loraweave.arguments import byte_size

    assert byte_size("1GB", "budget") == 10**9 and byte_size("512MiB", "budget") == 512 * 2**20
    assert byte_size(1234, "budget") == 1234
    for bad in ("1 parsec", "-1GB", 0, True, "nanGB"):
        with pytest.raises(ArgumentError):
            byte_size(bad, "budget")
    model = tiny_flux()
    handle = loraweave.stream(model, budget="1GB", device="cpu")
    handle.close()
    with pytest.raises(ArgumentError):
        loraweave.stream(model, budget="lots", device="cpu")
    with pytest.raises(ArgumentError):
        loraweave.stream(model, budget="1GB", margin=-1, device="cpu")


# ----------------------------------------------------------------------------------------- 11. progress bars


def test_item11_progress_bars_only_when_asked(tmp_path, capsys, monkeypatch):
    ckpt, _ = _flux_checkpoint_and_lora(tmp_path)
    tuned = tmp_path / "tuned.safetensors"
    sd = load_file(ckpt)
    sd["transformer_blocks.0.attn.to_q.weight"] = sd["transformer_blocks.0.attn.to_q.weight"] + 0.1
    save_file(sd, tuned)
    extract(ckpt, tuned, tmp_path / "a.safetensors", rank=2, progress=True)
    assert "extract" in capsys.readouterr().err
    extract(ckpt, tuned, tmp_path / "b.safetensors", rank=2, progress=False)
    assert capsys.readouterr().err == ""
    model = tiny_flux()
    loraweave.apply(model, load_file(tmp_path / "a.safetensors"), progress=True).remove()
    assert "loraweave apply" in capsys.readouterr().err
    loraweave.apply(model, load_file(tmp_path / "a.safetensors")).remove()  # 1 layer: under the threshold
    assert "loraweave apply" not in capsys.readouterr().err
    # The CLI: on a terminal a bar; never under --json or --quiet, nor off a terminal.
    from loraweave.cli.support import progress_wanted

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    from argparse import Namespace

    assert progress_wanted(Namespace(json=False, quiet=False))
    assert not progress_wanted(Namespace(json=True, quiet=False))
    assert not progress_wanted(Namespace(json=False, quiet=True))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not progress_wanted(Namespace(json=False, quiet=False))


# ------------------------------------------------------------------------------------------ 12. small things


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "loraweave", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def test_item12_version_and_quiet_optional_packages():
    run = _cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"loraweave {loraweave.__version__}"
    run = _cli("inspect", str(CLONEOFSIMO), "--json")
    assert run.returncode == 0 and json.loads(run.stdout)["coverage"]["keys_applied"] == 384
    assert run.stderr == "", run.stderr  # no kernel/triton/torchao import chatter
    verbose = _cli("-v", "inspect", str(CLONEOFSIMO), "--json")
    lines = [ln for ln in verbose.stderr.splitlines() if "mode=plan" in ln]
    assert lines and all(ln.startswith("loraweave mode=plan") for ln in lines), verbose.stderr
    assert "loraweave loraweave" not in verbose.stderr


def test_item12_demo_and_test_cache_leave_no_temp_dirs(tmp_path, monkeypatch, capsys):
    import tempfile

    import loraweave.tools.demo as demo_mod

    seen = []

    def fake_demo(out_dir: Path) -> dict:  # the CLI's temp handling, without the minute-long demo run
        seen.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "demo_lora_kohya.safetensors").write_bytes(b"x")
        return {"files": {"kohya": str(out_dir / "demo_lora_kohya.safetensors")}, "runs": {}}

    monkeypatch.setattr(demo_mod, "run_demo", fake_demo)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--json"]) == 0
    assert seen and seen[0].parent == tmp_path and list(tmp_path.iterdir()) == []
    assert "temporary, removed" in json.loads(capsys.readouterr().out)["files"]["kohya"]
    keep = tmp_path / "keep"
    assert main(["demo", "--json", "--out", str(keep)]) == 0
    assert (keep / "demo_lora_kohya.safetensors").is_file()
    keep.joinpath("demo_lora_kohya.safetensors").unlink()
    keep.rmdir()
    # The test suite's skeleton cache: made at conftest import, removed when that process ends.
    probe = subprocess.run(
        [sys.executable, "-c", "import conftest, os; print(os.environ['LORAWEAVE_CACHE'])"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
        env={k: v for k, v in {**os.environ, "TMPDIR": str(tmp_path)}.items() if k != "LORAWEAVE_CACHE"},
    )
    assert probe.returncode == 0 and probe.stdout.strip().startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_item12_packaging_and_docs():
    root = Path(__file__).resolve().parents[1]
    assert (Path(loraweave.__file__).parent / "py.typed").is_file()
    assert loraweave.PromptAdapterError is loraweave.errors.PromptAdapterError
    assert "PromptAdapterError" in loraweave.__all__ and "NoKeysLandedError" in loraweave.__all__
    readme = (root / "README.md").read_text()
    assert ".venv/bin/loraweave" in readme and "allow_empty=True" in readme
    # One -q only: pyproject's addopts plus the script's -q hid pytest's `N passed` summary line.
    pyproject = (root / "pyproject.toml").read_text()
    script = (root / "scripts" / "test.sh").read_text()
    addopts = next((ln for ln in pyproject.splitlines() if ln.startswith("addopts")), "")
    runs = [ln for ln in script.splitlines() if "pytest tests" in ln]  # each pytest invocation of the script
    assert runs and all(addopts.count("-q") + ln.count(" -q") <= 1 for ln in runs), runs


def test_item12_extract_writes_a_layout_diffusers_loads(tmp_path):
    base, tuned = tiny_sdxl_unet(seed=0), tiny_sdxl_unet(seed=0)
    with torch.no_grad():
        layer = tuned.get_submodule(f"{BLOCK}.attn1.to_q")
        layer.weight += torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(2)) * 0.05
    base.save_pretrained(tmp_path / "base")
    tuned.save_pretrained(tmp_path / "tuned")
    out = tmp_path / "lora.safetensors"
    extract(tmp_path / "base", tmp_path / "tuned", out, rank=32)
    fresh = tiny_sdxl_unet(seed=0)
    fresh.load_lora_adapter(str(out), prefix="unet", adapter_name="x")
    fresh.fuse_lora()
    got = fresh.get_submodule(f"{BLOCK}.attn1.to_q")
    got = getattr(got, "base_layer", got).weight
    assert (got - layer.weight).abs().max().item() < 1e-5
    assert all(k.startswith("unet.") and ".lora_" in k for k in load_file(out))
    mine = tiny_sdxl_unet(seed=0)
    loraweave.apply(mine, str(out), mode="merge", strict=True)  # and loraweave reads it as scale 1
    assert (mine.get_submodule(f"{BLOCK}.attn1.to_q").weight - layer.weight).abs().max().item() < 1e-5
