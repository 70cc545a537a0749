"""Every catalog architecture's largest layer, and the layer kinds LoRAs target most, at their real size,
through the default merge.

For each architecture of the registry: its full-size denoiser on the meta device and its largest Linear/Conv
weight (Flux.2's fused to_qkv_mlp_proj 55296x6144, MiniMax-H3's adaln_proj 96768x2688, Wan's time_proj
30720x5120, SD1.5's 1280x2560x3x3 up-block conv, ...); then the FFN and MLP layers the issue names (Flux ff,
Wan 14B ffn.0/ffn.2, Qwen-Image img_mlp, LTX-2 FFN, SDXL ff.net.0.proj). Each is materialized alone in bf16
(the dtype these models are run in) with seeded values; a rank-16 LoRA (‖ΔW‖ = 5% of ‖W‖) in PEFT layout under
the layer's own module path; `apply(mode="merge")` with the default undo. Merged rows (every 97th plus the
last) are checked against W + B·A in fp64 to one bf16 ulp; `remove()` restores every element's bits
(regenerated from the seed). Mechanisms and the other dtypes run on a subset of these shapes in
test_realsize_mechanisms.py.

Every architecture record is in the tier: records without a skeleton are either detection families (shared
names told apart by width: their sizes are those of the releases the widths name, each a record with a
skeleton), or built here from their diffusers class (CLASS_DEFAULTS: the two largest weight shapes of each),
or named in UNCOVERED with the reason; test_every_record_is_in_the_tier keeps that list exact, so a new record
cannot slip past the tier."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers.realsize import (
    POOL,
    RealLayer,
    assert_merged,
    assert_seeded,
    fill_seeded,
    largest_layers,
    layer_at,
    lora_for,
    materialized,
    meta_denoiser,
    sample_rows,
)

import loraweave
from loraweave.arch import registry
from loraweave.arch.catalog import CATALOG
from loraweave.arch.record import Architecture

# Largest layer above 2**27 elements (Flux.2's 55296x6144 to_qkv_mlp_proj: 340M): marked slow as well, so
# `-m "realsize and not slow"` is the tier's quick subset; the test checks each name belongs here.
HUGE = 2**27
HUGE_ARCHS = {
    "flux2",
    "flux2-klein-9b",
    "ltx2.3",
    "minimax-h3",
    "ideogram4",
    "wan-animate",
    "wan-animate-2",
    "wan",
    "krea2",
}
ARCHS = [
    pytest.param(a.name, marks=[pytest.mark.slow] if a.name in HUGE_ARCHS else [])
    for a in registry.ARCHITECTURES
    if a.skeleton is not None
]
# 2 threads on 2 shared cores spin in OpenMP barriers: ~10x a merge's CPU time (and wall time) under load
pytestmark = pytest.mark.usefixtures("one_thread")
SEED = 7

# Records without a skeleton whose size is known from their diffusers class: (class, config, where the numbers
# come from). No released config of either is in ../shared/realdata/configs; the catalog's own Kandinsky 5
# skeleton stands on its class defaults too.
CLASS_DEFAULTS: dict[str, tuple[str, dict, str]] = {
    "flux3": (
        "Flux3Transformer2DModel",
        {},
        "class defaults: 5 per-mode + 28 single blocks, 24 heads x 128, 20480-wide Qwen3-VL context; the "
        "size test_arch_ltx_layouts.py's full-size Flux3 test uses",
    ),
    "kandinsky6": (
        "Kandinsky6Transformer3DModel",
        {"text_token_padding": True, "ca_rope": True, "cross_gates": True, "fix_modulation": True},
        "class defaults (model_dim 4096, ff_dim 16384, 60 fused video/audio blocks) with the four flags the "
        "class docstring says every released checkpoint sets",
    ),
}
# Records with no real size known anywhere: name -> why.
UNCOVERED: dict[str, str] = {
    "hidream-o1": "named by detection only: no diffusers class in 0.42.1 (arch/hidream_o1.py)",
}


# (architecture, module path, shape): the FFN / MLP kinds LoRA trainers target, at the released sizes.
TARGETED = [
    ("flux", "transformer_blocks.0.ff.net.0.proj", (12288, 3072)),
    ("flux", "transformer_blocks.0.ff.net.2", (3072, 12288)),
    ("wan", "blocks.0.ffn.net.2", (5120, 13824)),
    ("qwen-image", "transformer_blocks.0.img_mlp.net.0.proj", (12288, 3072)),
    ("ltx2", "transformer_blocks.0.ff.net.2", (4096, 16384)),
    ("sdxl", "down_blocks.2.attentions.0.transformer_blocks.0.ff.net.0.proj", (10240, 1280)),
]


def merge_and_restore(model: torch.nn.Module, layer: RealLayer) -> None:
    lora = lora_for(layer)
    with materialized(model, [layer.path], torch.bfloat16, SEED):
        weight = model.get_submodule(layer.path).weight
        rows = sample_rows(layer.shape[0])
        original = weight.detach()[rows].clone()
        handle = loraweave.apply(model, lora.state_dict(layer.path), mode="merge", strict=True)
        assert [m.module for m in handle.report.applied] == [layer.path]
        assert_merged(weight, rows, original, lora, 1.0, str(layer))
        handle.remove()
        assert_seeded(weight, SEED, f"{layer} after remove()")


@pytest.mark.parametrize("arch", ARCHS)
def test_largest_layer_merges_and_restores_at_real_size(arch):
    model = meta_denoiser(arch)
    (layer,) = largest_layers(model, arch, count=1)
    assert layer.numel > 2**22, layer  # a real size, not a toy
    assert (layer.numel > HUGE) == (arch in HUGE_ARCHS), layer
    merge_and_restore(model, layer)


@pytest.mark.parametrize(("arch", "path", "shape"), TARGETED, ids=[f"{a}:{p}" for a, p, _ in TARGETED])
def test_targeted_layer_kinds_merge_and_restore_at_real_size(arch, path, shape):
    model = meta_denoiser(arch)
    layer = layer_at(model, arch, path)
    assert layer.shape == shape
    merge_and_restore(model, layer)


@functools.lru_cache(maxsize=1)  # each record's two layers in a row
def _class_default_model(arch: str) -> torch.nn.Module:
    import diffusers

    cls, config, _ = CLASS_DEFAULTS[arch]
    with torch.device("meta"):
        return getattr(diffusers, cls).from_config(config)


def class_default_model(arch: str) -> torch.nn.Module:
    """The record's diffusers class on the meta device, built once per session; each caller gets a deep
    copy."""
    return copy.deepcopy(_class_default_model(arch))


def uncovered_records() -> set[str]:
    """Registry records the tier covers in none of the three ways (asserting each family's releases are in
    it)."""
    records = registry.by_name()
    with_skeleton = {name for name, a in records.items() if a.skeleton is not None}
    families = {name: a.widths for name, a in records.items() if a.skeleton is None and a.widths is not None}
    for name, widths in families.items():  # a family's sizes are its releases'
        assert set(widths.names.values()) <= with_skeleton, (name, set(widths.names.values()) - with_skeleton)
    assert not set(CLASS_DEFAULTS) & with_skeleton, (
        "a record with a skeleton is in the tier already: drop it here"
    )
    return set(records) - with_skeleton - set(families) - set(CLASS_DEFAULTS)


def test_every_record_is_in_the_tier():
    assert uncovered_records() == set(UNCOVERED), f"records outside the real-size tier: {uncovered_records()}"
    assert {p.values[0] for p in ARCHS} == set(CATALOG)
    # negative control: a record added without a skeleton is caught
    with registry.registered(Architecture("realsize-probe")):
        assert uncovered_records() == set(UNCOVERED) | {"realsize-probe"}


@pytest.mark.parametrize("nth", [0, 1], ids=["largest", "second"])
@pytest.mark.parametrize("arch", list(CLASS_DEFAULTS))
def test_class_default_records_merge_and_restore_at_real_size(arch, nth):
    model = class_default_model(arch)
    layer = largest_layers(model, arch, count=2)[nth]
    assert layer.numel > 2**24, layer  # a real size, past float32's exact integers
    merge_and_restore(model, layer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_seeded_fill_is_checked_bit_for_bit(dtype):
    """The fill every restore check here compares against: past one pool period (elements repeat every POOL),
    no two rows equal, N(0, 1/fan_in); a flipped low bit, a shift by one element and the neighbouring seed all
    fail assert_seeded (the negative controls of "restored bit for bit")."""
    w = torch.empty(700, 3001, dtype=dtype)  # 2.1M elements: two periods and a part
    fill_seeded(w, SEED)
    assert_seeded(w, SEED, "fresh fill")
    assert w.numel() > 2 * POOL
    assert torch.unique(w.view(torch.uint8 if dtype.itemsize == 1 else torch.int16), dim=0).shape[0] == 700
    std = float(w.double().std())
    assert abs(std * 3001**0.5 - 1) < 0.02, std
    flat = w.view(-1)
    for k in (0, POOL + 5, w.numel() - 1):
        flipped = w.clone()
        flipped.view(-1).view(torch.uint8)[k * dtype.itemsize] ^= 1
        with pytest.raises(AssertionError, match=f"flat {k} "):
            assert_seeded(flipped, SEED, "one bit")
    shifted = torch.roll(flat, 1).view_as(w)
    with pytest.raises(AssertionError, match="differs"):
        assert_seeded(shifted, SEED, "shifted")
    with pytest.raises(AssertionError, match="differs"):
        assert_seeded(w, SEED + 1, "another seed")
