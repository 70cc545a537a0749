"""IA3, norm (`w_norm`/`b_norm`) and GLoRA: merge and runtime against references, CPU, fp32.

References: GLoRA and norm = LyCORIS 4.x's own wrapped forward (create_lycoris, algo="glora" /
train_norm=True); IA3 = hand-made LyCORIS and PEFT fixtures with an independent formula, the forward of a
LyCORIS-written IA3 file, and PEFT's own IA3 forward at strength 1. Tolerances (rel. error = max|ours - ref| /
max|ref|): layer outputs and the adapter's share of them <= 1e-5; merged weights against an fp64 formula <=
1e-6. PEFT IA3 strength s: l_s = 1 + s·(l − 1) (exact PEFT at s = 1, identity at s = 0).
"""

from __future__ import annotations

import copy

import lycoris  # the reference must be installed: a missing package fails here, it is never skipped
import pytest
import torch
import torch.nn.functional as F
from helpers.common import (
    gen,
    multiplier_outputs,
    outputs,
    randn_inputs,
    randomise,
    rel_err,
    save_lycoris,
    write_preset,
)
from torch import nn

import loraweave
from loraweave.families import FAMILIES

TOL = 1e-5
WTOL = 1e-6
MULTIPLIERS = (1.0, 0.5, -1.0)


def applied(model: nn.Module, adapter, mode: str, strength: float, n_keys: int):
    """Apply, check that every key landed, and return the handle."""
    handle = loraweave.apply(model, adapter, mode=mode, strength=strength)
    report = handle.report
    assert report.unmatched == [], [(u["key"], u["reason"]) for u in report.unmatched]
    assert report.keys_applied == report.keys_total == n_keys
    return handle


def check_modes(
    pristine: nn.Module,
    adapter,
    n_keys: int,
    xs: dict,
    refs: dict,
    weights: dict | None = None,
    modes: tuple[str, ...] = ("merge", "runtime"),
) -> None:
    """refs: strength -> {layer: reference output}; weights: strength -> {layer: reference weight (merge)}."""
    base = outputs(pristine, xs)
    refs = {s: {n: t.detach() for n, t in ref.items()} for s, ref in refs.items()}
    for s, ref in refs.items():
        for mode in modes:
            model = copy.deepcopy(pristine)
            handle = applied(model, adapter, mode, s, n_keys)
            got = outputs(model, xs)
            for name in xs:
                effect = float((ref[name] - base[name]).abs().max() / base[name].abs().max())
                assert effect > 0.02, f"{name}: the adapter has no visible effect ({effect})"
                assert rel_err(got[name], ref[name]) <= TOL, (mode, s, name, rel_err(got[name], ref[name]))
                assert rel_err(got[name] - base[name], ref[name] - base[name]) <= TOL, (mode, s, name)
                if mode == "merge" and weights is not None and name in weights[s]:
                    w = model.get_submodule(name).weight
                    assert rel_err(w, weights[s][name]) <= WTOL, (s, name)
            if mode == "runtime":
                assert all(
                    torch.equal(model.get_submodule(n).weight, pristine.get_submodule(n).weight) for n in xs
                )
            handle.remove()
            for name, out in outputs(model, xs).items():
                assert torch.equal(out, base[name]), f"{mode}: remove() did not restore {name}"


def lycoris_refs(pristine: nn.Module, xs: dict, make_net, path, seed: int) -> tuple[dict, dict]:
    """Wrap a copy with LyCORIS, randomise every adapter parameter, record the forward per multiplier,
    save."""
    wrapped = copy.deepcopy(pristine)
    net = make_net(wrapped)
    net.apply_to()
    randomise(net.parameters(), seed, scale=0.4)  # LyCORIS zero-inits a2/b2, w_norm/b_norm and the IA3 weight
    refs = multiplier_outputs(net, wrapped, xs, MULTIPLIERS)
    return refs, save_lycoris(net, path)


# ------------------------------------------------------------------------------------------------ GLoRA


class GloraNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 10)
        self.sq = nn.Linear(8, 8)  # square: the factor shapes fit both namings, the module decides
        self.c1 = nn.Conv1d(4, 6, 3, padding=1)
        self.c2 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.c3 = nn.Conv3d(3, 5, 3, padding=1)
        self.pw = nn.Conv2d(4, 6, 1)


GLORA_X = {
    "lin": (2, 3, 12),
    "sq": (4, 8),
    "c1": (2, 4, 9),
    "c2": (2, 4, 9, 7),
    "c3": (1, 3, 5, 4, 6),
    "pw": (2, 4, 5, 5),
}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"linear_dim": 3, "linear_alpha": 2.0},
        {"linear_dim": 4, "linear_alpha": 7.0, "conv_dim": 2, "conv_alpha": 0.5},
    ],
    ids=["same_dims", "conv_dims"],
)
def test_glora_matches_lycoris_wrapped_forward(tmp_path, lycoris_state, kwargs):
    pristine, xs = GloraNet(), randn_inputs(GLORA_X)
    path = tmp_path / "glora.safetensors"
    refs, saved = lycoris_refs(
        pristine, xs, lambda m: lycoris.create_lycoris(m, 1.0, algo="glora", **kwargs), path, seed=2
    )
    assert sorted({k.split(".")[0] for k in saved}) == sorted(f"lycoris_{n}" for n in GLORA_X)
    assert all(
        float(v) != saved[k.replace("alpha", "a2.weight")].shape[0]
        for k, v in saved.items()
        if k.endswith(".alpha")
    )  # alpha != rank everywhere
    check_modes(pristine, str(path), len(saved), xs, refs)


