"""`loraweave generate` end to end on a tiny SD1.5 pipeline saved to a temp folder (tokenizer written
offline)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.cli import main
from loraweave.tools.infotext import parse_infotext
from loraweave.tools.tiny_pipeline import sample_lora, tiny_sd15

SRC = Path(__file__).resolve().parents[1] / "src"
COMMON = ["--steps", "3", "-W", "32", "-H", "32", "--cfg", "5", "-s", "7", "-n", "blurry"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory) -> Path:
    return tiny_sd15(tmp_path_factory.mktemp("sd15") / "pipe")


def _lora(pipe_dir: Path, path: Path, extra: dict | None = None) -> Path:
    """A kohya LoRA (alpha = rank/2) on every attention Linear of the UNet and the TE's q/v projections."""
    from diffusers import StableDiffusionPipeline

    sample_lora(StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True), path)
    if extra:
        save_file(load_file(path) | extra, path, metadata={"ss_network_module": "networks.lora"})
    return path


@pytest.fixture(scope="module")
def lora_dir(pipe_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("loras")
    _lora(pipe_dir, folder / "styles" / "x.safetensors")
    return folder


def _generate(tmp_path: Path, pipe_dir: Path, name: str, *args: str) -> tuple[int, Path]:
    out = tmp_path / f"{name}.png"
    rc = main(["generate", "--model", str(pipe_dir), "-o", str(out), *COMMON, *args])
    return rc, out


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def _by_hand(pipe_dir: Path, adapters, prompt: str = "a cat") -> np.ndarray:
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if adapters:
        loraweave.apply(pipe, adapters)
    image = pipe(
        prompt=prompt,
        negative_prompt="blurry",
        num_inference_steps=3,
        guidance_scale=5.0,
        height=32,
        width=32,
        generator=torch.Generator().manual_seed(7),
    ).images[0]
    return np.asarray(image.convert("RGB")).astype(np.int16)


def test_tag_equals_apply_by_hand_and_changes_the_image(tmp_path, pipe_dir, lora_dir):
    rc, tagged = _generate(
        tmp_path, pipe_dir, "tagged", "-p", "a cat <lora:x:1>", "--lora-dir", str(lora_dir)
    )
    assert rc == 0
    rc, plain = _generate(tmp_path, pipe_dir, "plain", "-p", "a cat")
    assert rc == 0
    by_hand = _by_hand(pipe_dir, [lora_dir / "styles" / "x.safetensors"])
    assert np.array_equal(_pixels(tagged), by_hand)
    assert np.array_equal(_pixels(plain), _by_hand(pipe_dir, []))
    assert np.abs(_pixels(tagged) - _pixels(plain)).mean() > 2.0  # the LoRA visibly changes the image


def test_strengths_from_tag_and_flag(tmp_path, pipe_dir, lora_dir):
    """`<lora:x:0.5:0>` (text encoder off) and `--lora FILE:0.5` match apply() with the same strengths."""
    path = lora_dir / "styles" / "x.safetensors"
    rc, te_off = _generate(
        tmp_path, pipe_dir, "te_off", "-p", "a cat <lora:styles/x:0.5:0>", "--lora-dir", str(lora_dir)
    )
    assert rc == 0
    assert np.array_equal(
        _pixels(te_off), _by_hand(pipe_dir, [loraweave.AdapterSpec(path, 0.5, te_strength=0.0)])
    )
    rc, flag = _generate(tmp_path, pipe_dir, "flag", "-p", "a cat", "--lora", f"{path}:0.5")
    assert rc == 0
    assert np.array_equal(_pixels(flag), _by_hand(pipe_dir, [(path, 0.5)]))
    got_prompt, _, params = parse_infotext(Image.open(flag).text["parameters"])  # issue 42 item 20
    assert got_prompt == "a cat <lora:x:0.5>" and params["Lora hashes"].startswith("x: ")
    assert not np.array_equal(_pixels(flag), _pixels(te_off))  # the TE strength matters


def _png_chunks(path: Path) -> list[tuple[bytes, bytes]]:
    data = path.read_bytes()
    pos, out = 8, []
    while pos < len(data):
        n = struct.unpack(">I", data[pos : pos + 4])[0]
        out.append((data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]))
        pos += 12 + n
    return out


