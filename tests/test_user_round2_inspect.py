"""Issue 30, a new user's second run-through: what `inspect` says about real files (items 3 and 11)."""

from __future__ import annotations

import json

from conftest import REALDATA
from safetensors import safe_open

from loraweave.tools.inspect import format_table, inspect_adapter

LORA = REALDATA / "lora"
FLUX_AI_TOOLKIT = LORA / "leighwoods__public-loras__lora.safetensors"
SD1_LOKR = ("KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr", "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr")


def test_sd1_lokr_files_show_no_flux_variant_list(realdata):
    """An SD1 UNet's `transformer_blocks.0` is no Flux double block: no Flux/Hunyuan release is offered."""
    for name in SD1_LOKR:
        info = inspect_adapter(LORA / f"{name}.safetensors")
        assert info["architecture"]["name"] == "sd1"
        assert info["variant"]["fits"] == [] and info["variant"]["likely"] is None
        table = format_table(info)
        assert "variant" not in table and "double blocks" not in table, table


def test_flux_ai_toolkit_file_that_lands_names_flux1(realdata):
    """The file trains only single blocks' `proj_out` (input hidden * (1 + mlp_ratio), 5x the hidden width),
    up to block 20: the Flux.1-dev config (38 single blocks, 24 heads x 128) takes it, and every key lands."""
    config = json.loads((REALDATA / "configs" / "flux1-dev__transformer_config.json").read_text())
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    with safe_open(FLUX_AI_TOOLKIT, "pt") as f:
        widths = {f.get_slice(k).get_shape()[1] for k in f.keys() if k.endswith("lora_A.weight")}
        top = max(int(k.split(".")[2]) for k in f.keys())
    assert widths == {hidden * 5} and top < config["num_single_layers"]

    info = inspect_adapter(FLUX_AI_TOOLKIT)
    assert info["coverage"]["keys_applied"] == info["coverage"]["keys_total"] == 8
    assert info["variant"]["likely"] == "flux1 (dev, schnell, Fill, Kontext)"
    table = format_table(info)
    assert "no known variant" not in table
    assert (
        "flux1 (dev, schnell, Fill, Kontext) (file: 21 single blocks, width 15360; every key lands" in table
    )
    # without the coverage check nothing vouches for the width: no release is named, and none of Flux.2's
    assert inspect_adapter(FLUX_AI_TOOLKIT, coverage=False)["variant"]["fits"] == []