def old_naming(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pre-3.0 names for the same adapter: a1 <-> a2 and b1 <-> b2 swap (old ΔW = b2·b1 + W·a2·a1)."""
    swap = {
        "a1.weight": "a2.weight",
        "a2.weight": "a1.weight",
        "b1.weight": "b2.weight",
        "b2.weight": "b1.weight",
    }
    out = {}
    for key, value in sd.items():
        stem, _, role = key.partition(".")
        out[f"{stem}.{swap.get(role, role)}"] = value
    return out


def glora_linear_sd(layers: dict[str, tuple[int, int]], rank: int, alpha: float, seed: int) -> dict:
    g, sd = gen(seed), {}
    for name, (out, inp) in layers.items():
        for role, shape in (
            ("a1", (inp, rank)),
            ("a2", (rank, inp)),
            ("b1", (out, rank)),
            ("b2", (rank, inp)),
        ):
            sd[f"{name}.{role}.weight"] = torch.randn(*shape, generator=g) * 0.4
        sd[f"{name}.alpha"] = torch.tensor(alpha)
    return sd


def glora_ref_weight(w: torch.Tensor, sd: dict, stem: str, s: float) -> torch.Tensor:
    """Independent formula (LyCORIS >= 3 names), fp64: W + s·α/r·(W·a1·a2 + b1·b2)."""
    t = {r: sd[f"{stem}.{r}.weight"].double() for r in ("a1", "a2", "b1", "b2")}
    gamma = float(sd[f"{stem}.alpha"]) / t["a2"].shape[0]
    w = w.double()
    return w + s * gamma * (w @ t["a1"] @ t["a2"] + t["b1"] @ t["b2"])


@pytest.mark.parametrize("layer", ["lin", "sq"])
def test_glora_old_naming(layer):
    """Old names on a non-square layer (only the old pattern fits) and on a square one (both fit; the module's
    input width picks the old reading). The square case needs the planner to run check_target before its rows
    check (see the report: core change C)."""
    pristine = nn.ModuleDict({"lin": nn.Linear(12, 10), "sq": nn.Linear(8, 8)})
    shapes = {"lin": (10, 12), "sq": (8, 8)}
    new = glora_linear_sd({layer: shapes[layer]}, rank=3, alpha=5.0, seed=3)
    xs = randn_inputs({layer: (5, shapes[layer][1])})
    weights = {s: {layer: glora_ref_weight(pristine[layer].weight, new, layer, s)} for s in MULTIPLIERS}
    refs = {
        s: {layer: F.linear(xs[layer].double(), weights[s][layer], pristine[layer].bias.double())}
        for s in MULTIPLIERS
    }
    check_modes(pristine, old_naming(new), len(new), xs, refs, weights)


def test_glora_naming_from_shapes():
    glora = FAMILIES["glora"]
    x, y = 8, 3
    ambiguous = {
        "a1": torch.randn(x, y),
        "a2": torch.randn(y, x),
        "b1": torch.randn(x, y),
        "b2": torch.randn(y, x),
    }
    roles = {r: r for r in ambiguous}
    loaded = glora.load(ambiguous, roles)
    f, miss = glora.fit(loaded, (x, x))
    assert miss is None and not f.old_naming and f.rank == y and f.rows == x
    f, miss = glora.fit(loaded, (y, y))  # settling never changes the loaded factors
    assert miss is None and f.old_naming and f.rank == x and f.rows == y
    assert loaded.other is not None and not loaded.old_naming
    full = {r: torch.randn(4, 4) for r in roles}  # r == in == out: the current (LyCORIS >= 3) naming
    f, miss = glora.fit(glora.load(full, roles), (4, 4))
    assert miss is None and not f.old_naming
    with pytest.raises(Exception, match="incomplete GLoRA: no b2.weight"):
        glora.load({r: t for r, t in ambiguous.items() if r != "b2"}, roles)
    conv = {
        "a1": torch.randn(4, 2, 1, 1),
        "a2": torch.randn(2, 4, 1, 1),
        "b1": torch.randn(6, 2, 1, 1),
        "b2": torch.randn(2, 4, 3, 3),
    }
    f = glora.load(conv, {r: r for r in conv})
    assert f.is_conv_kernel and glora.check_target(f, (6, 4, 3, 3)) is None
    assert glora.check_target(glora.load(conv, {r: r for r in conv}), (6, 4, 3, 1)).kind == "shape_mismatch"


def test_glora_fused_flux_qkv_rows():
    """A fused qkv GLoRA lands on to_q/to_k/to_v: the W·a1·a2 half reads each module's own rows."""
    from helpers.tiny_models import flux_forward, tiny_flux

    pristine = tiny_flux()
    stem = "lora_unet_double_blocks_0_img_attn_qkv"
    sd = glora_linear_sd({stem: (96, 32)}, rank=4, alpha=3.0, seed=4)
    attn = "transformer_blocks.0.attn"
    names = [f"{attn}.to_q", f"{attn}.to_k", f"{attn}.to_v"]
    s = 0.8
    w_full = torch.cat([pristine.get_submodule(n).weight for n in names])
    merged = glora_ref_weight(w_full, sd, stem, s)
    x = torch.randn(3, 32, generator=gen(5))
    outs = {}
    for mode in ("merge", "runtime"):
        model = copy.deepcopy(pristine)
        handle = applied(model, sd, mode, s, len(sd))
        for i, name in enumerate(names):
            module, ref_w = model.get_submodule(name), merged[32 * i : 32 * (i + 1)]
            if mode == "merge":
                assert rel_err(module.weight, ref_w) <= WTOL, name
            with torch.no_grad():
                ref = F.linear(x.double(), ref_w, pristine.get_submodule(name).bias.double())
                assert rel_err(module(x), ref) <= TOL, (mode, name)
        with torch.no_grad():
            outs[mode] = flux_forward(model)
        handle.remove()
    assert rel_err(outs["runtime"], outs["merge"]) <= TOL


# ------------------------------------------------------------------------------------------------ norm


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 10)
        self.ln = nn.LayerNorm(10)
        self.gn = nn.GroupNorm(2, 6)
        with torch.no_grad():
            for m in (self.ln, self.gn):
                m.weight.copy_(torch.rand(m.weight.shape) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape) * 0.3)


