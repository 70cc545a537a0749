"""Nunchaku's own module names: every key of the real Z-Image, Qwen-Image and Flux key lists lands on
Nunchaku's real transformers (full size, on meta), on the modules and rows Nunchaku's forward reads: Flux's
single-block `proj_out`, which Nunchaku splits by input columns into `attn.to_out` + `mlp_fc2`, lands on both
with its columns; the AWQ modulation, whose rows Nunchaku interleaves per hidden unit, with its rows gathered
into that order. A family that cannot be split or reordered so is refused, naming why, never put on the
wrong rows.

Nunchaku fuses q/k/v into `to_qkv` (rows q | k | v) and the context q/k/v into `add_qkv_proj`; Z-Image's
SwiGLU is diffusers' `net.0.proj` with rows [w3; w1] (value, then gate: diffusers' SwiGLU computes
`value * silu(gate)` from `proj(x).chunk(2)`), so w1 keys land on its second half. A `w13` file ([w1; w3])
lands crosswise."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REALDATA
from helpers.nunchaku_models import meta_model, nunchaku_class

import loraweave
from loraweave.arch.aliases import AliasTable
from loraweave.arch.fit import module_arch
from loraweave.arch.spec import Piece
from loraweave.errors import WrongArchitectureError

KEYS = REALDATA / "keys"
FLUX_LISTS = (
    "flux_lora_kohya_format.json",
    "flux_lora_diffusers_format.json",
    "flux_lora_aitoolkit_format.json",
    "flux_lora_diffusers_base_model_format.json",
    "flux_lora_diffusers_with_norm_out_format.json",
)
# Keys that name Nunchaku Flux's interleaved (AWQ modulation) layers, in every spelling of the lists above.
FLUX_MODULATION = re.compile(
    r"single_blocks[._]\d+[._]modulation[._]lin|single_transformer_blocks\.\d+\.norm\.linear"
    r"|double_blocks[._]\d+[._](img|txt)[._]mod[._]lin|transformer_blocks\.\d+\.norm1(_context)?\.linear"
)
# Keys of the single block's proj_out (BFL linear2), which Nunchaku splits by input columns.
FLUX_SPLIT = re.compile(r"single_blocks[._]\d+[._]linear2|single_transformer_blocks\.\d+\.proj_out")


@pytest.fixture(scope="module")
def models(realdata):
    return {arch: meta_model(arch) for arch in ("z-image", "qwen-image", "flux")}


def _invoke_keys(name: str) -> dict[str, torch.Tensor]:
    keys = json.loads((KEYS / "invokeai" / name).read_text())["keys"]
    return {k: torch.empty(shape, device="meta") for k, shape in keys.items()}


def _lora(stems: dict[str, tuple[int, int]], rank: int = 4) -> dict[str, torch.Tensor]:
    """A meta LoRA: {stem: (out, in)} -> lora_A/lora_B keys (`lora_down`/`lora_up` for kohya stems)."""
    sd = {}
    for stem, (n, k) in stems.items():
        down, up = ("lora_down", "lora_up") if stem.startswith("lora_unet_") else ("lora_A", "lora_B")
        sd[f"{stem}.{down}.weight"] = torch.empty(rank, k, device="meta")
        sd[f"{stem}.{up}.weight"] = torch.empty(n, rank, device="meta")
    return sd


def test_the_models_are_nunchakus_own(models):
    """The modules the tables name are Nunchaku's quantized classes at the released widths."""
    z, q, f = models["z-image"], models["qwen-image"], models["flux"]
    assert type(z.get_submodule("layers.29.attention.to_qkv")).__name__ == "SVDQW4A4Linear"
    assert z.get_submodule("layers.0.feed_forward.net.0.proj").out_features == 2 * 10240
    assert type(z.get_submodule("layers.0.feed_forward.net.0")).__name__ == "SwiGLU"
    assert type(q.get_submodule("transformer_blocks.59.attn.add_qkv_proj")).__name__ == "SVDQW4A4Linear"
    assert type(q.get_submodule("transformer_blocks.0.img_mod.1")).__name__ == "AWQW4A16Linear"
    assert type(f.get_submodule("single_transformer_blocks.37.mlp_fc2")).__name__ == "SVDQW4A4Linear"
    assert f.get_submodule("single_transformer_blocks.0.attn.to_out").in_features == 3072


