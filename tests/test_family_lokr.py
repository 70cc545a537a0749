"""LoKr (lokr_*): merge and runtime against LyCORIS 4.x's own wrapped forward, fused targets, real files.

Reference = the LyCORIS-wrapped layer's forward (`merge_to` applies alpha/rank twice for LoKr), and for the
real (pre-4.x, flat conv layout) files LyCORIS's own `functional.lokr.diff_weight`.
Tolerances (rel. error = max|ours - ref| / max|ref|, fp32): <= 1e-5 on the layer outputs and on the adapter's
share of them (output - base output); merged weights against an fp64 reference <= 1e-6.
"""

from __future__ import annotations

import copy

import lycoris  # the reference must be installed: a missing package fails here, it is never skipped
import pytest
import torch
from conftest import REALDATA
from helpers.common import (
    check_fused_flux_qkv,
    gen,
    multiplier_outputs,
    outputs,
    randn_inputs,
    randomise,
    real_config,
    reason_prefixes,
    rel_err,
    save_lycoris,
    write_preset,
)
from helpers.family_models import lokr_sd
from lycoris.functional.lokr import diff_weight as lycoris_diff_weight
from safetensors import safe_open
from torch import nn

import loraweave
from loraweave.families import FAMILIES
from loraweave.families.base import PartRejected

TOL = 1e-5
MULTIPLIERS = (1.0, 0.5, -1.0)
LAYERS = ("lin", "blk.proj", "c1", "c2", "c3", "pw")
FALCON = [REALDATA / "lora" / f"KohakuBlueleaf__LyCORIS__smart_falcon_{n}_lokr.safetensors" for n in (4, 8)]