def test_norm_matches_lycoris_train_norm(tmp_path, lycoris_state):
    pristine, xs = NormNet(), randn_inputs({"lin": (2, 3, 12), "ln": (2, 3, 10), "gn": (2, 6, 4, 4)})
    path = tmp_path / "norm.safetensors"
    refs, saved = lycoris_refs(
        pristine,
        xs,
        lambda m: lycoris.create_lycoris(
            m, 1.0, linear_dim=2, linear_alpha=1.0, algo="lora", train_norm=True
        ),
        path,
        seed=6,
    )
    assert {"lycoris_ln.w_norm", "lycoris_ln.b_norm", "lycoris_gn.w_norm", "lycoris_gn.b_norm"} <= set(saved)
    weights = {
        s: {
            n: pristine.get_submodule(n).weight.double() + s * saved[f"lycoris_{n}.w_norm"].double()
            for n in ("ln", "gn")
        }
        for s in MULTIPLIERS
    }
    check_modes(pristine, str(path), len(saved), xs, refs, weights)


def test_norm_rmsnorm_and_biasless_layernorm():
    """Hand-made: torch RMSNorm (merge + runtime), diffusers RMSNorm (merge), a bias-less LayerNorm with
    b_norm (no bias to merge into: auto mode runs it at runtime)."""
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    torch.manual_seed(1)
    pristine = nn.ModuleDict(
        {
            "rms": nn.RMSNorm(10, eps=1e-5),
            "drms": DiffusersRMSNorm(10, eps=1e-6),
            "lnb": nn.LayerNorm(10, bias=False),
        }
    )
    with torch.no_grad():
        for m in pristine.values():
            m.weight.copy_(torch.rand(10) + 0.5)
    g = gen(7)
    sd = {f"{n}.w_norm": torch.randn(10, generator=g) * 0.4 for n in pristine}
    sd["lnb.b_norm"] = torch.randn(10, generator=g) * 0.4
    xs = randn_inputs({n: (2, 3, 10) for n in pristine})
    for s in MULTIPLIERS:
        w = {n: pristine[n].weight.double() + s * sd[f"{n}.w_norm"].double() for n in pristine}
        x = {n: t.double() for n, t in xs.items()}
        ref = {
            "rms": F.rms_norm(x["rms"], (10,), w["rms"], 1e-5),
            "drms": x["drms"] * torch.rsqrt(x["drms"].pow(2).mean(-1, keepdim=True) + 1e-6) * w["drms"],
            "lnb": F.layer_norm(x["lnb"], (10,), w["lnb"], s * sd["lnb.b_norm"].double(), 1e-5),
        }
        merge_ok = {"rms", "drms"}
        check_modes(
            pristine,
            {k: v for k, v in sd.items() if k.split(".")[0] in merge_ok},
            2,
            {n: xs[n] for n in merge_ok},
            {s: {n: ref[n] for n in merge_ok}},
            {s: {n: w[n] for n in merge_ok}},
            modes=("merge",),
        )
        check_modes(
            pristine,
            {k: v for k, v in sd.items() if k.startswith("rms.")},
            1,
            {"rms": xs["rms"]},
            {s: {"rms": ref["rms"]}},
            modes=("runtime",),
        )
        model = copy.deepcopy(pristine)
        lnb = {k: v for k, v in sd.items() if k.startswith("lnb.")}
        handle = applied(model, lnb, "auto", s, 2)
        assert [a.mechanism for a in handle.report.applied] == ["runtime"]
        with torch.no_grad():
            assert rel_err(model.lnb(xs["lnb"]), ref["lnb"]) <= TOL, s


# ------------------------------------------------------------------------------------------------ IA3


class Ia3Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 10)
        self.sq = nn.Linear(8, 8)
        self.cv = nn.Conv2d(4, 6, 3, padding=1)


IA3_X = {"lin": (2, 3, 12), "sq": (4, 8), "cv": (2, 4, 5, 5)}