def test_zimage_comfy_checkpoint_names_land(models):
    """A LoRA on every 2-D weight of the real Z-Image ComfyUI checkpoint subset (fused `qkv`, `out`, w1/w2/w3,
    refiners, embedders) lands on Nunchaku's Z-Image, every key."""
    keys = json.loads(
        (KEYS / "invokeai" / "z_image_transformer_comfyui_keys__base_model_subset.json").read_text()
    )
    stems = {
        "diffusion_model." + k.removesuffix(".weight"): tuple(s)
        for k, s in keys["keys"].items()
        if k.endswith(".weight") and len(s) == 2
    }
    report = loraweave.plan(models["z-image"], _lora(stems))
    assert report.unmatched == []
    assert report.keys_applied == report.keys_total == 2 * len(stems) > 40
    layer0 = {m.module for m in report.applied if m.module.startswith("layers.0.")}
    assert layer0 == {
        "layers.0.attention.to_qkv",
        "layers.0.attention.to_out.0",
        "layers.0.feed_forward.net.0.proj",
        "layers.0.feed_forward.net.2",
        "layers.0.adaLN_modulation.0",
    }


def _rows(pieces) -> list[tuple[str, int, int, int]]:
    return [(p.module, p.src_start, p.dst_start, p.length) for p in pieces]


@pytest.mark.parametrize("stack", ["layers.29", "noise_refiner.1", "context_refiner.0"])
def test_zimage_fused_rows(models, stack):
    """Each spelling lands on the rows Nunchaku's forward reads: q | k | v thirds of `to_qkv`; w3 on the
    SwiGLU's first (value) half, w1 on its second (gate) half; a `w13` file crosswise."""
    table = AliasTable(models["z-image"])
    d, h = 3840, 10240
    att, ff = f"{stack}.attention", f"{stack}.feed_forward"
    for n, p in enumerate("qkv"):
        expected = [(f"{att}.to_qkv", 0, n * d, d)]
        assert _rows(table.lookup(f"{att}.to_{p}")) == expected
        assert _rows(table.lookup(f"lora_unet_{att}.to_{p}".replace(".", "_")[10:])) == expected
    assert _rows(table.lookup(f"{att}.qkv")) == [(f"{att}.to_qkv", 0, 0, 3 * d)]
    assert _rows(table.lookup(f"{att}.out")) == [(f"{att}.to_out.0", 0, 0, d)]
    proj = f"{ff}.net.0.proj"
    assert _rows(table.lookup(f"{ff}.w3")) == [(proj, 0, 0, h)]
    assert _rows(table.lookup(f"{ff}.w1")) == [(proj, 0, h, h)]
    assert _rows(table.lookup(f"{ff}.w13")) == [(proj, 0, h, h), (proj, h, 0, h)]
    assert _rows(table.lookup(proj)) == [(proj, 0, 0, 2 * h)]
    assert _rows(table.lookup(f"{ff}.w2")) == [(f"{ff}.net.2", 0, 0, d)]


def test_zimage_spellings_from_users_files(models):
    """The spellings users' Z-Image files carry (realdata keys/naming_variants_from_issues.md: musubi kohya,
    PEFT `diffusion_model.`, legacy fused `qkv` with dotted `lora.down`) on every block, plus original
    w1/w2/w3 and fused `w13` / `net.0.proj`: every key lands."""
    d, h = 3840, 10240
    sd: dict[str, torch.Tensor] = {}
    for i in range(30):
        att, ff = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        kohya = {f"lora_unet_{att}.to_{p}".replace(".", "_"): (d, d) for p in "qkv"}
        kohya[f"lora_unet_{att}.to_out.0".replace(".", "_")] = (d, d)
        peft = {f"diffusion_model.{att}.to_{p}": (d, d) for p in ("q", "k", "v", "out.0")}
        ffn = {f"diffusion_model.{ff}.{w}": (h, d) for w in ("w1", "w3")}
        ffn[f"diffusion_model.{ff}.w2"] = (d, h)
        sd.update(_lora({**kohya, **peft, **ffn}))
        # legacy fused qkv, dotted: `layers.6.attention.qkv.lora.down.weight` + `.alpha`
        sd[f"{att}.qkv.lora.down.weight"] = torch.empty(4, d, device="meta")
        sd[f"{att}.qkv.lora.up.weight"] = torch.empty(3 * d, 4, device="meta")
        sd[f"{att}.qkv.alpha"] = torch.empty((), device="meta")
    fused = {
        "transformer.layers.0.feed_forward.w13": (2 * h, d),
        "transformer.layers.1.feed_forward.net.0.proj": (2 * h, d),
    }
    for name, adapter in (("users", sd), ("fused", _lora(fused))):
        report = loraweave.plan(models["z-image"], adapter)
        assert report.unmatched == [], (name, report.unmatched[:2])
        assert report.keys_applied == report.keys_total == len(adapter)