def test_metadata_a1111_infotext_report_and_sidecar(tmp_path, pipe_dir, lora_dir):
    prompt = "a cat, <lora:x:0.8> sitting"
    rc, out = _generate(tmp_path, pipe_dir, "meta", "-p", prompt, "--lora-dir", str(lora_dir))
    assert rc == 0
    chunks = _png_chunks(out)
    kinds = [k for k, _ in chunks]
    text = {v.split(b"\0", 1)[0]: v.split(b"\0", 1)[1] for k, v in chunks if k == b"tEXt"}
    assert kinds.index(b"tEXt") < kinds.index(b"IDAT")  # A1111/sd.cpp readers find it before the image data
    got_prompt, negative, params = parse_infotext(text[b"parameters"].decode("latin-1"))
    assert got_prompt == prompt and negative == "blurry"  # the prompt keeps its tags, as A1111 writes it
    assert list(params)[:5] == ["Steps", "Sampler", "CFG scale", "Seed", "Size"]
    assert params["Steps"] == "3" and params["CFG scale"] == "5.0" and params["Seed"] == "7"
    assert params["Size"] == "32x32" and params["Sampler"] == "Euler" and params["Model"] == "pipe"
    unet = (pipe_dir / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()  # a folder: its denoiser
    assert params["Model hash"] == hashlib.sha256(unet).hexdigest()[:10]
    raw = (lora_dir / "styles" / "x.safetensors").read_bytes()
    addnet = hashlib.sha256(raw[8 + struct.unpack("<Q", raw[:8])[0] :]).hexdigest()[:12]
    assert params["Lora hashes"] == f"x: {addnet}"
    assert params["Version"].startswith("loraweave ")
    report = json.loads(text[b"loraweave"])
    assert report["keys_applied"] == report["keys_total"] > 0 and report["adapters"][0]["strength"] == 0.8
    assert params["Loraweave"].startswith("mode=auto adapters=1 keys_applied=")
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["parameters"] == text[b"parameters"].decode("latin-1") and side["seed"] == 7
    assert side["prompt_encoded"] == "a cat, sitting" and side["report"] == report


def test_progress_bar_on_a_terminal_only(tmp_path, pipe_dir, capsys):
    rc, _ = _generate(tmp_path, pipe_dir, "quiet", "-p", "a cat")  # stderr is not a TTY under pytest
    assert rc == 0 and "steps" not in capsys.readouterr().err
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(
        slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0)
    )  # tqdm draws nothing at 0 columns
    env = {**os.environ, "PYTHONPATH": str(SRC), "SDNQ_USE_TORCH_COMPILE": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loraweave",
            "generate",
            "--model",
            str(pipe_dir),
            "-p",
            "a cat",
            "-o",
            str(tmp_path / "tty.png"),
            *COMMON,
        ],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
        timeout=300,
    )
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    assert b"steps: 100%" in err and b"3/3" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "no such file or folder"),
        (["-W", "30"], "-W must be a positive multiple of 8"),
        (["--steps", "0"], "--steps must be an integer from 1 to 10000, got 0"),
        (["--budget", "lots"], "--budget must be"),
        (["-p", "a <lora:nope:1>"], "pass --lora-dir"),
        (["--lora", "/nonexistent.safetensors:0.5"], "no such file"),
        (["--device", "no-such-device"], "--device 'no-such-device'"),
        (["--arch", "sd9"], "--arch must be one of"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, pipe_dir, capsys, args, message):
    argv = ["generate", "--model", str(pipe_dir), "-p", "a cat", "-o", str(tmp_path / "x.png"), *args]
    try:
        status = main(argv)
    except SystemExit as exited:  # argparse refuses a flag's text itself
        status = exited.code
    assert status == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_unknown_tag_name_and_bad_folder_exit_2(tmp_path, pipe_dir, lora_dir, capsys):
    out = tmp_path / "x.png"
    assert (
        main(
            [
                "generate",
                "--model",
                str(pipe_dir),
                "-p",
                "<lora:missing:1>",
                "--lora-dir",
                str(lora_dir),
                "-o",
                str(out),
            ]
        )
        == 2
    )
    assert "no adapter 'missing'" in capsys.readouterr().err
    assert main(["generate", "--model", str(lora_dir), "-p", "a", "-o", str(out)]) == 2
    assert "no model_index.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse usage errors
        main(["generate", "--model", str(pipe_dir), "-p", "a", "--lora-apply-mode", "later"])
    assert exc.value.code == 2
    assert not out.exists()