def ia3_ref_weight(w: torch.Tensor, vec: torch.Tensor, on_input: bool, s: float, peft: bool) -> torch.Tensor:
    """W ⊙ (1 + s·w) (LyCORIS) or W ⊙ (1 + s·(l − 1)) (PEFT), along rows or input channels, fp64."""
    v = vec.double().flatten()
    scale = 1 + s * ((v - 1) if peft else v)
    shape = [1] * w.dim()
    shape[1 if on_input else 0] = -1
    return w.double() * scale.view(shape)


def ia3_refs(pristine: nn.Module, xs: dict, vecs: dict, on_input: dict, peft: bool):
    weights, refs = {}, {}
    for s in MULTIPLIERS:
        weights[s], refs[s] = {}, {}
        for name, x in xs.items():
            m = pristine.get_submodule(name)
            w = ia3_ref_weight(m.weight, vecs[name], on_input[name], s, peft)
            b = m.bias.double()
            if peft and not on_input[name]:  # PEFT scales the whole output, bias included
                b = b * (1 + s * (vecs[name].double().flatten() - 1))
            weights[s][name] = w
            if isinstance(m, nn.Conv2d):
                refs[s][name] = F.conv2d(x.double(), w, b, padding=m.padding)
            else:
                refs[s][name] = F.linear(x.double(), w, b)
    return weights, refs


@pytest.mark.parametrize("on_input", [0, 1])
def test_ia3_lycoris_hand_fixture(on_input):
    pristine, xs = Ia3Net(), randn_inputs(IA3_X)
    g, sd, vecs = gen(8), {}, {}
    for name, m in pristine.named_children():
        n = m.weight.shape[1 if on_input else 0]
        vec = torch.randn(n, generator=g) * 0.5
        sd[f"lycoris_{name}.weight"] = vec.view(1, n, 1, 1) if isinstance(m, nn.Conv2d) else vec
        sd[f"lycoris_{name}.on_input"] = torch.tensor(float(on_input))  # LyCORIS saves it in the file dtype
        vecs[name] = vec
    weights, refs = ia3_refs(pristine, xs, vecs, dict.fromkeys(xs, bool(on_input)), peft=False)
    check_modes(pristine, sd, len(sd), xs, refs, weights)


@pytest.mark.parametrize("train_on_input", [False, True])
def test_ia3_lycoris_written_file_matches_lycoris_forward(tmp_path, lycoris_state, train_on_input):
    """A file written by LyCORIS itself (never reloaded by LyCORIS: its loader drops on_input)."""
    preset = write_preset(
        tmp_path / "p.toml", ("Linear", "Conv2d"), {"algo": "ia3", "train_on_input": train_on_input}
    )
    pristine, xs = Ia3Net(), randn_inputs(IA3_X)
    path = tmp_path / "ia3.safetensors"
    refs, saved = lycoris_refs(
        pristine, xs, lambda m: lycoris.create_lycoris(m, 1.0, algo="ia3", preset=preset), path, seed=9
    )
    assert all(float(v) == float(train_on_input) for k, v in saved.items() if k.endswith(".on_input"))
    check_modes(pristine, str(path), len(saved), xs, refs)


@pytest.mark.parametrize("feedforward", [False, True])
def test_ia3_peft_hand_fixture(feedforward):
    """PEFT ia3_l: (out, 1) / (1, in) for Linear, (1, n, 1, 1) for a non-square conv. The output side also
    scales the bias, which merge can only do when the core hands bias_delta the original bias (core change
    B)."""
    pristine, xs = Ia3Net(), randn_inputs(IA3_X)
    g, sd, vecs = gen(10), {}, {}
    for name, m in pristine.named_children():
        n = m.weight.shape[1 if feedforward else 0]
        vec = 1 + torch.randn(n, generator=g) * 0.5
        if isinstance(m, nn.Conv2d):
            shaped = vec.view(1, n, 1, 1)
        else:
            shaped = vec.view(1, n) if feedforward else vec.view(n, 1)
        sd[f"base_model.model.{name}.ia3_l"] = shaped
        vecs[name] = vec
    weights, refs = ia3_refs(pristine, xs, vecs, dict.fromkeys(xs, feedforward), peft=True)
    check_modes(pristine, sd, len(sd), xs, refs, weights)


