"""OFT / BOFT (oft_blocks, oft_diag, rescale, PEFT boft_R/boft_s): merge and runtime against the trainers' own
code.

References: LyCORIS 4.x's wrapped forward (diag-oft, boft) generated here, PEFT's BOFT layer, and independent
fp64 formulas for the forms no installed package writes (LyCORIS 2.x `oft_diag`, kohya COFT incl. Flux
splits). Tolerances (rel. error = max|ours - ref| / max|ref|, fp32): <= 1e-5 on layer outputs and on the
adapter's share of them; merged weights against an fp64 reference <= 1e-6.
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
    reason_prefixes,
    rel_err,
    write_preset,
)
from helpers.family_models import lin_model, oft_sd
from safetensors.torch import load_file, save_file
from torch import nn

import loraweave
from loraweave.families import FAMILIES, oft
from loraweave.families.base import PartRejected

TOL = 1e-5
MULTIPLIERS = (1.0, 0.5, -1.0)
LAYERS = ("lin", "blk.proj", "c1", "c2", "c3")


class Net(nn.Module):
    """Output dims that both diag-oft (factorization) and BOFT (power-of-two block counts) can split."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(40, 64)
        self.blk = nn.Module()
        self.blk.proj = nn.Linear(24, 32, bias=False)  # nested: key lycoris_blk_proj
        self.c1 = nn.Conv1d(12, 32, 3, padding=1)
        self.c2 = nn.Conv2d(16, 48, 3, stride=2, padding=1)
        self.c3 = nn.Conv3d(8, 16, 3, padding=1)


def inputs() -> dict[str, torch.Tensor]:
    return randn_inputs(
        {"lin": (2, 3, 40), "blk.proj": (5, 24), "c1": (2, 12, 9), "c2": (2, 16, 7, 6), "c3": (1, 8, 4, 5, 3)}
    )


def lycoris_file(tmp_path, algo: str, constraint: float, rescaled: bool, noise: float = 0.1):
    """(pristine model, inputs, base outputs, LyCORIS wrapped-forward outputs per multiplier, saved path)."""
    preset = write_preset(tmp_path / "p.toml")
    pristine, xs = Net(), inputs()
    wrapped = copy.deepcopy(pristine)
    net = lycoris.create_lycoris(
        wrapped,
        1.0,
        linear_dim=4,
        linear_alpha=1.0,
        conv_dim=8,
        conv_alpha=1.0,
        algo=algo,
        constraint=constraint,
        rescaled=rescaled,
        preset=preset,
    )
    assert sorted(m.lora_name.removeprefix("lycoris_") for m in net.loras) == sorted(
        n.replace(".", "_") for n in LAYERS
    )
    g = gen(2)
    with torch.no_grad():  # LyCORIS zero-inits the blocks (R = I) and ones-inits rescale: perturb both
        for m in net.loras:
            for name, p in m.named_parameters():
                p.add_(torch.randn(p.shape, generator=g) * (noise if name == "oft_blocks" else 0.2))
    net.apply_to()
    refs = multiplier_outputs(net, wrapped, xs, MULTIPLIERS)
    path = tmp_path / f"{algo}.safetensors"
    net.save_weights(str(path), dtype=torch.float32, metadata=None)
    return pristine, xs, outputs(pristine, xs), refs, path, net


def check_apply(pristine, xs, base, refs, source, expect_keys: int, strengths=MULTIPLIERS, effect=0.02):
    for s in strengths:
        got = {}
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            handle = loraweave.apply(model, source, mode=mode, strength=s)
            got[mode] = outputs(model, xs)
            report = handle.report
            assert report.unmatched == [], [(u["key"], u["reason"]) for u in report.unmatched]
            assert report.keys_applied == report.keys_total == expect_keys
            for name in xs:
                ref, ours = refs[s][name], got[mode][name]
                assert rel_err(ref - base[name], base[name]) > effect, (
                    f"{name}: adapter has no visible effect"
                )
                assert rel_err(ours, ref) <= TOL, (mode, s, name, rel_err(ours, ref))
                assert rel_err(ours - base[name], ref - base[name]) <= TOL, (mode, s, name)
            handle.remove()
            for name, out in outputs(model, xs).items():
                assert torch.equal(out, base[name]), f"{mode}: remove() did not restore {name}"
        for name in xs:
            assert rel_err(got["runtime"][name], got["merge"][name]) <= TOL, (s, name)


