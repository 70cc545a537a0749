"""Issue 30, a new user's second run-through: a cloneofsimo file with textual-inversion tokens (item 14), and
the text-encoder names our conversions write, checked against ComfyUI's own key map (found with item 13)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REALDATA
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraweave.cli import main
from loraweave.errors import ConvertError
from loraweave.tools.convert import convert

CLONEOFSIMO = REALDATA / "lora" / "cloneofsimo__lora__analog_svd_rank4.safetensors"
TOKENS = ("<s1>", "<s2>")


@pytest.fixture
def pivotal(realdata, tmp_path):
    """The real cloneofsimo file plus two token embeddings, as lora_diffusion's pivotal tuning saves them: one
    [768] vector per token, named by the token (e.g. `<s1>`, `<s2>`)."""
    tensors = load_file(CLONEOFSIMO)
    with safe_open(CLONEOFSIMO, "pt") as f:
        metadata = f.metadata()
    g = torch.Generator().manual_seed(0)
    for token in TOKENS:
        tensors[token] = torch.randn(768, generator=g).half()
        metadata[token] = "<embed>"
    save_file(tensors, tmp_path / "pivotal.safetensors", metadata)
    return tmp_path / "pivotal.safetensors"


def test_tokens_refused_with_the_flag_named(pivotal, tmp_path, capsys):
    out = tmp_path / "kohya.safetensors"
    with pytest.raises(ConvertError, match="--drop-embeddings") as err:
        convert(pivotal, "kohya", out, arch="sd1")
    assert "<s1>, <s2>" in str(err.value) and str(pivotal) in str(err.value)
    assert main(["convert", str(pivotal), "--to", "kohya", "--arch", "sd1", "-o", str(out)]) == 2
    assert "--drop-embeddings" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("layout", ["kohya", "comfy"])
def test_drop_embeddings_converts_the_adapter_as_without_them(pivotal, tmp_path, capsys, layout):
    """The output is the conversion of the real file without the tokens, tensor for tensor and bit for bit."""
    reference = tmp_path / "reference.safetensors"
    convert(CLONEOFSIMO, layout, reference, arch="sd1")
    out = tmp_path / "dropped.safetensors"
    argv = ["convert", str(pivotal), "--to", layout, "--arch", "sd1", "-o", str(out), "--drop-embeddings"]
    assert main(argv) == 0
    assert "dropped textual-inversion token embeddings: <s1>, <s2>" in capsys.readouterr().out
    got, want = load_file(out), load_file(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    result = convert(pivotal, layout, tmp_path / "api.safetensors", arch="sd1", drop_embeddings=True)
    assert result.dropped_embeddings == list(TOKENS) and result.to_dict()["dropped_embeddings"] == list(
        TOKENS
    )


COMFY_KEYS = Path(__file__).parent / "helpers" / "comfy_keys.py"
SUFFIXES = (".alpha", ".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight")


def _comfy_clip_keys() -> set[str]:
    """What ComfyUI accepts for SD1.5's CLIP: its key map over the real ldm checkpoint's CLIP names
    (sd-mecha's key list), which ComfyUI loads as `clip_l.transformer.`."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    ldm = yaml.load((REALDATA / "keys" / "sd-mecha" / "sd1-ldm.yaml").read_text(), Loader=loader)
    names = [
        k.replace("cond_stage_model.transformer.", "clip_l.transformer.") for k in ldm["components"]["clip_l"]
    ]
    proc = subprocess.run(  # the harness fails loudly when ComfyUI's tree is missing
        [sys.executable, str(COMFY_KEYS)], input=json.dumps(names), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout))


def test_text_encoder_names_are_the_ones_comfyui_reads(realdata, tmp_path):
    """transformers 5 dropped CLIP's `text_model.` level, and kohya, diffusers and comfy outputs wrote
    `encoder.layers...` without it: ComfyUI (and A1111, diffusers) skip such keys. Every text-encoder stem of
    each conversion of the real cloneofsimo file (12 layers x q, k, v, out) is now in ComfyUI's key map."""
    accepted = _comfy_clip_keys()
    for layout in ("kohya", "comfy", "diffusers"):
        out = tmp_path / f"{layout}.safetensors"
        convert(CLONEOFSIMO, layout, out, arch="sd1")
        stems = set()
        for key in load_file(out):
            stem = next(key[: -len(s)] for s in SUFFIXES if key.endswith(s))
            if not stem.startswith(("lora_unet_", "diffusion_model.", "unet.")):
                stems.add(stem)
        assert len(stems) == 48, layout
        assert stems <= accepted, (layout, sorted(stems - accepted)[:3])
