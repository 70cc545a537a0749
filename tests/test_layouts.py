"""One LoRA, many spellings: kohya and original/ComfyUI renames land exactly like the diffusers layout,
and fused original keys land on exactly the right rows (reference built by slicing by hand).

Tolerances: unfused renames are bit-identical; fused renames rel. error <= 1e-6 (fp32, the fused product
sums over extra zero blocks)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.peft_lora import make_peft_lora, rel_err
from helpers.tiny_models import tiny_flux, tiny_zimage
from safetensors.torch import load_file

import loraweave
from loraweave.arch.unet_original import unet_original_names

FUSED_TOL = 1e-6


def _flux_original(i_d: int, i_s: int) -> dict[str, tuple[str, ...]]:
    """Hand-written BFL name -> diffusers modules (rows top to bottom) for double block i_d, single block
    i_s."""
    d, s = f"transformer_blocks.{i_d}", f"single_transformer_blocks.{i_s}"
    return {
        f"double_blocks.{i_d}.img_attn.qkv": (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"),
        f"double_blocks.{i_d}.txt_attn.qkv": (
            f"{d}.attn.add_q_proj",
            f"{d}.attn.add_k_proj",
            f"{d}.attn.add_v_proj",
        ),
        f"double_blocks.{i_d}.img_attn.proj": (f"{d}.attn.to_out.0",),
        f"double_blocks.{i_d}.txt_attn.proj": (f"{d}.attn.to_add_out",),
        f"double_blocks.{i_d}.img_mlp.0": (f"{d}.ff.net.0.proj",),
        f"double_blocks.{i_d}.img_mlp.2": (f"{d}.ff.net.2",),
        f"double_blocks.{i_d}.txt_mlp.0": (f"{d}.ff_context.net.0.proj",),
        f"double_blocks.{i_d}.txt_mlp.2": (f"{d}.ff_context.net.2",),
        f"double_blocks.{i_d}.img_mod.lin": (f"{d}.norm1.linear",),
        f"double_blocks.{i_d}.txt_mod.lin": (f"{d}.norm1_context.linear",),
        f"single_blocks.{i_s}.linear1": (
            f"{s}.attn.to_q",
            f"{s}.attn.to_k",
            f"{s}.attn.to_v",
            f"{s}.proj_mlp",
        ),
        f"single_blocks.{i_s}.linear2": (f"{s}.proj_out",),
        f"single_blocks.{i_s}.modulation.lin": (f"{s}.norm.linear",),
    }


FLUX_GLOBAL = {
    "img_in": ("x_embedder",),
    "txt_in": ("context_embedder",),
    "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
    "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
    "guidance_in.in_layer": ("time_text_embed.guidance_embedder.linear_1",),
    "guidance_in.out_layer": ("time_text_embed.guidance_embedder.linear_2",),
    "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
    "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
    "final_layer.linear": ("proj_out",),
    "final_layer.adaLN_modulation.1": ("norm_out.linear",),  # rows swapped: see _swap_halves
}
SWAPPED = {"final_layer.adaLN_modulation.1"}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    h = t.shape[0] // 2
    return torch.cat([t[h:], t[:h]])


def _zimage_original(stack: str, i: int) -> dict[str, tuple[str, ...]]:
    b = f"{stack}.{i}.attention"
    return {f"{b}.qkv": (f"{b}.to_q", f"{b}.to_k", f"{b}.to_v"), f"{b}.out": (f"{b}.to_out.0",)}


def _peft_parts(path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """{diffusers module: (A, B)} and the per-module γ PEFT uses (alpha_pattern to_k=2 else 8, r=4)."""
    sd = load_file(path)
    parts = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            mod = key.split(".", 1)[1].removesuffix(".lora_A.weight")
            parts[mod] = (sd[key], sd[key.replace("lora_A", "lora_B")])
    gamma = {m: (2.0 if m.endswith("to_k") else 8.0) / 4 for m in parts}
    return parts, gamma


def rename(parts, gamma, original: dict[str, tuple[str, ...]], layout: str) -> dict[str, torch.Tensor]:
    """Write the LoRA under original names; fused groups get stacked downs and a block-diagonal up with γ
    folded in."""
    out, used = {}, set()
    for name, targets in {**original, **{m: (m,) for m in parts}}.items():
        if any(t in used or t not in parts for t in targets):
            continue
        used.update(targets)
        if len(targets) == 1:
            down, up = parts[targets[0]]
            alpha = gamma[targets[0]] * down.shape[0]
            up = _swap_halves(up) if name in SWAPPED else up
        else:
            down = torch.cat([parts[t][0] for t in targets])
            up = torch.block_diag(*[parts[t][1] * gamma[t] for t in targets])
            alpha = float(down.shape[0])
        stem = "lora_unet_" + name.replace(".", "_") if layout == "kohya" else f"diffusion_model.{name}"
        out[f"{stem}.lora_down.weight"] = down.contiguous()
        out[f"{stem}.lora_up.weight"] = up.contiguous()
        out[f"{stem}.alpha"] = torch.tensor(alpha)
    return out


def _original_map(arch: str, model) -> dict[str, tuple[str, ...]]:
    if arch == "flux":
        return {**_flux_original(0, 0), **_flux_original(1, 1), **FLUX_GLOBAL}
    if arch == "zimage":
        names = {}
        for stack, n in (("layers", 2), ("noise_refiner", 1), ("context_refiner", 1)):
            for i in range(n):
                names.update(_zimage_original(stack, i))
        return names
    return {orig: (diff,) for orig, diff in unet_original_names(model).items()}


@pytest.mark.parametrize("arch", ["flux", "zimage", "sdxl_unet"])
@pytest.mark.parametrize("layout", ["kohya", "comfyui"])
def test_renamed_lora_merges_identically(arch, layout, tmp_path):
    base, _, path, _ = make_peft_lora(arch, tmp_path)
    ref_model = copy.deepcopy(base)
    loraweave.apply(ref_model, path, mode="merge", strict=True)
    parts, gamma = _peft_parts(path)
    renamed = rename(parts, gamma, _original_map(arch, base), layout)
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, renamed, mode="merge", strict=True)
    assert handle.report.keys_applied == len(renamed)
    fused = any(len(t) > 1 for t in _original_map(arch, base).values())
    ref = ref_model.state_dict()
    for name, tensor in model.state_dict().items():
        if fused:
            assert rel_err(tensor, ref[name]) <= FUSED_TOL, name
        else:
            assert torch.equal(tensor, ref[name]), name


def _random_lora(out_rows: int, in_dim: int, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, in_dim, generator=g), torch.randn(out_rows, rank, generator=g)


def test_flux_fused_rows_land_on_the_right_rows():
    base = tiny_flux()
    w = {n: m.weight.detach().clone() for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    h, mlp = 32, 128
    cases = {
        "double_blocks.1.img_attn.qkv": _random_lora(3 * h, h, 4, 1),
        "double_blocks.0.txt_attn.qkv": _random_lora(3 * h, h, 4, 2),
        "single_blocks.1.linear1": _random_lora(3 * h + mlp, h, 4, 3),
        "final_layer.adaLN_modulation.1": _random_lora(2 * h, h, 4, 4),
    }
    sd = {}
    for name, (down, up) in cases.items():
        sd[f"lora_unet_{name.replace('.', '_')}.lora_down.weight"] = down
        sd[f"lora_unet_{name.replace('.', '_')}.lora_up.weight"] = up
        sd[f"lora_unet_{name.replace('.', '_')}.alpha"] = torch.tensor(2.0)
    model = copy.deepcopy(base)
    loraweave.apply(model, sd, mode="merge", strength=0.7, strict=True)
    coeff = 0.7 * 2.0 / 4

    def delta(name, rows):
        down, up = cases[name]
        return coeff * up[rows] @ down

    expect = {
        "transformer_blocks.1.attn.to_q": delta("double_blocks.1.img_attn.qkv", slice(0, h)),
        "transformer_blocks.1.attn.to_k": delta("double_blocks.1.img_attn.qkv", slice(h, 2 * h)),
        "transformer_blocks.1.attn.to_v": delta("double_blocks.1.img_attn.qkv", slice(2 * h, 3 * h)),
        "transformer_blocks.0.attn.add_q_proj": delta("double_blocks.0.txt_attn.qkv", slice(0, h)),
        "transformer_blocks.0.attn.add_k_proj": delta("double_blocks.0.txt_attn.qkv", slice(h, 2 * h)),
        "transformer_blocks.0.attn.add_v_proj": delta("double_blocks.0.txt_attn.qkv", slice(2 * h, 3 * h)),
        "single_transformer_blocks.1.attn.to_q": delta("single_blocks.1.linear1", slice(0, h)),
        "single_transformer_blocks.1.attn.to_k": delta("single_blocks.1.linear1", slice(h, 2 * h)),
        "single_transformer_blocks.1.attn.to_v": delta("single_blocks.1.linear1", slice(2 * h, 3 * h)),
        "single_transformer_blocks.1.proj_mlp": delta("single_blocks.1.linear1", slice(3 * h, 3 * h + mlp)),
        # BFL (shift, scale) -> diffusers (scale, shift)
        "norm_out.linear": torch.cat(
            [
                delta("final_layer.adaLN_modulation.1", slice(h, 2 * h)),
                delta("final_layer.adaLN_modulation.1", slice(0, h)),
            ]
        ),
    }
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            want = w[name] + expect[name] if name in expect else w[name]
            assert rel_err(mod.weight, want) <= 1e-6, name


def test_zimage_fused_qkv_and_out_land_on_the_right_rows():
    base = tiny_zimage()
    h = 64
    cases = {
        "layers.1.attention.qkv": _random_lora(3 * h, h, 8, 5),
        "noise_refiner.0.attention.qkv": _random_lora(3 * h, h, 8, 6),
        "layers.0.attention.out": _random_lora(h, h, 8, 7),
    }
    sd = {}
    for name, (down, up) in cases.items():
        sd[f"diffusion_model.{name}.lora_A.weight"] = down
        sd[f"diffusion_model.{name}.lora_B.weight"] = up
    merged, runtime = copy.deepcopy(base), copy.deepcopy(base)
    loraweave.apply(merged, sd, mode="merge", strict=True)
    handle = loraweave.apply(runtime, sd, mode="runtime", strict=True)
    expect = {}
    for stem in ("layers.1", "noise_refiner.0"):
        down, up = cases[f"{stem}.attention.qkv"]
        for i, proj in enumerate(("to_q", "to_k", "to_v")):
            expect[f"{stem}.attention.{proj}"] = up[i * h : (i + 1) * h] @ down  # no alpha anywhere: γ = 1
    down, up = cases["layers.0.attention.out"]
    expect["layers.0.attention.to_out.0"] = up @ down
    base_mods = dict(base.named_modules())
    for name, mod in merged.named_modules():
        if isinstance(mod, torch.nn.Linear):
            want = base_mods[name].weight + expect.get(name, 0)
            assert rel_err(mod.weight, want) <= 1e-6, name
    assert {m.module for m in handle.report.applied} == set(expect)
    x = torch.randn(5, h)
    runtime_mods = dict(runtime.named_modules())
    merged_mods = dict(merged.named_modules())
    with torch.no_grad():
        for name in expect:
            assert rel_err(runtime_mods[name](x), merged_mods[name](x)) <= 1e-5, name


def test_separate_qkv_keys_land_on_fused_projections():
    """After diffusers' fuse_qkv_projections() forward uses to_qkv: to_q/to_k/to_v keys must land on its
    rows."""
    base = tiny_flux()
    sd = {}
    g = torch.Generator().manual_seed(3)
    for stem in (
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_v",
        "transformer_blocks.1.attn.add_k_proj",
        "single_transformer_blocks.0.attn.to_k",
    ):
        sd[f"transformer.{stem}.lora_A.weight"] = torch.randn(4, 32, generator=g)
        sd[f"transformer.{stem}.lora_B.weight"] = torch.randn(32, 4, generator=g) * 0.1
    from helpers.tiny_models import flux_forward

    with torch.no_grad():
        reference = copy.deepcopy(base)
        loraweave.apply(reference, sd, mode="merge", strict=True)
        want = flux_forward(reference)
        for mode in ("merge", "runtime"):
            fused = copy.deepcopy(base)
            fused.fuse_qkv_projections()
            handle = loraweave.apply(fused, sd, mode=mode, strict=True)
            assert {m.module.rsplit(".", 1)[1] for m in handle.report.applied} <= {"to_qkv", "to_added_qkv"}
            assert rel_err(flux_forward(fused), want) <= 1e-5, mode


def test_flux_fill_widened_x_embedder_takes_a_base_lora():
    """Flux Fill/Kontext widen x_embedder's input; a LoRA trained on the base touches only the original
    columns."""
    from diffusers import FluxTransformer2DModel
    from helpers.tiny_models import tiny_flux

    torch.manual_seed(0)
    fill = FluxTransformer2DModel(
        patch_size=1,
        in_channels=40,
        out_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
    ).eval()
    base_in = tiny_flux().x_embedder.in_features
    g = torch.Generator().manual_seed(4)
    down, up = torch.randn(4, base_in, generator=g), torch.randn(32, 4, generator=g)
    sd = {
        "lora_unet_img_in.lora_down.weight": down,
        "lora_unet_img_in.lora_up.weight": up,
        "lora_unet_img_in.alpha": torch.tensor(4.0),
    }
    before = fill.x_embedder.weight.detach().clone()
    merged, runtime = copy.deepcopy(fill), copy.deepcopy(fill)
    handle = loraweave.apply(merged, sd, mode="merge", strict=True)
    assert any("zero-padded to 40" in n for n in handle.report.applied[0].notes)
    want = before.clone()
    want[:, :base_in] += up @ down
    assert rel_err(merged.x_embedder.weight, want) <= 1e-6
    assert torch.equal(merged.x_embedder.weight[:, base_in:], before[:, base_in:])
    loraweave.apply(runtime, sd, mode="runtime", strict=True)
    x = torch.randn(3, 40, generator=g)
    with torch.no_grad():
        assert rel_err(runtime.x_embedder(x), merged.x_embedder(x)) <= 1e-5
    # The other direction: a file wider than this variant's x_embedder (60 columns on its 40, 16 of them the
    # latents) was trained on inputs this model is not fed. Refused, never grown: a control adapter grows only
    # an input that takes the latents alone (test_control_lora.py).
    wide = {
        k: (v if not k.endswith("down.weight") else torch.randn(4, 60, generator=g)) for k, v in sd.items()
    }
    report = loraweave.plan(fill, wide)
    assert report.keys_applied == 0 and {u["kind"] for u in report.unmatched} == {"other_input"}
    with pytest.raises(loraweave.OtherInputError, match="lora_unet_img_in.lora_down.weight"):
        loraweave.apply(merged, wide, mode="merge")
    assert merged.x_embedder.in_features == 40