CASES = [(algo, c, r) for algo in ("diag-oft", "boft") for c in (0.0, 0.02) for r in (False, True)]


@pytest.mark.parametrize(
    "algo, constraint, rescaled", CASES, ids=[f"{a}-c{c}-{'rescaled' if r else 'plain'}" for a, c, r in CASES]
)
def test_matches_lycoris_wrapped_forward(tmp_path, lycoris_state, algo, constraint, rescaled):
    pristine, xs, base, refs, path, net = lycoris_file(tmp_path, algo, constraint, rescaled)
    saved = load_file(str(path))
    roles = {k.rsplit(".", 1)[1] for k in saved}
    assert roles == ({"oft_blocks", "alpha", "rescale"} if rescaled else {"oft_blocks", "alpha"})
    ndim = {saved[k].dim() for k in saved if k.endswith(".oft_blocks")}
    assert ndim == ({3} if algo == "diag-oft" else {4})  # BOFT files are told apart by 4-D blocks only
    if constraint > 0:  # the constraint really clamps (c = α·out_dim, norm over all blocks)
        clamped = [
            m
            for m in net.loras
            if float(torch.linalg.vector_norm(m.oft_blocks.detach() - m.oft_blocks.detach().mT))
            > m.constraint
        ]
        assert len(clamped) == len(LAYERS)
    check_apply(pristine, xs, base, refs, str(path), len(saved))


# ------------------------------------------------------------------------ peer defects (formats notes M1-M5)


def lin_inputs() -> dict[str, torch.Tensor]:
    return {"fc": torch.randn(4, 20, generator=gen(4)), "cv": torch.randn(2, 8, 5, 5, generator=gen(5))}


def deltas(sd, s: float, mode: str) -> dict[str, torch.Tensor]:
    """Change of the layer outputs (adapter share) at strength s."""
    pristine, xs = lin_model(), lin_inputs()
    base = outputs(pristine, xs)
    model = copy.deepcopy(pristine)
    handle = loraweave.apply(model, sd, mode=mode, strength=s, strict=True)
    assert handle.report.keys_applied == handle.report.keys_total == (len(sd) if isinstance(sd, dict) else 6)
    return {n: out - base[n] for n, out in outputs(model, xs).items()}


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_strength_enters_once_and_negative_reverses(mode):
    """ComfyUI applies OFT strength twice (s·(R−I) and then s·ΔW): at s = 0.5 it gives a quarter of the change
    and a negative strength acts like a positive one. Ours: ΔW(s) = s·(Rᵀ−I)W, exactly linear without
    rescale."""
    sd = oft_sd(6)
    full = deltas(sd, 1.0, mode)
    for s in (0.5, -1.0, -0.3, 0.0):
        got = deltas(sd, s, mode)
        for name in full:
            if s == 0.0:
                assert got[name].abs().max() == 0, name
                continue
            assert rel_err(got[name], s * full[name]) <= TOL, (s, name)
            assert rel_err(got[name], s * s * full[name]) > 0.1, (s, name)  # not the squared strength


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_rescale_is_applied(mode):
    """ComfyUI/SD.Next ignore `rescale` in merge. Identity rotation (zero blocks) + rescale: W' = rescale ⊙
    W."""
    sd = oft_sd(7, noise=0.0, rescale=True)
    pristine, xs = lin_model(), lin_inputs()
    got = deltas(sd, 1.0, mode)
    for name, module in pristine.items():
        r = sd[f"{name}.rescale"].double()
        ref_w = r * module.weight.double()
        op = F.linear if name == "fc" else lambda x, w: F.conv2d(x, w, padding=1)
        ref = op(xs[name].double(), ref_w - module.weight.double())
        assert rel_err(ref, op(xs[name].double(), module.weight.double())) > 0.05
        assert rel_err(got[name], ref) <= TOL, name


def test_boft_without_alpha_is_applied(tmp_path, lycoris_state):
    """ComfyUI raises on a BOFT file without `alpha`, swallows the error and leaves the weight unpatched.
    Ours: no alpha = constraint 0 = unconstrained, equal to LyCORIS built with constraint 0."""
    pristine, xs, base, refs, path, _ = lycoris_file(tmp_path, "boft", 0.0, True)
    sd = {k: v for k, v in load_file(str(path)).items() if not k.endswith(".alpha")}
    assert sd and not any(k.endswith(".alpha") for k in sd)
    check_apply(pristine, xs, base, refs, sd, len(sd))


