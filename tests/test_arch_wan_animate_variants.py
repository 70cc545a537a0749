"""Wan Animate original names (face adapter, face encoder, motion encoder), checked against diffusers'
converter.

1. names: the test's own inverse of `convert_wan_transformer_to_diffusers` writes every parameter of the
   full-size (released config) model in original spelling; the converter must give the live state dict back,
   which makes the key list converter-derived. Every original module and bare parameter must then resolve to
   exactly the modules / rows the converter sends it to (100 %, on `meta`).
2. numbers: a LoRA on every Linear, in original names, merged and at runtime equals the converter's keys
   loaded by PEFT (fp32, 1e-5 relative); a full-difference file over every parameter (convolutions, motion
   encoder biases stored (1, C, 1, 1), `dec.direction`) changes each parameter exactly as the converter maps
   it.
3. negative control: the face adapter's `linear1_kv` halves swapped in the table make (1) fail.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers.arch_layouts import assert_matches_peft, linears, lora_file
from helpers.registry import patch_tables

import loraweave
from loraweave.arch.aliases import AliasTable

# Wan2.2-Animate-14B transformer config (diffusers' conversion script / the Diffusers repo config).
ANIMATE_14B = dict(
    added_kv_proj_dim=5120,
    image_dim=1280,
    in_channels=36,
    num_attention_heads=40,
    num_layers=40,
    ffn_dim=13824,
    text_dim=4096,
    inject_face_latents_blocks=5,
)
TINY_CHANNELS = {str(2**k): 4 for k in range(2, 10)}
ANIMATE_TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=12,
    latent_channels=4,
    out_channels=4,
    text_dim=24,
    freq_dim=16,
    ffn_dim=64,
    num_layers=2,
    image_dim=24,
    added_kv_proj_dim=32,
    motion_encoder_channel_sizes=TINY_CHANNELS,
    motion_style_dim=16,
    motion_dim=4,
    motion_encoder_dim=16,
    face_encoder_hidden_dim=8,
    face_encoder_num_heads=2,
    inject_face_latents_blocks=1,
)

_ME = "motion_encoder.enc.net_app.convs"
# live -> original, applied in order (the converter's renames read backwards; `\1` keeps block numbers).
_INVERSE = (
    (r"^face_adapter\.(\d+)\.to_q\.", r"face_adapter.fuser_blocks.\1.linear1_q."),
    (r"^face_adapter\.(\d+)\.to_[kv]\.", r"face_adapter.fuser_blocks.\1.linear1_kv."),
    (r"^face_adapter\.(\d+)\.to_out\.", r"face_adapter.fuser_blocks.\1.linear2."),
    (r"^face_adapter\.(\d+)\.norm_([qk])\.", r"face_adapter.fuser_blocks.\1.\2_norm."),
    (r"^face_encoder\.(conv1_local|conv2|conv3)\.", r"face_encoder.\1.conv."),
    (r"^motion_encoder\.conv_in\.act_fn\.bias$", f"{_ME}.0.1.bias"),
    (r"^motion_encoder\.conv_in\.", f"{_ME}.0.0."),
    (r"^motion_encoder\.conv_out\.", f"{_ME}.8."),
    (r"^motion_encoder\.motion_network\.", "motion_encoder.enc.fc."),
    (r"^motion_encoder\.motion_synthesis_weight$", "motion_encoder.dec.direction.weight"),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (
        r"^condition_embedder\.time_embedder\.linear_([12])\.",
        lambda m: f"time_embedding.{2 * int(m[1]) - 2}.",
    ),
    (
        r"^condition_embedder\.text_embedder\.linear_([12])\.",
        lambda m: f"text_embedding.{2 * int(m[1]) - 2}.",
    ),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
)
_BLOCK = (
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."),
    (".norm_added_k.", ".norm_k_img."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    (".norm2.", ".norm#."),
    (".norm3.", ".norm2."),
    (".norm#.", ".norm3."),
)


def animate_original(key: str) -> str:
    """A live state-dict key as the original Wan Animate checkpoint writes it (the test's own inverse)."""
    m = re.match(r"^motion_encoder\.res_blocks\.(\d+)\.(conv1|conv2|conv_skip)\.(act_fn\.bias|weight)$", key)
    if m:
        n, conv, what = int(m[1]) + 1, m[2], m[3]
        index = {"conv1": (0, 1), "conv2": (1, 2), "conv_skip": (1, None)}[conv][what != "weight"]
        module = "skip" if conv == "conv_skip" else conv
        return f"{_ME}.{n}.{module}.{index}.{'bias' if what != 'weight' else 'weight'}"
    for live, original in _INVERSE:
        if re.search(live, key):
            return re.sub(live, original, key)
    if key.startswith("blocks."):
        for new, old in _BLOCK:
            key = key.replace(new, old)
    return key


def _build(meta: bool, config: dict, cls: str = "WanAnimateTransformer3DModel"):
    import diffusers

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return getattr(diffusers, cls)(**config)
    return getattr(diffusers, cls)(**config).eval()


# The converter turns its face adapter / motion encoder renames on only when the file has such keys:
# converting one key at a time, these probes (dropped from the result) stand for the rest of a full
# checkpoint.
_PROBES = ("face_adapter._probe", "motion_encoder._probe")


def _convert(sd: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    ckpt = {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    ckpt.update({f"model.diffusion_model.{p}": torch.zeros(1) for p in _PROBES})
    return {k: v for k, v in convert_wan_transformer_to_diffusers(ckpt).items() if k not in _PROBES}


def original_state(model) -> dict[str, torch.Tensor]:
    """The model's parameters under original names and shapes (fused k|v, (1, C, 1, 1) activation biases)."""
    out: dict[str, list[torch.Tensor]] = {}
    for key, value in model.state_dict().items():
        if ".act_fn.bias" in key:
            value = value.reshape(1, -1, 1, 1)
        out.setdefault(animate_original(key), []).append(value)
    return {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in out.items()}


def converter_map(model, state=None, convert=None) -> dict[str, list[str]]:
    """{original parameter: live parameters in row order}, each original key converted on its own."""
    state, convert = state or original_state, convert or _convert
    return {key: list(convert({key: value})) for key, value in state(model).items()}


def test_inverse_is_the_converters_full_size():
    """The converter turns the test's original key list back into exactly the live state dict, shapes
    included."""
    model = _build(True, ANIMATE_14B)
    state = model.state_dict()
    converted = _convert(original_state(model))
    assert set(converted) == set(state)
    assert all(converted[k].shape == state[k].shape for k in state)
    assert len(model.face_adapter) == 8 and len(model.motion_encoder.res_blocks) == 7


def assert_resolves_as_the_converter_says(model, state=None, convert=None):
    table = AliasTable(model)
    wrong, checked = {}, 0
    for original, live in converter_map(model, state, convert).items():
        owner, _, leaf = original.rpartition(".")
        modules = [k.rsplit(".", 1)[0] for k in live]
        if all(m in table.modules for m in modules) and leaf in ("weight", "bias"):
            found = table.lookup(owner)
            got = [p.module for p in found] if isinstance(found, tuple) else found
            rows = [p.src_start for p in found] if isinstance(found, tuple) else []
            if got != modules or rows != sorted(rows):
                wrong[original] = (got, modules)
        else:  # a bare parameter (modulation tables, motion encoder biases, dec.direction)
            (target,) = live
            found = table.param(original)
            if found is None or found[0] != target:
                wrong[original] = (found, target)
        checked += 1
    assert not wrong, list(wrong.items())[:3]
    return checked


def test_every_original_name_resolves_full_size():
    model = _build(True, ANIMATE_14B)
    checked = assert_resolves_as_the_converter_says(model)
    assert checked == len(original_state(model))
    names = set(converter_map(model))
    assert {
        "face_adapter.fuser_blocks.7.linear1_kv.weight",
        "motion_encoder.enc.net_app.convs.8.weight",
        "motion_encoder.enc.net_app.convs.7.skip.1.weight",
        "motion_encoder.dec.direction.weight",
        "face_encoder.conv1_local.conv.weight",
        "blocks.39.cross_attn.k_img.weight",
    } <= names


@pytest.mark.parametrize("flat", [False, True])
def test_full_size_lora_file_resolves_completely(flat):
    """A ComfyUI-style (or kohya-flattened) LoRA on every weighted module (Linear, conv, motion layers) in
    original names."""
    model = _build(True, ANIMATE_14B)
    table = AliasTable(model)
    sd = {}
    for original in original_state(model):
        owner, _, leaf = original.rpartition(".")
        found = table.lookup(owner)
        if leaf != "weight" or not isinstance(found, tuple):
            continue
        shape = dict(model.named_parameters())[f"{found[0].module}.weight"].shape
        if len(shape) < 2:
            continue
        rows = sum(p.length for p in found)
        owner = "lora_unet_" + owner.replace(".", "_") if flat else f"diffusion_model.{owner}"
        sd[f"{owner}.lora_down.weight"] = torch.empty(2, *shape[1:], device="meta")
        sd[f"{owner}.lora_up.weight"] = torch.empty(rows, 2, *([1] * (len(shape) - 2)), device="meta")
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)
    flat_keys = [k.replace(".", "_") for k in sd]
    assert any("motion_encoder_enc_fc" in k for k in flat_keys) and any("linear1_kv" in k for k in flat_keys)


def _converted_lora(sd: dict) -> dict:
    """The converter on each lora_B (its rows follow the weight's), lora_A copied to every piece."""
    out = {}
    for key, b in sd.items():
        if not key.endswith(".lora_B.weight"):
            continue
        a = sd[key.replace("lora_B", "lora_A")]
        for live, part in _convert({key.removeprefix("diffusion_model."): b}).items():
            out[f"transformer.{live}"] = part
            out[f"transformer.{live.replace('lora_B', 'lora_A')}"] = a
    return out


def _module_original(live: str) -> str:
    return animate_original(f"{live}.weight").removesuffix(".weight")


def animate_lora(model, seed: int = 4) -> dict[str, torch.Tensor]:
    """A LoRA on every Linear in original names (fused linear1_kv once per face block)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for live, m in linears(model).items():
        stem = f"diffusion_model.{_module_original(live)}"
        if f"{stem}.lora_A.weight" in sd:  # to_v: second half of linear1_kv
            sd[f"{stem}.lora_B.weight"] = torch.cat(
                [sd[f"{stem}.lora_B.weight"], torch.randn(m.out_features, 2, generator=g) * 0.1]
            )
            continue
        sd[f"{stem}.lora_A.weight"] = torch.randn(2, m.in_features, generator=g)
        sd[f"{stem}.lora_B.weight"] = torch.randn(m.out_features, 2, generator=g) * 0.1
    return sd


def test_tiny_lora_matches_diffusers_converter_and_peft():
    model = _build(False, ANIMATE_TINY)
    sd = animate_lora(model)
    assert any(".linear1_kv." in k for k in sd) and any("face_encoder.out_proj" in k for k in sd)
    assert any(".k_img." in k for k in sd) and any("head.head" in k for k in sd)
    assert_matches_peft(model, sd, _converted_lora(sd))


def test_tiny_full_differences_land_as_the_converter_maps_them():
    """`.diff` / `.diff_b` on every module and `<parameter>.diff` on bare ones (merge): each live parameter
    moves by the converter's rendering of the original deltas; convolutions and the motion encoder
    included."""
    model = _build(False, ANIMATE_TINY)
    table = AliasTable(model)
    g = torch.Generator().manual_seed(7)
    deltas = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in original_state(model).items()}
    sd = {}
    for original, delta in deltas.items():
        owner, _, leaf = original.rpartition(".")
        if isinstance(table.lookup(owner), tuple) and leaf in ("weight", "bias"):
            sd[f"diffusion_model.{owner}.{'diff' if leaf == 'weight' else 'diff_b'}"] = delta
        else:
            sd[f"diffusion_model.{original}.diff"] = delta
    expected = _convert(dict(deltas))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    h = loraweave.apply(model, sd, mode="merge", strict=True)
    assert h.report.unmatched == []
    after = model.state_dict()
    worst = max(float((after[k] - before[k] - expected[k]).abs().max()) for k in expected)
    assert set(expected) == set(before) and worst <= 1e-6, worst
    h.remove()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_swapped_kv_halves_are_caught(monkeypatch):
    def swap(t):
        return dataclasses.replace(
            t,
            aliases=tuple(
                dataclasses.replace(a, targets=a.targets[::-1]) if a.source.endswith("linear1_kv") else a
                for a in t.aliases
            ),
        )

    patch_tables(monkeypatch, lambda t: swap(t) if t.name == "wan-animate" else t)
    with pytest.raises(AssertionError, match="linear1_kv"):
        assert_resolves_as_the_converter_says(_build(True, {**ANIMATE_14B, "num_layers": 5}))


@pytest.mark.parametrize("flat", [False, True])
def test_animate_only_keys_are_expected_absent_on_other_wan(flat):
    """An Animate LoRA on Wan 2.1 I2V (same blocks, no face adapter / motion encoder): the block keys land
    with the numbers the Animate model gets, the Animate-only keys are expected absent and strict mode
    passes."""
    from helpers.tiny_configs import tiny_wan

    animate, i2v = _build(False, ANIMATE_TINY), tiny_wan(True)
    sd = animate_lora(animate)
    if flat:
        sd = {
            "lora_unet_"
            + k.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0].replace(".", "_")
            + ".lora_"
            + k.rsplit(".lora_", 1)[1]: v
            for k, v in sd.items()
        }
    h = loraweave.apply(i2v, sd, strict=True)
    misses = h.report.to_dict()["unmatched"]
    only = [k for k in sd if re.search(r"face_adapter|face_encoder", k)]
    assert sorted(u["key"] for u in misses) == sorted(only) and only
    assert all(
        u["kind"] == "expected_absent" and "exist only in Wan 2.2 Animate" in u["reason"] for u in misses
    )
    assert h.report.keys_applied == len(sd) - len(only)
    h.remove()
    diffs = {
        "diffusion_model.motion_encoder.enc.fc.0.diff": torch.zeros(4, 4),
        "diffusion_model.motion_encoder.enc.net_app.convs.0.1.bias.diff": torch.zeros(1, 4, 1, 1),
        "diffusion_model.pose_patch_embedding.diff": torch.zeros(32, 4, 1, 2, 2),
    }
    assert loraweave.plan(i2v, diffs).kinds() == {"expected_absent": 3}
    assert loraweave.plan(
        i2v, {"diffusion_model.face_adapter.fuser_blocks.0.linear7.diff": torch.zeros(4, 4)}
    ).kinds() == {"no_such_module": 1}  # a name Animate does not have either: a real miss


def test_without_the_animate_only_table_they_are_plain_misses(monkeypatch):
    """Negative control: without WAN_ANIMATE_ONLY the same keys are unknown modules and strict mode raises."""
    patch_tables(monkeypatch, lambda t: None if t.name == "wan-animate-only" else t)
    from loraweave.errors import StrictApplyError

    with pytest.raises(StrictApplyError, match="no_such_module"):
        test_animate_only_keys_are_expected_absent_on_other_wan(False)


def test_detection_names_wan_animate_and_the_catalog_builds_it():
    from loraweave.arch.catalog import build_meta
    from loraweave.arch.detect import detect_architecture
    from loraweave.formats.adapter import load_adapter

    model = build_meta("wan-animate")["transformer"]
    assert type(model).__name__ == "WanAnimateTransformer3DModel" and len(model.blocks) == 40
    sd = animate_lora(_build(False, ANIMATE_TINY))
    assert detect_architecture(load_adapter(sd)).architecture == "wan-animate"
    blocks_only = {k: v for k, v in sd.items() if k.startswith("diffusion_model.blocks.")}
    assert (
        detect_architecture(load_adapter(blocks_only)).architecture == "wan"
    )  # nothing Animate-only: plain Wan
    assert type(build_meta("wan-animate-2")["transformer"]).__name__ == "WanAnimate2Transformer3DModel"
    a2 = lora_file(
        linears(_animate2(False, **ANIMATE2_TINY)),
        lambda n: "diffusion_model." + animate2_original(f"{n}.weight").removesuffix(".weight"),
    )
    assert detect_architecture(load_adapter(a2)).architecture == "wan-animate-2"


@pytest.mark.parametrize(
    "cls",
    [
        "HunyuanVideo15Transformer3DModel",
        "HunyuanImageTransformer2DModel",
        "Kandinsky5Transformer3DModel",
        "WanAnimateTransformer3DModel",
    ],
)
@pytest.mark.parametrize("form", ["peft", "kohya"])
def test_diffusers_names_resolve_on_the_full_size_model(cls, form):
    """No original-name table for HunyuanVideo 1.5 / HunyuanImage 2.1 / Kandinsky 5 (no converter in
    diffusers' loaders): files in diffusers module names (PEFT `transformer.` or kohya-flattened) must still
    land 100 % on the class-default (released-size) model."""
    import diffusers

    config = ANIMATE_14B if cls.startswith("WanAnimate") else {}
    with torch.device("meta"):
        model = getattr(diffusers, cls)(**config)
    modules = linears(model)
    name = (
        (lambda n: f"transformer.{n}") if form == "peft" else (lambda n: "lora_unet_" + n.replace(".", "_"))
    )
    sd = lora_file(modules, name, meta=True)
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)
    assert {m["module"] if isinstance(m, dict) else m.module for m in report.applied} == set(modules)


# Flux.1 variants: dev/schnell/Kontext take 64 input channels, Fill 384 (latents, masked-image latents, mask);
# Kontext has no module of its own. A LoRA trained on Fill carries an x_embedder 384 columns wide.
def _flux(in_channels: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        out_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
        guidance_embeds=True,
    ).eval()


def _flux_lora(x_in: int, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "diffusion_model.img_in.lora_A.weight": torch.randn(2, x_in, generator=g),
        "diffusion_model.img_in.lora_B.weight": torch.randn(32, 2, generator=g) * 0.1,
        "diffusion_model.double_blocks.0.img_attn.proj.lora_A.weight": torch.randn(2, 32, generator=g),
        "diffusion_model.double_blocks.0.img_attn.proj.lora_B.weight": torch.randn(32, 2, generator=g) * 0.1,
    }


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_fill_x_embedder_is_expected_absent_on_dev(mode):
    dev = _flux(64)
    before = {k: v.clone() for k, v in dev.state_dict().items()}
    sd = _flux_lora(384)
    h = loraweave.apply(dev, sd, mode=mode, strict=True)  # strict: the Fill-only key does not count
    misses = h.report.to_dict()["unmatched"]
    assert {u["key"] for u in misses} == {k for k in sd if ".img_in." in k} and h.report.keys_applied == 2
    assert all(
        u["kind"] == "expected_absent"
        and u["reason"].startswith("expected absent: transformer.img_in")
        and "Flux Fill" in u["reason"]
        for u in misses
    )
    assert dev.x_embedder.in_features == 64 and dev.config.in_channels == 64  # never grown into a Fill shape
    assert torch.equal(dev.x_embedder.weight, before["x_embedder.weight"])
    h.remove()
    assert all(torch.equal(v, before[k]) for k, v in dev.state_dict().items())


def test_fill_lora_lands_whole_on_fill_and_control_growth_is_unchanged():
    assert loraweave.plan(_flux(384), _flux_lora(384)).unmatched == []
    dev_on_fill = loraweave.plan(
        _flux(384), _flux_lora(64)
    )  # a dev LoRA on Fill: zero columns for the extra inputs
    assert dev_on_fill.unmatched == [] and any(
        "zero-padded to 384" in n for m in dev_on_fill.applied for n in m.notes
    )
    control = loraweave.plan(
        _flux(64), _flux_lora(128)
    )  # BFL Canny/Depth: 128 columns, a control input that grows
    assert control.unmatched == [] and any(
        "input grown 64 -> 128" in n for m in control.applied for n in m.notes
    )


def test_without_the_fill_row_the_key_is_no_longer_expected_absent(monkeypatch):
    """Negative control: with the table's Fill width removed, the same file is refused as trained on inputs
    dev is not fed (384 is no control width) instead of applied with its Fill-only key expected absent."""
    patch_tables(monkeypatch, lambda t: dataclasses.replace(t, variant_inputs=()) if t.name == "flux" else t)
    with pytest.raises(loraweave.OtherInputError, match="from 64 to 384"):
        test_fill_x_embedder_is_expected_absent_on_dev("merge")


# Flux.2 klein, from the released transformer configs (DiffSynth-Studio's model_configs.py lists them):
# klein-4B 5 double / 20 single blocks, 24 heads x 128 = 3072; klein-9B 8 / 24, 32 x 128 = 4096.
@pytest.mark.parametrize(
    "name, double, single, hidden",
    [("flux2-klein-4b", 5, 20, 3072), ("flux2-klein-9b", 8, 24, 4096), ("flux2", 8, 48, 6144)],
)
def test_klein_catalog_matches_the_variant_table(name, double, single, hidden):
    from loraweave.arch.catalog import build_meta
    from loraweave.arch.variants import variants

    model = build_meta(name)["transformer"]
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks), model.inner_dim) == (
        double,
        single,
        hidden,
    )
    (variant,) = [v for v in variants() if v.catalog == name]
    assert variant.chains == {"double": double, "single": single} and variant.hidden == hidden
    fused = model.single_transformer_blocks[0].attn.to_qkv_mlp_proj
    assert fused.out_features == variant.single_rows * hidden


def _bfl_flux2_lora(double: int, single: int, hidden: int, single_rows: int) -> dict[str, torch.Tensor]:
    """BFL-named LoRA (rank 1, zeros) on every double-block qkv and single-block linear1, real row counts."""
    sd = {}
    for stem, n, rows in (
        ("double_blocks.{}.img_attn.qkv", double, 3),
        ("single_blocks.{}.linear1", single, single_rows),
    ):
        for i in range(n):
            sd[f"diffusion_model.{stem.format(i)}.lora_A.weight"] = torch.zeros(1, hidden)
            sd[f"diffusion_model.{stem.format(i)}.lora_B.weight"] = torch.zeros(rows * hidden, 1)
    return sd


@pytest.mark.parametrize(
    "name, double, single, hidden", [("flux2-klein-4b", 5, 20, 3072), ("flux2-klein-9b", 8, 24, 4096)]
)
def test_inspect_names_klein_and_checks_against_its_skeleton(tmp_path, name, double, single, hidden):
    """BFL names are shared with Flux.1 (detection alone says `flux`); block counts, width and the fused
    linear1 rows (9 x hidden: SwiGLU) name the klein variant, and coverage is checked on that variant's
    full-size model."""
    from safetensors.torch import save_file

    from loraweave.tools.inspect import format_table, inspect_adapter

    save_file(_bfl_flux2_lora(double, single, hidden, 9), tmp_path / "klein.safetensors")
    info = inspect_adapter(tmp_path / "klein.safetensors")
    assert info["variant"]["likely"] == name and info["architecture"]["name"] == name
    assert any(f"-> {name}" in e for e in info["architecture"]["evidence"])
    assert info["coverage"]["complete"] and info["coverage"]["keys_applied"] == info["coverage"]["keys_total"]
    table = format_table(info)
    assert f"architecture  {name}\n" in table and f"on architecture {name} (full size" in table


def test_flux1_file_with_few_blocks_is_not_taken_for_klein():
    """Negative: the same block counts at Flux.1's linear1 rows (7 x hidden) fit Flux.1, not klein-4B."""
    from loraweave.arch.variants import variant_fit
    from loraweave.formats.adapter import load_adapter

    flux1 = variant_fit(load_adapter(_bfl_flux2_lora(5, 20, 3072, 7)))
    assert "flux2-klein-4b" not in flux1["fits"] and "flux1 (dev, schnell, Fill, Kontext)" in flux1["fits"]
    assert flux1["catalog"] is None
    klein = variant_fit(load_adapter(_bfl_flux2_lora(5, 20, 3072, 9)))
    assert klein["fits"] == ["flux2-klein-4b"] and klein["catalog"] == "flux2-klein-4b"


# Wan-Animate-2: the official checkpoint wraps each block (`blocks.N.block.X`); attention uses q/k/v/o.
_A2_ATTN = (
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."),
    (".norm_added_k.", ".norm_k_img."),
)
ANIMATE2_TINY = dict(
    in_dim=12, dim=32, ffn_dim=64, freq_dim=16, text_dim=24, out_dim=4, num_heads=2, num_layers=2
)


def animate2_original(key: str) -> str:
    """A live WanAnimate2 state-dict key as the official checkpoint writes it (the test's own inverse)."""
    if key.startswith("blocks."):
        n, rest = key.split(".", 2)[1:]
        key = f"blocks.{n}.block.{rest}"
        for new, old in _A2_ATTN:
            key = key.replace(new, old)
    return key


def animate2_state(model) -> dict[str, torch.Tensor]:
    return {animate2_original(k): v for k, v in model.state_dict().items()}


def _convert2(sd: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers

    return convert_wan_animate_2_transformer_to_diffusers(
        {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    )


def _animate2(meta: bool, **config):
    return _build(meta, config, "WanAnimate2Transformer3DModel")


def test_animate2_original_names_full_size():
    model = _animate2(True)
    state = model.state_dict()
    converted = _convert2(animate2_state(model))
    assert set(converted) == set(state)  # the inverse is the converter's
    assert "blocks.39.block.cross_attn.k_img.weight" in animate2_state(model)
    assert assert_resolves_as_the_converter_says(model, animate2_state, _convert2) == len(state)
    modules = linears(model)
    for name in (
        lambda n: "diffusion_model." + animate2_original(f"{n}.weight").removesuffix(".weight"),
        lambda n: "lora_unet_" + animate2_original(f"{n}.weight").removesuffix(".weight").replace(".", "_"),
    ):
        report = loraweave.plan(model, lora_file(modules, name, meta=True))
        assert report.unmatched == [] and report.keys_applied == report.keys_total == 2 * len(modules)


def test_animate2_matches_diffusers_converter_and_peft():
    model = _animate2(False, **ANIMATE2_TINY)
    sd = lora_file(
        linears(model),
        lambda n: "diffusion_model." + animate2_original(f"{n}.weight").removesuffix(".weight"),
    )
    assert any(".block.cross_attn.k_img." in k for k in sd)
    converted = {
        f"transformer.{k}": v
        for k, v in _convert2({k.removeprefix("diffusion_model."): v for k, v in sd.items()}).items()
    }
    assert_matches_peft(model, sd, converted)


def test_animate2_swapped_rename_is_caught(monkeypatch):
    def swap(t):
        table = {".self_attn.q.": ".self_attn.to_k.", ".self_attn.k.": ".self_attn.to_q."}
        return dataclasses.replace(t, renames=tuple((o, table.get(o, n)) for o, n in t.renames))

    patch_tables(monkeypatch, lambda t: swap(t) if t.name == "wan-animate-2" else t)
    with pytest.raises(AssertionError, match="self_attn"):
        assert_resolves_as_the_converter_says(_animate2(True, num_layers=2), animate2_state, _convert2)