def test_ia3_peft_matches_peft_forward():
    """PEFT's own IA3 at strength 1 (its only strength), output and feed-forward sides, Linear and Conv2d."""
    from peft import IA3Config, get_peft_model, get_peft_model_state_dict

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.ff = nn.Linear(12, 10), nn.Linear(10, 7)
            self.cv, self.cvf = nn.Conv2d(4, 6, 3, padding=1), nn.Conv2d(6, 3, 1)

    pristine = Net()
    xs = randn_inputs({"lin": (2, 12), "ff": (2, 10), "cv": (2, 4, 5, 5), "cvf": (2, 6, 5, 5)})
    peft_model = get_peft_model(
        copy.deepcopy(pristine),
        IA3Config(target_modules=["lin", "ff", "cv", "cvf"], feedforward_modules=["ff", "cvf"]),
    )
    g = gen(11)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "ia3_l" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.5)
        ref = {n: peft_model.base_model.model.get_submodule(n)(x) for n, x in xs.items()}
    sd = get_peft_model_state_dict(peft_model)
    assert sorted(sd) == sorted(f"base_model.model.{n}.ia3_l" for n in xs)
    check_modes(pristine, sd, len(sd), xs, {1.0: ref})


def test_ia3_fused_flux_qkv_rows():
    """LyCORIS IA3 on a fused qkv: the output side lands row-chunked, the input side scales every module.
    The input side has no rows of its own (rows None: core change C)."""
    from helpers.tiny_models import tiny_flux

    pristine = tiny_flux()
    attn = "transformer_blocks.0.attn"
    names = [f"{attn}.to_q", f"{attn}.to_k", f"{attn}.to_v"]
    x = torch.randn(3, 32, generator=gen(12))
    for on_input, n in ((0, 96), (1, 32)):
        stem = "lora_unet_double_blocks_0_img_attn_qkv"
        vec = torch.randn(n, generator=gen(13)) * 0.5
        sd = {f"{stem}.weight": vec, f"{stem}.on_input": torch.tensor(on_input)}
        s = -0.7
        w_full = torch.cat([pristine.get_submodule(m).weight for m in names])
        merged = ia3_ref_weight(w_full, vec, bool(on_input), s, peft=False)
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            handle = applied(model, sd, mode, s, 2)
            for i, name in enumerate(names):
                module, ref_w = model.get_submodule(name), merged[32 * i : 32 * (i + 1)]
                if mode == "merge":
                    assert rel_err(module.weight, ref_w) <= WTOL, (on_input, name)
                with torch.no_grad():
                    ref = F.linear(x.double(), ref_w, pristine.get_submodule(name).bias.double())
                    assert rel_err(module(x), ref) <= TOL, (on_input, mode, name)
            handle.remove()


def test_ia3_bad_parts_are_reported():
    model = nn.ModuleDict({"sqc": nn.Conv2d(4, 4, 3), "lin": nn.Linear(12, 10)})
    sd = {
        "sqc.ia3_l": torch.ones(1, 4, 1, 1),  # PEFT conv on a square conv: input or output side unknown
        "lin.weight": torch.ones(7),
        "lin.on_input": torch.tensor(1),
    }  # 7 fits neither side
    report = loraweave.plan(model, sd)
    reasons = {u["key"]: u["reason"] for u in report.unmatched}
    assert report.keys_applied == 0 and set(reasons) == set(sd), reasons
    assert reasons["sqc.ia3_l"].startswith("ambiguous: IA3 vector of 4"), reasons
    assert "shape mismatch" in reasons["lin.weight"] and reasons["lin.weight"] == reasons["lin.on_input"]