def test_constraint_zero_means_unconstrained(tmp_path, lycoris_state):
    """SD.Next reads LyCORIS's default constraint 0 with kohya's clamp min(‖Q‖, α·out) and nulls the adapter.
    Ours: α = 0 (and a missing alpha) leave Q unconstrained; the change is large and equals LyCORIS's."""
    pristine, xs, base, refs, path, _ = lycoris_file(tmp_path, "diag-oft", 0.0, False, noise=0.3)
    sd = load_file(str(path))
    assert all(float(v) == 0.0 for k, v in sd.items() if k.endswith(".alpha"))
    check_apply(pristine, xs, base, refs, sd, len(sd), strengths=(1.0,), effect=0.3)
    no_alpha = {k: v for k, v in sd.items() if not k.endswith(".alpha")}
    check_apply(pristine, xs, base, refs, no_alpha, len(no_alpha), strengths=(1.0,), effect=0.3)


# ------------------------------------------------------------------------ hand-made forms: oft_diag, kohya
# COFT


def blockdiag_rotation(mats: list[torch.Tensor], s: float) -> torch.Tensor:
    """Dense fp64 blockdiag(R_s) with R_s = s·R + (1−s)·I: an independent reference (no einsum, no views)."""
    return torch.block_diag(
        *[s * r.double() + (1 - s) * torch.eye(r.shape[0], dtype=torch.float64) for r in mats]
    )


def kohya_rotations(blocks: torch.Tensor, alpha: float, rows: int) -> list[torch.Tensor]:
    """kohya sd-scripts networks/oft.py get_weight: Q scaled by (min(‖Q‖, α·rows)+1e-8)/(‖Q‖+1e-8), always."""
    q = blocks.double() - blocks.double().mT
    norm = torch.linalg.vector_norm(q)
    q = q * ((torch.clamp(norm, max=alpha * rows) + 1e-8) / (norm + 1e-8))
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    return list(torch.linalg.solve((eye - q).mT, (eye + q).mT).mT)  # (I + Q)(I − Q)⁻¹


def check_dense_reference(sd: dict, rotation: dict):
    """merge == W' = rows ⊙ (Mᵀ·W) (fp64), runtime == merge, at every multiplier; M dense per layer."""
    pristine, xs = lin_model(), lin_inputs()
    for s in MULTIPLIERS:
        merged = {}
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            handle = loraweave.apply(model, sd, mode=mode, strength=s, strict=True)
            assert handle.report.keys_applied == handle.report.keys_total == len(sd)
            got = outputs(model, xs)
            for name, module in pristine.items():
                w = module.weight.double()
                ref_w = (rotation[name](s).mT @ w.flatten(1)).view_as(w)
                if mode == "merge":
                    assert rel_err(model[name].weight, ref_w) <= 1e-6, (s, name)
                    merged[name] = got[name]
                else:
                    assert rel_err(got[name], merged[name]) <= TOL, (s, name)
            handle.remove()


def test_lycoris2_oft_diag_is_the_rotation_itself():
    """LyCORIS 2.x saved R itself as `oft_diag` (rescale folded in): no Cayley, no constraint, alpha
    ignored."""
    g = gen(8)
    sd = {
        "fc.oft_diag": torch.eye(4) + 0.3 * torch.randn(6, 4, 4, generator=g),
        "cv.oft_diag": torch.eye(8) + 0.3 * torch.randn(2, 8, 8, generator=g),
        "cv.alpha": torch.tensor(1e-9),
    }
    rotation = {n: (lambda s, n=n: blockdiag_rotation(list(sd[f"{n}.oft_diag"]), s)) for n in ("fc", "cv")}
    check_dense_reference(sd, rotation)