def test_qwen_image_key_list_lands_on_fused_qkv(models):
    report = loraweave.plan(models["qwen-image"], _invoke_keys("qwen_image_lora_diffusers_format.json"))
    assert report.unmatched == [] and report.keys_applied == report.keys_total == 9
    assert {m.module for m in report.applied} == {f"transformer_blocks.{i}.attn.to_qkv" for i in (0, 1)}


def test_qwen_image_every_diffusers_layer(models):
    """A LoRA on every Linear of the diffusers Qwen-Image (released config) lands on Nunchaku's, fused
    projections on their thirds, the AWQ modulation (`img_mod.1` / `txt_mod.1`) whole (rows gathered)."""
    import diffusers
    from helpers.common import real_config

    with torch.device("meta"):
        ref = diffusers.QwenImageTransformer2DModel.from_config(
            real_config("qwen-image__transformer_config.json")
        )
    stems = {n: tuple(m.weight.shape) for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)}
    sd = _lora(stems)
    report = loraweave.plan(models["qwen-image"], sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)
    mods = {m.module for m in report.applied if re.search(r"\.(img|txt)_mod\.1$", m.module)}
    assert len(mods) == 120
    table = AliasTable(models["qwen-image"])
    for n, p in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
        found = table.lookup(f"transformer_blocks.7.attn.{p}")
        assert found == (Piece("transformer_blocks.7.attn.add_qkv_proj", 0, n * 3072, 3072, False),)


@pytest.mark.parametrize("name", FLUX_LISTS)
def test_flux_key_lists(models, name):
    """Every key of InvokeAI's real Flux key lists lands on Nunchaku's Flux v2: the single block's `proj_out`
    (BFL `linear2`) on both modules Nunchaku splits it into by input columns, the AWQ modulation whole."""
    sd = _invoke_keys(name)
    report = loraweave.plan(models["flux"], sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd) > 400
    modulation = {
        m.module for m in report.applied if re.search(r"norm1(_context)?\.linear|norm\.linear", m.module)
    }
    assert len(modulation) == len(
        {re.sub(r"\.(lora|alpha).*", "", k) for k in sd if FLUX_MODULATION.search(k)}
    )
    landed = re.compile(r"single_transformer_blocks\.\d+\.(attn\.to_out|mlp_fc2)$")
    split = {m.module for m in report.applied if landed.search(m.module)}
    blocks = {re.search(r"single_[a-z_]*blocks[._](\d+)", k)[1] for k in sd if FLUX_SPLIT.search(k)}
    want = {f"single_transformer_blocks.{i}.{m}" for i in blocks for m in ("attn.to_out", "mlp_fc2")}
    assert split == want and len(blocks) >= 1, (name, sorted(split)[:4])


def test_flux_fused_rows(models):
    table = AliasTable(models["flux"])
    d, s = "transformer_blocks.3", "single_transformer_blocks.20"
    assert _rows(table.lookup("double_blocks.3.img_attn.qkv")) == [(f"{d}.attn.to_qkv", 0, 0, 9216)]
    assert _rows(table.lookup("double_blocks.3.txt_attn.qkv")) == [(f"{d}.attn.add_qkv_proj", 0, 0, 9216)]
    assert _rows(table.lookup("single_blocks.20.linear1")) == [
        (f"{s}.attn.to_qkv", 0, 0, 9216),
        (f"{s}.mlp_fc1", 9216, 0, 12288),
    ]
    assert _rows(table.lookup(f"{s}.attn.to_v")) == [(f"{s}.attn.to_qkv", 0, 6144, 3072)]
    assert _rows(table.lookup(f"{d}.attn.add_k_proj")) == [(f"{d}.attn.add_qkv_proj", 0, 3072, 3072)]
    assert _rows(table.lookup(f"{s}.proj_mlp")) == [(f"{s}.mlp_fc1", 0, 0, 12288)]
    assert _rows(table.lookup(f"{d}.ff.net.0.proj")) == [(f"{d}.ff.net.0.proj", 0, 0, 12288)]


