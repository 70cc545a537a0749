"""Issue 42 item 3: `resize` keeps no identity of its source (network module, LyCORIS args, dims, hashes), and
`generate` writes the file's own hash into `Lora hashes`. Reference: A1111's AddNet hash computed here
independently (sha256 of the bytes after the safetensors header)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraweave.cli import main
from loraweave.tools.infotext import addnet_hash, parse_infotext
from loraweave.tools.tiny_pipeline import sample_lora, tiny_sd15

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

KEPT = {
    "ss_tag_frequency": json.dumps({"cats": {"cat": 3}}),
    "modelspec.title": "cats",
    "ss_output_name": "c",
}


def _addnet(path: Path) -> str:
    raw = path.read_bytes()
    return hashlib.sha256(raw[8 + struct.unpack("<Q", raw[:8])[0] :]).hexdigest()


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


@pytest.fixture(scope="module")
def lokr_and_pipe(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny SD1.5 pipeline and a LyCORIS LoKr on its attention Linears carrying a trainer's identity."""
    from diffusers import StableDiffusionPipeline

    root = tmp_path_factory.mktemp("identity")
    pipe_dir = tiny_sd15(root / "pipe")
    lora = sample_lora(
        StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True), root / "l.st"
    )
    g = torch.Generator().manual_seed(5)
    lokr = {}
    for key, up in load_file(lora).items():
        if key.endswith(".lora_up.weight"):
            stem, out_features = key[: -len(".lora_up.weight")], up.shape[0]
            in_features = load_file(lora)[f"{stem}.lora_down.weight"].shape[1]
            lokr[f"{stem}.lokr_w1"] = torch.randn(2, 2, generator=g)
            lokr[f"{stem}.lokr_w2"] = torch.randn(out_features // 2, in_features // 2, generator=g) * 0.05
    source = root / "loras" / "source.safetensors"
    source.parent.mkdir()
    save_file(lokr, str(source))
    identity = {
        "ss_network_module": "lycoris.kohya",
        "ss_network_args": json.dumps({"algo": "lokr", "factor": 2, "conv_dim": 8, "conv_alpha": 4}),
        "ss_network_dim": "100000",
        "ss_network_alpha": "1",
        "sshs_model_hash": _addnet(source),
        "sshs_legacy_hash": "0123abcd",
        "modelspec.hash_sha256": "0x" + "ab" * 32,
    }
    save_file(lokr, str(source), metadata=identity | KEPT)
    return pipe_dir, source


def test_resize_writes_its_own_identity_and_generate_its_real_hash(lokr_and_pipe, tmp_path, capsys):
    pipe_dir, source = lokr_and_pipe
    out = tmp_path / "small.safetensors"
    assert main(["resize", str(source), "-o", str(out), "--rank", "4"]) == 0, capsys.readouterr().err
    meta = _metadata(out)
    assert all(meta[k] == v for k, v in KEPT.items())  # what still describes the file stays
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == "4"
    assert not {"ss_network_args", "ss_network_alpha", "sshs_legacy_hash", "modelspec.hash_sha256"} & set(
        meta
    )
    assert "lokr" not in json.dumps(meta).lower()
    real = _addnet(out)
    assert meta["sshs_model_hash"] == real != _metadata(source)["sshs_model_hash"]

    png = tmp_path / "x.png"
    common = ["--steps", "2", "-W", "32", "-H", "32", "-s", "1", "--lora", f"{out}:1"]
    assert main(["generate", "--model", str(pipe_dir), "-p", "a cat", "-o", str(png), *common]) == 0
    _, _, params = parse_infotext(Image.open(png).text["parameters"])
    assert params["Lora hashes"] == f"small: {real[:12]}"


def test_lora_hash_is_the_files_not_a_stale_metadata_copy(lokr_and_pipe, tmp_path):
    _, source = lokr_and_pipe
    stale = tmp_path / "renamed_copy.safetensors"
    tensors = load_file(source)
    tensors[next(iter(tensors))] *= 2  # other bytes, the source's sshs_model_hash still in the metadata
    save_file(tensors, str(stale), metadata=_metadata(source))
    assert (
        addnet_hash(stale, _metadata(stale))
        == _addnet(stale)[:12]
        != _metadata(stale)["sshs_model_hash"][:12]
    )