@pytest.mark.parametrize("alpha", [1e-3, 10.0])  # kohya's default (clamps), and one that leaves Q alone
def test_kohya_coft_math(alpha):
    """kohya COFT: `oft_blocks` (dim, out/dim, out/dim) + `alpha`; Q always clamped to α·out_dim; R_s =
    s(R−I)+I. Keys without the `oft_unet_` prefix here (see test_kohya_prefix_routes for the real names)."""
    g = gen(9)
    sd = {
        "fc.oft_blocks": torch.randn(4, 6, 6, generator=g) * 0.2,
        "fc.alpha": torch.tensor(alpha),
        "cv.oft_blocks": torch.randn(2, 8, 8, generator=g) * 0.2,
        "cv.alpha": torch.tensor(alpha),
    }
    rots = {n: kohya_rotations(sd[f"{n}.oft_blocks"], alpha, rows) for n, rows in (("fc", 24), ("cv", 16))}
    if alpha < 1:
        q = {n: sd[f"{n}.oft_blocks"] - sd[f"{n}.oft_blocks"].mT for n in ("fc", "cv")}
        assert all(
            float(torch.linalg.vector_norm(q[n])) > alpha * rows for n, rows in (("fc", 24), ("cv", 16))
        )
    check_dense_reference(sd, {n: (lambda s, n=n: blockdiag_rotation(rots[n], s)) for n in rots})


def test_kohya_prefix_routes():
    sd = oft_sd(10, alpha=1e-3)
    sd = {f"oft_unet_{k}": v for k, v in sd.items()}
    report = loraweave.plan(lin_model(), sd)
    assert report.unmatched == [] and report.keys_applied == len(sd), report.unmatched[:2]


def test_kohya_flux_splits_rotate_each_split():
    """kohya Flux OFT: `oft_blocks.<i>` per output split (qkv [q, k, v]), each with its own constraint
    α·split_i. fp64; the 1e-7 budget is kohya's clamp (c+1e-8)/(‖Q‖+1e-8) vs LyCORIS's c/(‖Q‖+1e-8) at c =
    0.064. Through the family API: formats/keys.py does not yet parse `.oft_blocks.<i>` keys (see the
    report)."""
    fam = FAMILIES["oft"]
    g = gen(11)
    alpha, splits = (
        2e-3,
        {"oft_blocks.0": (4, 8), "oft_blocks.1": (4, 8), "oft_blocks.2": (4, 4)},
    )  # rows 32, 32, 16
    tensors = {r: torch.randn(n, b, b, generator=g) * 0.2 for r, (n, b) in splits.items()} | {
        "alpha": torch.tensor(alpha)
    }
    parsed = loraweave.load_adapter(
        {f"oft_unet_x.{r}": t for r, t in tensors.items()}
    )  # the key parser routes splits
    assert (
        parsed.unparsed == []
        and set(parsed.parts[0].roles) == set(tensors)
        and parsed.parts[0].family == "oft"
    )
    f = fam.load(tensors, {r: f"oft_unet_x.{r}" for r in tensors})
    assert f.rows == 80 and fam.check_target(f, (80, 12)) is None
    rots = [r for role, (n, b) in splits.items() for r in kohya_rotations(tensors[role], alpha, n * b)]
    w = torch.randn(80, 12, generator=g, dtype=torch.float64)
    x = torch.randn(5, 12, generator=g, dtype=torch.float64)
    for s in MULTIPLIERS:
        ref = blockdiag_rotation(rots, s).mT @ w
        target = w.clone()
        fam.add_delta_from_base(target, f, 0, 80, s, base=w.clone())
        assert rel_err(target, ref) <= 1e-7, s
        # a fused target: rows [32, 80) (k and v) on their own, merge and runtime
        target = w[32:].clone()
        fam.add_delta_from_base(target, f, 32, 48, s, base=w[32:].clone())
        assert rel_err(target, ref[32:]) <= 1e-7, s
        term = fam.runtime_term(f, 32, 0, 48)
        base_out = x @ w[32:].mT
        value = (
            term.fn(x, None, base_out) * s if term.linear_in_strength else term.fn(x, None, base_out, s, 1.0)
        )
        assert rel_err(base_out + value, x @ ref[32:].mT) <= 1e-7, s


# ------------------------------------------------------------------------ fused targets (Flux qkv row chunks)