def test_model_arch_of_nunchaku_classes(models):
    """The wrong-architecture check knows Nunchaku's classes: each is its architecture's model."""
    assert {a: module_arch(m).name for a, m in models.items()} == {a: a for a in models}
    assert nunchaku_class("z-image").__name__ == "NunchakuZImageTransformer2DModel"


def test_wrong_architecture_refused_on_nunchaku(models):
    """A Flux file on Nunchaku's Z-Image is another architecture's: refused before anything changes."""
    flux_file = REALDATA / "lora" / "leighwoods__public-loras__lora.safetensors"
    with pytest.raises(WrongArchitectureError):
        loraweave.apply(models["z-image"], flux_file)
    # On Nunchaku's Flux it is Flux's own: its 4 layers, single-block proj_out, land on to_out + mlp_fc2.
    report = loraweave.plan(models["flux"], flux_file)
    assert report.unmatched == [] and report.keys_applied == report.keys_total > 0
    assert {m.module.rsplit(".", 1)[-1] for m in report.applied} == {"to_out", "mlp_fc2"}


U = 2.0**-8  # bf16 unit roundoff
_SINGLE = "single_transformer_blocks.0"


def _split_lora(seed: int, rank: int = 4, alpha: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, 1280, generator=g) * 0.3, torch.randn(256, rank, generator=g) * 0.3, alpha / rank