def test_single_file_model_needs_arch_and_loads_offline_or_says_why(tmp_path, capsys):
    ckpt = tmp_path / "model.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3)}, ckpt)
    out = tmp_path / "x.png"
    assert main(["generate", "--model", str(ckpt), "-p", "a", "-o", str(out)]) == 2
    assert "single file: say which architecture it is with --arch" in capsys.readouterr().err
    assert main(["generate", "--model", str(ckpt), "--arch", "sd1", "-p", "a", "-o", str(out)]) == 2
    assert "cannot load the pipeline (single files need --config FOLDER offline)" in capsys.readouterr().err
    assert not out.exists()


def test_strict_refuses_when_keys_miss(tmp_path, pipe_dir, capsys):
    extra = {
        "lora_unet_no_such_layer.lora_down.weight": torch.zeros(4, 8),
        "lora_unet_no_such_layer.lora_up.weight": torch.zeros(8, 4),
    }
    path = _lora(pipe_dir, tmp_path / "partial.safetensors", extra)
    rc, out = _generate(tmp_path, pipe_dir, "strict", "-p", "a cat", "--lora", str(path), "--strict")
    err = capsys.readouterr().err
    assert rc == 1 and not out.exists() and not out.with_suffix(".json").exists()
    assert "lora_unet_no_such_layer" in err and "nothing written" in err
    rc, out = _generate(tmp_path, pipe_dir, "lenient", "-p", "a cat", "--lora", str(path))
    assert rc == 0 and out.exists() and "2 keys did not land" in capsys.readouterr().err


def test_quantize_with_nothing_to_quantize_says_so(tmp_path, pipe_dir, capsys):  # issue 42 item 8
    """Every tiny layer is under SDNQ's floor: the summary line says nothing was quantized."""
    capsys.readouterr()
    rc, out = _generate(tmp_path, pipe_dir, "q0", "-p", "a cat", "--quantize", "sdnq-int8")
    assert rc == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out} ") and "sdnq-int8: no layer quantized" in line
    assert json.loads(out.with_suffix(".json").read_text())["quantized_layers"] == 0


def test_runtime_streamed_and_quantized(tmp_path, pipe_dir, lora_dir, monkeypatch, capsys):
    """Runtime mode and a streamed denoiser (CPU simulation) give the merged image; SDNQ int8 runs the
    LoRA."""
    from loraweave.tools import generate

    # SDNQ skips layers under 16384 weights: every tiny layer would stay float.
    monkeypatch.setitem(generate.QUANTIZE, "sdnq-int8", {"weights_dtype": "int8", "minimum_allowed_numel": 0})
    tag = ["-p", "a cat <lora:x:1>", "--lora-dir", str(lora_dir)]
    rc, merged = _generate(tmp_path, pipe_dir, "merged", *tag, "--lora-apply-mode", "merge")
    assert rc == 0
    rc, streamed = _generate(
        tmp_path, pipe_dir, "streamed", *tag, "--lora-apply-mode", "runtime", "--budget", "700K"
    )
    assert rc == 0
    blocks = json.loads(streamed.with_suffix(".json").read_text())["streaming"]["blocks"]
    assert any(not b["resident"] for b in blocks)  # some blocks really streamed through slots
    assert np.abs(_pixels(merged) - _pixels(streamed)).max() <= 1  # merge rounds once, runtime adds in fp32
    capsys.readouterr()
    rc, quant = _generate(tmp_path, pipe_dir, "quant", *tag, "--quantize", "sdnq-int8", "--json")
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["output"] == str(quant) and printed["seed"] == 7 and printed["prompt"] == "a cat"
    side = json.loads(quant.with_suffix(".json").read_text())
    report = side["report"]
    assert side["quantized_layers"] > 20 and printed["quantized_layers"] == side["quantized_layers"]
    assert report["keys_applied"] == report["keys_total"]
    assert report["counts"]["unet"].get("factor", 0) > 0  # LoRA rides SDNQ's low-rank channel
    assert np.abs(_pixels(quant) - _pixels(merged)).mean() < 8  # int8 base: close to the float image