def test_fused_flux_qkv_rows():
    """OFT on a fused BFL qkv (96 rows -> to_q/to_k/to_v): blocks of 8 tile each 32-row chunk; merge equals
    the fp64 rotation of the stacked weight, runtime equals merge. Blocks that cut a chunk are refused, never
    guessed."""
    from helpers.tiny_models import flux_forward, tiny_flux

    pristine = tiny_flux()
    stem = "lora_unet_double_blocks_0_img_attn_qkv"
    g = gen(12)
    sd = {
        f"{stem}.oft_blocks": torch.randn(12, 8, 8, generator=g) * 0.3,
        f"{stem}.alpha": torch.tensor(0.0),
        f"{stem}.rescale": 1 + 0.2 * torch.randn(96, 1, generator=g),
    }
    attn = "transformer_blocks.0.attn"
    names = [f"{attn}.to_q", f"{attn}.to_k", f"{attn}.to_v"]
    s = 0.7
    rot = blockdiag_rotation(list(oft.cayley(sd[f"{stem}.oft_blocks"], 0.0, torch.float64)), s)
    stacked = torch.cat([pristine.get_submodule(n).weight.double() for n in names])
    ref = sd[f"{stem}.rescale"].double() * (rot.mT @ stacked)
    outs = {}
    for mode in ("merge", "runtime"):
        model = copy.deepcopy(pristine)
        handle = loraweave.apply(model, (sd, s), mode=mode, strict=True)
        assert handle.report.keys_applied == handle.report.keys_total == len(sd)
        x = torch.randn(3, 32, generator=gen(13))
        for i, name in enumerate(names):
            module, orig = model.get_submodule(name), pristine.get_submodule(name)
            rows = ref[32 * i : 32 * (i + 1)]
            if mode == "merge":
                assert rel_err(module.weight, rows) <= 1e-6, name
            with torch.no_grad():
                assert rel_err(module(x), F.linear(x.double(), rows, orig.bias.double())) <= TOL, (mode, name)
        with torch.no_grad():
            outs[mode] = flux_forward(model)
    assert rel_err(outs["runtime"], outs["merge"]) <= TOL
    for blocks in (
        torch.zeros(8, 12, 12),
        torch.zeros(2, 48, 48),
        torch.zeros(3, 16, 6, 6),
    ):  # cut 32-row chunks
        report = loraweave.plan(pristine, {f"{stem}.oft_blocks": blocks})
        assert reason_prefixes(report) == {"shape mismatch": 1}, report.unmatched


# ------------------------------------------------------------------------ PEFT BOFT (boft_R, boft_s)


def peft_boft(monkeypatch, butterfly: int):
    """PEFT BOFT on Linear + Conv2d with random R and s. PEFT builds N > 1 stages only with its CUDA kernel:
    the loader is stubbed (no compile attempt) and, for N > 1, the reference is PEFT's own boft_P and
    cayley_batch."""
    from peft import BOFTConfig, get_peft_model, get_peft_model_state_dict
    from peft.tuners.boft import layer as boft_layer

    monkeypatch.setattr(boft_layer, "get_fbd_cuda", lambda: object() if butterfly > 1 else None)
    pristine = lin_model()
    torch.manual_seed(14)
    cfg = BOFTConfig(
        target_modules=["fc", "cv"], boft_block_size=2, boft_n_butterfly_factor=butterfly, init_weights=False
    )
    peft_model = get_peft_model(copy.deepcopy(pristine), cfg).eval()
    sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    return pristine, peft_model, sd


@pytest.mark.parametrize("butterfly", [1, 2])
def test_peft_boft(monkeypatch, butterfly):
    pristine, peft_model, sd = peft_boft(monkeypatch, butterfly)
    assert {tuple(v.shape) for k, v in sd.items() if k.endswith("boft_R")} == {
        (butterfly, 10, 2, 2),
        (butterfly, 36, 2, 2),
    }
    xs = lin_inputs()
    refs = {}
    for name, module in pristine.items():
        layer = peft_model.base_model.model[name]
        if butterfly == 1:
            with torch.no_grad():
                refs[name] = layer(xs[name])
            continue
        r = layer.boft_R["default"].detach()
        rot = layer.cayley_batch(r.flatten(0, 1)).view(r.shape).double()
        p = layer.boft_P.double()
        m = torch.eye(p.shape[-1], dtype=torch.float64)
        for i in range(r.shape[0]):
            m = p[i] @ torch.block_diag(*rot[i]) @ p[i].mT @ m
        w = layer.boft_s["default"].detach().double().reshape(-1, 1) * (
            module.weight.double().flatten(1) @ m.mT
        )
        w = w.view_as(module.weight)
        op = F.linear if name == "fc" else lambda x, w_, b: F.conv2d(x, w_, b, padding=1)
        refs[name] = op(xs[name].double(), w, module.bias.double())
    base = outputs(pristine, xs)
    got = {}
    for mode in ("merge", "runtime"):
        model = copy.deepcopy(pristine)
        handle = loraweave.apply(model, sd, mode=mode, strict=True)
        assert handle.report.keys_applied == handle.report.keys_total == len(sd) == 4
        got[mode] = outputs(model, xs)
        for name in xs:
            assert rel_err(refs[name] - base[name], base[name]) > 0.05
            assert rel_err(got[mode][name], refs[name]) <= TOL, (
                mode,
                name,
                rel_err(got[mode][name], refs[name]),
            )
        if mode == "runtime":  # a live strength change on the runtime path
            handle.set_strength(handle.report.adapters[0]["name"], 0.5)
            half_runtime = outputs(model, xs)
        handle.remove()
    model = copy.deepcopy(pristine)
    loraweave.apply(model, sd, mode="merge", strength=0.5, strict=True)
    for name, out in outputs(model, xs).items():  # PEFT has no strength: ours interpolates; merge == runtime
        assert rel_err(half_runtime[name], out) <= TOL, name