@pytest.mark.parametrize("stem", ["single_blocks.0.linear2", f"transformer.{_SINGLE}.proj_out"])
def test_flux_proj_out_lora_splits_exactly_by_columns(stem):
    """A LoRA on the single block's proj_out (ΔW = s·B·A over [attention 256 | MLP 1024] input columns, the
    order diffusers' `proj_out(cat([attn, mlp]))` and Nunchaku's `attn.to_out` / `mlp_fc2` read) lands as
    (A[:, :256], sB) on to_out and (A[:, 256:], sB) on mlp_fc2, each in its layer's appended low-rank tiles,
    so Nunchaku's `attn_output + mlp_output` gains x·(sBA)ᵀ: the term the same file merges into the float
    Flux's proj_out.

    Bound per layer (tests/test_nunchaku_backend.py): |Δout − x_p·(A₁₆ B₁₆)ᵀ| ≤ u·(|base| + |out|) +
    u·|x_p·A₁₆ᵀ|·|B₁₆|ᵀ, and that stored term is the fp64 one within 2u·(|x_p|·|A_p|ᵀ)·|sB|ᵀ; summed over
    the two layers."""
    from helpers import nunchaku_cpu as nc
    from helpers.nunchaku_models import tiny_float_flux, tiny_nunchaku_flux

    float_model = tiny_float_flux()
    model = tiny_nunchaku_flux(float_model)
    down, up, scale = _split_lora(seed=3)
    key_a, key_b = ("lora_down", "lora_up") if "linear2" in stem else ("lora_A", "lora_B")
    sd = {f"{stem}.{key_a}.weight": down, f"{stem}.{key_b}.weight": up, f"{stem}.alpha": torch.tensor(2.0)}
    # The float reference: the same file merged into the float Flux's proj_out.
    float_before = float_model.get_submodule(f"{_SINGLE}.proj_out").weight.detach().double().clone()
    with loraweave.apply(float_model, sd, mode="merge", strict=True):
        float_delta = float_model.get_submodule(f"{_SINGLE}.proj_out").weight.detach().double() - float_before
    exact_delta = scale * up.double() @ down.double()
    assert torch.allclose(
        float_delta, exact_delta, rtol=0, atol=4 * 2.0**-24 * float(float_before.abs().max())
    )

    layers = {"attn.to_out": slice(0, 256), "mlp_fc2": slice(256, 1280)}
    x = torch.randn(1, 9, 1280, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        base = {n: model.get_submodule(f"{_SINGLE}.{n}")(x[..., cols]) for n, cols in layers.items()}
    before = nc.storage(model)
    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    rows = {a.module: a.mechanism for a in handle.report.applied}
    assert rows == {f"{_SINGLE}.{n}": "factor" for n in layers}
    with torch.no_grad():
        got = {n: model.get_submodule(f"{_SINGLE}.{n}")(x[..., cols]) for n, cols in layers.items()}
    xd, err, bound = x.double(), 0.0, 0.0
    for name, cols in layers.items():
        layer = model.get_submodule(f"{_SINGLE}.{name}")
        got_down = nc.unpack_lowrank(layer.proj_down.detach(), down=True)
        got_up = nc.unpack_lowrank(layer.proj_up.detach(), down=False)
        assert torch.equal(got_down[32:36], down[:, cols].to(torch.bfloat16))
        assert torch.equal(got_up[:, 32:36], (up * scale).to(torch.bfloat16))
        a16, b16 = down[:, cols].to(torch.bfloat16).double(), (up * scale).to(torch.bfloat16).double()
        xp = xd[..., cols]
        err = err + (got[name].double() - base[name].double())
        bound = bound + U * (base[name].double().abs() + got[name].double().abs())
        bound = bound + U * (xp @ a16.T).abs() @ b16.abs().T
        bound = bound + 2.01 * U * (xp.abs() @ down[:, cols].double().abs().T) @ (scale * up.double()).abs().T
    term = xd @ float_delta.T  # the float Flux proj_out's gain on cat([attn, mlp]) = x
    assert ((err - term).abs() <= bound + 1e-6).all(), float(((err - term).abs() / (bound + 1e-6)).max())
    assert float((term.abs() > bound + 1e-6).double().mean()) > 0.5  # the bound cannot hide the term
    handle.remove()
    nc.assert_storage(model, before)


@pytest.mark.parametrize("family", ["dora", "lokr", "oft"])
def test_flux_proj_out_split_refuses_families_that_do_not_split(family):
    """DoRA and OFT act on the layer's output (a norm or rotation of the whole proj_out), LoKr's Kronecker
    factors do not split by columns: refused as unsupported, naming the split, the model's bytes unchanged."""
    from helpers import nunchaku_cpu as nc
    from helpers.nunchaku_models import tiny_float_flux, tiny_nunchaku_flux

    from loraweave.errors import NoKeysLandedError

    model = tiny_nunchaku_flux(tiny_float_flux())
    g, stem = torch.Generator().manual_seed(5), f"{_SINGLE}.proj_out"
    sd = {
        "dora": {
            f"{stem}.lora_down.weight": torch.randn(4, 1280, generator=g),
            f"{stem}.lora_up.weight": torch.randn(256, 4, generator=g),
            f"{stem}.dora_scale": torch.rand(256, 1, generator=g) + 1,
        },
        "lokr": {f"{stem}.lokr_w1": torch.randn(4, 8, generator=g), f"{stem}.lokr_w2": torch.randn(64, 160)},
        "oft": {
            f"{stem}.oft_blocks": torch.randn(8, 32, 32, generator=g) * 0.1,
            f"{stem}.alpha": torch.tensor(0.0),
        },
    }[family]
    report = loraweave.plan(model, sd)
    assert report.keys_applied == 0 and {u["kind"] for u in report.unmatched} == {"unsupported"}
    assert all(
        "does not split by columns" in u["reason"] and "mlp_fc2" in u["reason"] for u in report.unmatched
    )
    before = nc.storage(model)
    with pytest.raises(NoKeysLandedError):
        loraweave.apply(model, sd)
    nc.assert_storage(model, before)


@pytest.mark.parametrize(
    ("stem", "module", "chunks"),
    [
        ("single_blocks.0.modulation.lin", f"{_SINGLE}.norm.linear", 3),
        ("double_blocks.0.txt_mod.lin", "transformer_blocks.0.norm1_context.linear", 6),
        ("transformer.transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1.linear", 6),
    ],
)
@pytest.mark.parametrize("family", ["lora", "full"])
def test_flux_modulation_lands_in_nunchakus_interleaved_rows(stem, module, chunks, family):
    """A delta on the AWQ modulation, in the file's row order (chunk c, unit d at row c·dim + d), lands with
    its rows gathered into Nunchaku's (d·chunks + c), so the shift/scale/gate chunks Nunchaku's forward reads
    (`out.view(-1, chunks).permute`) gain what the same file merged into the float Flux's layer gives each
    chunk. Bound (a runtime term on the AWQ base, tests/test_nunchaku_backend.py):
    |Δchunk − x·ΔW_cᵀ| ≤ 8u·(|base| + |out|) + 4u·|x|·|ΔW_c|ᵀ; a delta left in file order misses it."""
    from helpers import nunchaku_cpu as nc
    from helpers.nunchaku_models import tiny_float_flux, tiny_nunchaku_flux

    float_model = tiny_float_flux()
    model = tiny_nunchaku_flux(float_model)
    rows = float_model.get_submodule(module).weight.shape[0]
    g = torch.Generator().manual_seed(21)
    if family == "lora":
        a, b = torch.randn(4, 256, generator=g) * 0.3, torch.randn(rows, 4, generator=g) * 0.3
        key_a, key_b = ("lora_down", "lora_up") if "_blocks." in stem[:14] else ("lora_A", "lora_B")
        sd = {f"{stem}.{key_a}.weight": a, f"{stem}.{key_b}.weight": b}
    else:
        sd = {f"{stem}.diff": torch.randn(rows, 256, generator=g) * 0.05}
        sd[f"{stem}.diff_b"] = torch.randn(rows, generator=g) * 0.05
    float_layer = float_model.get_submodule(module)
    w0, b0 = float_layer.weight.detach().double().clone(), float_layer.bias.detach().double().clone()
    with loraweave.apply(float_model, sd, mode="merge", strict=True):
        d_w = float_layer.weight.detach().double() - w0
        d_b = float_layer.bias.detach().double() - b0
    assert d_w.abs().max() > 0

    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    layer = model.get_submodule(module)
    with torch.no_grad():
        base = layer(x).double()
    before = nc.storage(model)
    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    assert [a.module for a in handle.report.applied] == [module]
    with torch.no_grad():
        got = model.get_submodule(module)(x).double()

    def chunked(t: torch.Tensor) -> torch.Tensor:  # Nunchaku's forward: view(-1, chunks).permute(2, 0, 1)
        return t.view(t.shape[0], -1, chunks).permute(2, 0, 1)

    xd = x.double()
    term = (xd @ d_w.T + d_b).view(x.shape[0], chunks, -1).transpose(0, 1)  # diffusers' chunk(chunks)
    bound = 8 * U * chunked(base.abs() + got.abs()) + 4 * U * (xd.abs() @ d_w.abs().T).view(
        3, chunks, -1
    ).transpose(0, 1)
    err = (chunked(got - base) - term).abs()
    assert (err <= bound + 1e-6).all(), float((err / (bound + 1e-6)).max())
    file_order = (got - base).view(x.shape[0], chunks, -1).transpose(0, 1)  # the rows not gathered
    assert float(((file_order - term).abs() > bound + 1e-6).double().mean()) > 0.5
    handle.remove()
    nc.assert_storage(model, before)


@pytest.mark.parametrize("family", ["dora", "lokr"])
def test_flux_modulation_refuses_families_whose_rows_do_not_reorder(family):
    from helpers import nunchaku_cpu as nc
    from helpers.nunchaku_models import tiny_float_flux, tiny_nunchaku_flux

    model = tiny_nunchaku_flux(tiny_float_flux())
    g, stem = torch.Generator().manual_seed(5), f"{_SINGLE}.norm.linear"
    sd = {
        "dora": {
            f"{stem}.lora_down.weight": torch.randn(4, 256, generator=g),
            f"{stem}.lora_up.weight": torch.randn(768, 4, generator=g),
            f"{stem}.dora_scale": torch.rand(768, 1, generator=g) + 1,
        },
        "lokr": {f"{stem}.lokr_w1": torch.randn(4, 8, generator=g), f"{stem}.lokr_w2": torch.randn(192, 32)},
    }[family]
    report = loraweave.plan(model, sd)
    assert report.keys_applied == 0 and {u["kind"] for u in report.unmatched} == {"unsupported"}
    assert all("interleaves" in u["reason"] and "do not reorder" in u["reason"] for u in report.unmatched)
    before = nc.storage(model)
    with pytest.raises(loraweave.errors.NoKeysLandedError):
        loraweave.apply(model, sd)
    nc.assert_storage(model, before)
