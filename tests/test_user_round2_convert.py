"""Issue 30, a new user's second run-through: a cloneofsimo file with textual-inversion tokens (item 14)."""

from __future__ import annotations

import pytest
import torch
from conftest import REALDATA
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraweave.cli import main
from loraweave.tools.convert import ConvertError, convert

CLONEOFSIMO = REALDATA / "lora" / "cloneofsimo__lora__analog_svd_rank4.safetensors"
TOKENS = ("<s1>", "<s2>")


@pytest.fixture
def pivotal(realdata, tmp_path):
    """The real cloneofsimo file plus two token embeddings, as lora_diffusion's pivotal tuning saves them: one
    [768] vector per token, named by the token (shared/notes/key-layouts.md)."""
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