# ------------------------------------------------------------------------ validation


def test_rejections_are_reported():
    target = lin_model()
    g = gen(15)
    cases = {
        # PEFT OFT with a LyCORIS-only companion key: never half-read
        "unsupported family": [
            {"fc.oft_R.weight": torch.randn(5, 6, generator=g), "fc.rescale": torch.ones(24, 1)}
        ],
        "shape mismatch": [
            {"fc.oft_blocks": torch.randn(5, 4, 4, generator=g)},  # 20 rows for a 24-row layer
            {"fc.oft_blocks": torch.randn(6, 4, 3, generator=g)},  # not square
            {
                "fc.oft_blocks": torch.randn(6, 4, 4, generator=g),
                "fc.oft_diag": torch.randn(6, 4, 4, generator=g),
            },
            {"fc.oft_blocks": torch.randn(6, 4, 4, generator=g), "fc.rescale": torch.ones(12, 1)},
            {"fc.oft_blocks": torch.randn(6, 4, 4, generator=g), "fc.alpha": torch.ones(2)},
            {"fc.oft_blocks": torch.randn(3, 3, 3, 3, generator=g)},  # BOFT block size must be even
            {
                "fc.boft_R": torch.randn(1, 4, 4, 4, generator=g),
                "fc.boft_s": torch.ones(24, 1),
            },  # 16 input columns
        ],
        "incomplete OFT": [{"fc.rescale": torch.ones(24, 1)}],
        "incomplete BOFT": [{"fc.boft_R": torch.randn(1, 10, 2, 2, generator=g)}],
        "bad tensor": [
            {"fc.oft_blocks": torch.full((6, 4, 4), float("nan"))},
            {"fc.oft_blocks": torch.randn(6, 4, 4, generator=g), "fc.alpha": torch.tensor(float("inf"))},
        ],
    }
    for kind, sds in cases.items():
        for sd in sds:
            report = loraweave.plan(target, sd)
            assert reason_prefixes(report) == {kind: len(sd)}, (kind, sorted(sd), report.unmatched)
    int_alpha = {
        "oft_blocks": torch.zeros(6, 4, 4),
        "alpha": torch.tensor(2),
    }  # kohya/numpy alphas: any dtype
    assert FAMILIES["oft"].load(int_alpha, {r: f"x.{r}" for r in int_alpha}).segments[0][1] == 2 * 24
    f = FAMILIES["boft"].load({"oft_blocks": torch.zeros(2, 4, 4, 4)}, {"oft_blocks": "x.oft_blocks"})
    assert type(f).__module__.endswith("boft") and f.rows == 16  # 4-D blocks: BOFT, detected before OFT
    with pytest.raises(PartRejected, match="cut a BOFT butterfly"):
        FAMILIES["boft"].host_runtime_term(f, 4, 0, 8, module=None)


def test_safetensors_round_trip_and_meta_planning(tmp_path):
    """A saved file plans on a meta-device model (shape-only, values unknown) and applies from disk."""
    sd = oft_sd(16, rescale=True) | {"fc.alpha": torch.tensor(0.01), "cv.alpha": torch.tensor(0.01)}
    path = tmp_path / "oft.safetensors"
    save_file(sd, str(path))
    with torch.device("meta"):
        meta = lin_model()
    report = loraweave.plan(meta, str(path))
    assert report.unmatched == [] and report.keys_applied == len(sd)
    assert rel_err(deltas(str(path), 0.5, "merge")["fc"], deltas(sd, 0.5, "runtime")["fc"]) <= TOL