class Net(nn.Module):
    """Shapes chosen so LyCORIS's factorization decomposes w2 (and w1 with decompose_both) at these ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(128, 256)  # w1 (16, 8), w2 (16, 16)
        self.blk = nn.Module()
        self.blk.proj = nn.Linear(96, 64, bias=False)  # nested: key lycoris_blk_proj
        self.c1 = nn.Conv1d(48, 64, 3, padding=1)
        self.c2 = nn.Conv2d(64, 96, 3, stride=2, padding=1)
        self.c3 = nn.Conv3d(32, 48, 3, padding=1)
        self.pw = nn.Conv2d(64, 64, 1)  # 1x1: LyCORIS gives it the linear dim; w1 and w2 both full by default


def inputs() -> dict[str, torch.Tensor]:
    return randn_inputs(
        {
            "lin": (2, 3, 128),
            "blk.proj": (5, 96),
            "c1": (2, 48, 11),
            "c2": (2, 64, 9, 7),
            "c3": (1, 32, 5, 4, 6),
            "pw": (2, 64, 5, 5),
        }
    )


# (id, create_lycoris kwargs, rs_lora, expected factor keys somewhere in the file): alpha != rank everywhere.
BASE = {"linear_dim": 4, "linear_alpha": 3.0, "conv_dim": 2, "conv_alpha": 1.5}
OPTIONS = [
    ("default", {}, False, {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "lokr_w2"}),
    ("decompose_both", {"decompose_both": True}, False, {"lokr_w1_a", "lokr_w1_b", "lokr_w2_a"}),
    ("full_matrix", {"full_matrix": True}, False, {"lokr_w1", "lokr_w2"}),
    ("tucker", {"use_tucker": True}, False, {"lokr_t2", "lokr_w2_a", "lokr_w2_b"}),
    ("tucker_both", {"use_tucker": True, "decompose_both": True}, False, {"lokr_t2", "lokr_w1_a"}),
    ("factor4", {"factor": 4}, False, {"lokr_w1", "lokr_w2_a"}),
    ("factor8_unbalanced", {"factor": 8, "unbalanced_factorization": True}, False, {"lokr_w1", "lokr_w2_a"}),
    ("rs_lora", {"linear_alpha": 5.0, "conv_alpha": 0.5}, True, {"lokr_w2_a"}),
]


def no_kron(*args, **kwargs):
    raise AssertionError("runtime LoKr must not materialise kron(w1, w2)")


@pytest.mark.parametrize("opt_id, kwargs, rs_lora, expect", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_matches_lycoris_wrapped_forward(
    tmp_path, lycoris_state, monkeypatch, opt_id, kwargs, rs_lora, expect
):
    pristine = Net()
    xs = inputs()
    base = outputs(pristine, xs)
    wrapped = copy.deepcopy(pristine)
    preset = write_preset(
        tmp_path / "p.toml", module_algo={"algo": "lokr", "rs_lora": True} if rs_lora else None
    )
    net = lycoris.create_lycoris(wrapped, 1.0, algo="lokr", preset=preset, **{**BASE, **kwargs})
    mods = {m.lora_name.removeprefix("lycoris_"): m for m in net.loras}
    assert sorted(mods) == sorted(n.replace(".", "_") for n in LAYERS)
    assert all(m.rs_lora == rs_lora for m in mods.values())
    # Both halves full: files mean γ = 1 (LyCORIS's own reload, ComfyUI, SD.Next, sd.cpp). The live LyCORIS
    # module agrees except with rs_lora, where it trains at dim/√dim but saves nothing that says so: follow
    # the file.
    file_rule = {n: 1.0 / m.scale if m.use_w1 and m.use_w2 else 1.0 for n, m in mods.items()}
    assert all(f == 1.0 for f in file_rule.values()) != rs_lora
    net.apply_to()  # registers the LyCORIS modules: net.parameters() is empty before this
    params = [p for m in net.loras for p in m.parameters()]
    assert params and list(net.parameters())
    randomise(params, seed=2, scale=0.5)  # LyCORIS zero-inits w2 / w2_b: randomise every factor
    refs = multiplier_outputs(net, wrapped, xs, MULTIPLIERS)
    path = tmp_path / "lokr.safetensors"
    saved = save_lycoris(net, path)
    roles = {k.rsplit(".", 1)[1] for k in saved}
    assert expect <= roles, sorted(roles)
    assert all(k.startswith("lycoris_") for k in saved), sorted(saved)

    for m in MULTIPLIERS:
        got = {}
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            with monkeypatch.context() as patch:
                if mode == "runtime":
                    patch.setattr(torch, "kron", no_kron)
                handle = loraweave.apply(model, str(path), mode=mode, strength=m)
                got[mode] = outputs(model, xs)
            report = handle.report
            assert report.unmatched == [], [(u["key"], u["reason"]) for u in report.unmatched]
            assert report.keys_applied == report.keys_total == len(saved), sorted(saved)
            for name in LAYERS:
                ref, ours = refs[m][name], got[mode][name]
                ref = base[name] + (ref - base[name]) * file_rule[name.replace(".", "_")]
                assert rel_err(ref, base[name]) > 0.05, f"{name}: adapter has no visible effect"
                assert rel_err(ours, ref) <= TOL, (mode, m, name, rel_err(ours, ref))
                assert rel_err(ours - base[name], ref - base[name]) <= TOL, (mode, m, name)
            assert (not torch.equal(model.c2.weight, pristine.c2.weight)) == (mode == "merge")
            handle.remove()
            for name, out in outputs(model, xs).items():
                assert torch.equal(out, base[name]), f"{mode}: remove() did not restore {name}"
        for name in LAYERS:
            assert rel_err(got["runtime"][name], got["merge"][name]) <= TOL, (m, name)


# ------------------------------------------------------------------------ fused Flux target (row chunks)


def kron64(sd: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    """Independent fp64 ΔW = kron(w1, w2) on the flattened (rows, in*k) weight (no Tucker here)."""
    w = {k.rsplit(".", 1)[1]: v.double() for k, v in sd.items() if k.startswith(stem + ".")}
    w1 = w["lokr_w1"] if "lokr_w1" in w else w["lokr_w1_a"] @ w["lokr_w1_b"]
    w2 = w["lokr_w2"].flatten(1) if "lokr_w2" in w else w["lokr_w2_a"] @ w["lokr_w2_b"].flatten(1)
    return torch.kron(w1, w2)


def test_fused_flux_qkv_lands_on_the_right_rows():
    """(96, 32) qkv LoKr with b=24 rows per w1 row: to_q/to_k/to_v chunks of 32 rows cut w1 rows in half."""
    from helpers.tiny_models import tiny_flux

    pristine = tiny_flux()
    stem = "lora_unet_double_blocks_0_img_attn_qkv"
    sd = lokr_sd(stem, 3, alpha=3.0, w1=(4, 4), w2_a=(24, 2), w2_b=(2, 8))
    s = 0.8
    check_fused_flux_qkv(pristine, sd, s, s * (3.0 / 2) * kron64(sd, stem), TOL)


# ------------------------------------------------------------------------ flat conv layout, stacking, rules


def test_flat_conv_layout_and_stacking_with_lora():
    """A 2-D w2 whose columns straddle channels (in·k = c·n, n % k != 0: the pre-4.x LyCORIS conv layout)
    plus a LoRA on the same layers: merge == fp64 reference, runtime == merge, no kron at runtime."""
    torch.manual_seed(5)
    pristine = nn.ModuleDict({"cv": nn.Conv2d(10, 12, 3, padding=1), "fc": nn.Linear(30, 12)})
    sd = {
        **lokr_sd("cv", 6, alpha=1.0, w1_a=(3, 2), w1_b=(2, 6), w2_a=(4, 2), w2_b=(2, 15)),  # 10*9 = 6*15
        **lokr_sd("fc", 7, alpha=5.0, w1=(2, 5), w2=(6, 6)),
    }  # both full: alpha ignored, γ = 1
    lora = {
        "fc.lora_down.weight": torch.randn(2, 30, generator=gen(8)),
        "fc.lora_up.weight": torch.randn(12, 2, generator=gen(9)),
    }
    s = -0.6
    ref = {
        "cv": pristine.cv.weight.double() + s * 0.5 * kron64(sd, "cv").view(12, 10, 3, 3),
        "fc": pristine.fc.weight.double()
        + s * (kron64(sd, "fc") + lora["fc.lora_up.weight"].double() @ lora["fc.lora_down.weight"].double()),
    }
    adapters = [(sd, s), (lora, s)]
    xs = {"cv": torch.randn(2, 10, 7, 6, generator=gen(10)), "fc": torch.randn(4, 30, generator=gen(11))}
    model = copy.deepcopy(pristine)
    handle = loraweave.apply(model, adapters, mode="merge", strict=True)
    merged = outputs(model, xs)
    for name in ref:
        assert rel_err(model[name].weight, ref[name]) <= 1e-6, name
    handle.remove()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "kron", no_kron)
        handle = loraweave.apply(model, adapters, mode="runtime", strict=True)
        got = outputs(model, xs)
    assert "none:full_rank_factors" in handle.report.adapters[0]["alpha_sources"]
    for name in ref:
        assert rel_err(got[name], merged[name]) <= TOL, name


def test_rank_rule_and_validation():
    load = FAMILIES["lokr"].load

    def factors(**shapes):
        tensors = {f"lokr_{r}": torch.randn(*s) for r, s in shapes.items()}
        return load(tensors, {k: f"m.{k}" for k in tensors})

    assert factors(w1=(4, 4), w2=(6, 8, 3, 3)).rank is None  # both full: γ = 1 (LyCORIS stores alpha = dim)
    assert factors(w1=(4, 4), w2_a=(6, 3), w2_b=(3, 72)).rank == 3
    assert factors(w1_a=(4, 2), w1_b=(2, 4), w2=(6, 8)).rank == 2
    assert factors(w1_a=(4, 2), w1_b=(2, 4), w2_a=(6, 3), w2_b=(3, 8)).rank == 2  # LyCORIS: w1's rank first
    tucker = factors(w1=(4, 4), t2=(3, 3, 3, 3), w2_a=(3, 6), w2_b=(3, 8))
    assert (tucker.rank, tucker.rows, tucker.kernel, tucker.is_conv_kernel) == (3, 24, (3, 3), True)
    assert FAMILIES["lokr"].check_target(tucker, (24, 32, 3, 3)) is None
    assert FAMILIES["lokr"].check_target(tucker, (24, 32, 1, 1)).kind == "shape_mismatch"
    assert FAMILIES["lokr"].check_target(tucker, (24, 31, 3, 3)).kind == "shape_mismatch"
    bad = {
        "incomplete LoKr": [dict(w1=(4, 4)), dict(w1_a=(4, 2), w2=(6, 8)), dict(w2=(6, 8))],
        "shape mismatch": [
            dict(w1_a=(4, 2), w1_b=(3, 4), w2=(6, 8)),
            dict(w1=(4, 4), w1_a=(4, 2), w1_b=(2, 4), w2=(6, 8)),
            dict(w1=(4, 4), w2=(6, 8), t2=(2, 2, 3, 3)),
            dict(w1=(4, 4), w2_a=(6, 3), w2_b=(2, 8)),
            dict(w1=(4, 4, 3), w2=(6, 8)),
        ],
    }
    for reason, cases in bad.items():
        for case in cases:
            with pytest.raises(PartRejected, match=reason):
                factors(**case)
    with pytest.raises(PartRejected, match="unsupported family: dora_scale"):  # never dropped silently
        load(
            {"lokr_w1": torch.ones(4, 4), "lokr_w2": torch.ones(6, 8), "dora_scale": torch.ones(24, 1)},
            {"lokr_w1": "a", "lokr_w2": "b", "dora_scale": "c"},
        )
    # through the planner: NaN, wrong target width, every key reported with its reason
    target = nn.ModuleDict({"fc": nn.Linear(32, 24)})
    nan = lokr_sd("fc", 1, alpha=1.0, w1=(4, 4), w2=(6, 8))
    nan["fc.lokr_w2"][0, 0] = float("nan")
    wide = lokr_sd("fc", 2, w1=(4, 4), w2=(6, 9))
    for sd, kind in ((nan, "bad tensor"), (wide, "shape mismatch")):
        report = loraweave.plan(target, sd)
        assert reason_prefixes(report) == {kind: len(sd)}, report.unmatched


# ------------------------------------------------------------------------ real files (kohya names, SD1.x)


@pytest.fixture(scope="module")
def sd15_meta(realdata):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        return {
            "unet": UNet2DConditionModel.from_config(real_config("sd15__unet_config.json")),
            "text_encoder": CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json"))),
        }


@pytest.mark.parametrize("path", FALCON, ids=lambda p: p.name.split("__")[-1])
def test_real_file_plans_fully_and_attaches_at_runtime(path, sd15_meta):
    """Every key of the real files lands on full-size SD1.5 (meta device); the runtime form builds for all 350
    parts (incl. the flat-layout 3x3 convs). Full-size merge on CPU does not fit the time budget: the numeric
    check runs on real-size layers below."""
    adapter = loraweave.load_adapter(path)
    assert adapter.unparsed == [] and adapter.families == {"lokr": 350}
    report = loraweave.plan(sd15_meta, adapter)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == 1750, report.unmatched[:3]
    assert report.adapters[0]["alpha_sources"] == {"tensor:alpha": 350}
    handle = loraweave.apply(sd15_meta, adapter, mode="runtime")
    assert handle.report.unmatched == [] and handle.report.keys_applied == 1750
    handle.remove()


# stem -> (module path, real-size module): a flat-layout 3x3 conv, a strided one, 1x1 convs, Linears, the TE
REAL_LAYERS = {
    "lora_unet_down_blocks_0_resnets_0_conv1": (
        "down_blocks.0.resnets.0.conv1",
        lambda: nn.Conv2d(320, 320, 3, padding=1),
    ),
    "lora_unet_down_blocks_0_downsamplers_0_conv": (
        "down_blocks.0.downsamplers.0.conv",
        lambda: nn.Conv2d(320, 320, 3, stride=2, padding=1),
    ),
    "lora_unet_up_blocks_0_resnets_0_conv_shortcut": (
        "up_blocks.0.resnets.0.conv_shortcut",
        lambda: nn.Conv2d(2560, 1280, 1),
    ),
    "lora_unet_down_blocks_0_attentions_0_proj_in": (
        "down_blocks.0.attentions.0.proj_in",
        lambda: nn.Conv2d(320, 320, 1),
    ),
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k": (
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k",
        lambda: nn.Linear(768, 320, bias=False),
    ),
    "lora_unet_down_blocks_0_resnets_0_time_emb_proj": (
        "down_blocks.0.resnets.0.time_emb_proj",
        lambda: nn.Linear(1280, 320),
    ),
    "lora_te_text_model_encoder_layers_0_mlp_fc1": (
        "text_model.encoder.layers.0.mlp.fc1",
        lambda: nn.Linear(768, 3072),
    ),
}


def _tree(modules: dict[str, nn.Module]) -> nn.Module:
    root = nn.Module()
    for path, module in modules.items():
        parent = root
        for part in path.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(path.rsplit(".", 1)[1], module)
    return root


@pytest.mark.parametrize("path", FALCON, ids=lambda p: p.name.split("__")[-1])
def test_real_file_layers_match_lycoris(path, realdata):
    """Real fp16 factors on real-size layers: merge == W + s·LyCORIS diff_weight (fp64), runtime == merge."""
    torch.manual_seed(0)
    layers = {stem: (p, make()) for stem, (p, make) in REAL_LAYERS.items()}
    unet = _tree({p: m for stem, (p, m) in layers.items() if stem.startswith("lora_unet_")})
    te = _tree({p: m for stem, (p, m) in layers.items() if stem.startswith("lora_te_")})
    with safe_open(str(path), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys() if k.rsplit(".", 1)[0] in REAL_LAYERS}
    assert len(sd) == 5 * len(REAL_LAYERS)
    s = 0.7
    refs, xs = {}, {}
    for stem, (_, module) in layers.items():
        w = {k.rsplit(".", 1)[1]: v.double() for k, v in sd.items() if k.startswith(stem + ".")}
        delta = lycoris_diff_weight(
            None,
            w["lokr_w1_a"],
            w["lokr_w1_b"],
            None,
            w["lokr_w2_a"],
            w["lokr_w2_b"],
            None,
            gamma=float(w["alpha"]),
        )
        refs[stem] = module.weight.double() + s * delta.view(module.weight.shape)
        in_dim = module.weight.shape[1]
        xs[stem] = (
            torch.randn(2, in_dim, 12, 10, generator=gen(1))
            if module.weight.dim() == 4
            else torch.randn(3, in_dim, generator=gen(1))
        )
    target = {"unet": unet, "text_encoder": te}

    def run() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {stem: module(xs[stem]) for stem, (_, module) in layers.items()}

    handle = loraweave.apply(target, (sd, s), mode="merge", strict=True)
    assert handle.report.keys_applied == handle.report.keys_total == len(sd)
    for stem, (_, module) in layers.items():
        assert rel_err(module.weight, refs[stem]) <= 1e-6, stem
    merged = run()
    handle.remove()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "kron", no_kron)
        handle = loraweave.apply(target, (sd, s), mode="runtime", strict=True)
        got = run()
    for stem in layers:
        assert rel_err(got[stem], merged[stem]) <= TOL, (stem, rel_err(got[stem], merged[stem]))
    handle.remove()


@pytest.mark.parametrize("src, length", [(0, 24), (6, 12), (4, 9)])  # whole, w1-aligned rows, straddling
@pytest.mark.parametrize("coeff", [1.0, -0.7])
def test_set_delta_writes_the_kron_rows(src, length, coeff):
    # set_delta (the merge's first term, the ComfyUI patch's ΔW) writes coeff·kron rows without a zero pass:
    # the kron lands in the rows themselves where they span whole w1 rows. Reference: kron in fp64.
    g = torch.Generator().manual_seed(3)
    t = {"lokr_w1": torch.randn(4, 3, generator=g), "lokr_w2_a": torch.randn(6, 2, generator=g)}
    t["lokr_w2_b"] = torch.randn(2, 5, generator=g)
    f = FAMILIES["lokr"].load(t, {k: k for k in t})
    want = coeff * torch.kron(t["lokr_w1"].double(), t["lokr_w2_a"].double() @ t["lokr_w2_b"].double())
    rows = torch.full((length, 15), float("nan"))  # set, not added: nothing of what was there survives
    FAMILIES["lokr"].set_delta(rows, f, src, length, coeff)
    assert rel_err(rows.double(), want[src : src + length]) <= 1e-6
