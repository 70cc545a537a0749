"""PEFT OFT (`oft_R.weight`): merge and runtime against PEFT 0.21 itself.

Reference = PEFT's OFT layers (peft.tuners.oft) on Linear and Conv2d with random oft_R: PEFT's forward for
Linear and 1x1 convolutions, PEFT's merge_and_unload weights for every layer. PEFT's k×k Conv2d forward
(unfold, rotate, fold) disagrees with its own merge even at R = I (shown below), so k×k convolutions are
checked against the merged weights only. Strengths other than 1 (PEFT has none) against the independent
formula W' = W·(I + s(M − I))ᵀ, M = PEFT's block-diagonal rotation. Tolerance: rel. error = max|ours − ref| /
max|ref| <= 1e-5 (fp32).

The adapter_config.json fields (use_cayley_neumann, num_cayley_neumann_terms, coft/eps, block_share) reach the
family as `load(..., config=)`: checked here at the family level, and end to end through
`loraweave.apply(model, dir)` (the planner passes the adapter's PEFT config to the family).
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import peft  # the reference must be installed: a missing package fails here, it is never skipped
import pytest
import torch
import torch.nn.functional as F
from helpers.common import reason_prefixes
from torch import nn

import loraweave
from loraweave.families import FAMILIES, peft_oft

TOL = 1e-5
LAYERS = ("lin", "blk.proj", "c1", "c3", "c3s")
FORWARD_LAYERS = ("lin", "blk.proj", "c1")  # PEFT's forward equals its merge here (no kernel taps)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Net(nn.Module):
    """Input columns (in·k) divisible by 4 and by 6, so both `oft_block_size=4` and `r=6` tile every layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(24, 20)
        self.blk = nn.Module()
        self.blk.proj = nn.Linear(24, 12, bias=False)
        self.c1 = nn.Conv2d(12, 16, 1)
        self.c3 = nn.Conv2d(4, 8, 3, padding=1)
        self.c3s = nn.Conv2d(8, 8, 3, stride=2, padding=1)


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = {
        "lin": (3, 5, 24),
        "blk.proj": (4, 24),
        "c1": (2, 12, 5, 5),
        "c3": (2, 4, 6, 6),
        "c3s": (1, 8, 7, 7),
    }
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


@torch.no_grad()
def outputs(model: nn.Module, xs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: model.get_submodule(n)(x) for n, x in xs.items()}


def make_peft(tmp_path, noise: float = 3.0, **cfg):
    """(pristine, PEFT model, saved directory). oft_R is saved before any forward (coft projects it in
    place)."""
    from peft import OFTConfig, get_peft_model

    pristine = Net()
    cfg = {"oft_block_size": 4, "r": 0} | cfg
    config = OFTConfig(target_modules=["lin", "proj", "c1", "c3", "c3s"], init_weights=False, **cfg)
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(copy.deepcopy(pristine), config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "oft_R" in name:
                p.mul_(noise)  # std 0.1·noise: large enough that the Cayley forms differ visibly
    path = tmp_path / "peft_oft"
    model.save_pretrained(str(path))
    return pristine, model, path


def peft_refs(model, xs):
    """(PEFT forward outputs on FORWARD_LAYERS, outputs of PEFT's merge_and_unload model on all layers)."""
    inner = model.base_model.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forward = {n: out for n, out in outputs(inner, xs).items() if n in FORWARD_LAYERS}
        merged = copy.deepcopy(model).merge_and_unload()
    return forward, outputs(merged, xs), merged


def check_against_peft(pristine, model, xs, apply_fn):
    forward, merged_out, _ = peft_refs(model, xs)
    base = outputs(pristine, xs)
    for mode in ("merge", "runtime"):
        target = copy.deepcopy(pristine)
        handle = apply_fn(target, mode)
        assert handle.report.keys_applied == handle.report.keys_total == len(LAYERS)
        got = outputs(target, xs)
        for name in xs:
            assert rel_err(merged_out[name] - base[name], base[name]) > 0.05, (
                name
            )  # the adapter does something
            assert rel_err(got[name], merged_out[name]) <= TOL, (
                mode,
                name,
                rel_err(got[name], merged_out[name]),
            )
            if name in forward:
                assert rel_err(got[name], forward[name]) <= TOL, (
                    mode,
                    name,
                    rel_err(got[name], forward[name]),
                )
        handle.remove()
        assert all(
            torch.equal(a, b) for a, b in zip(outputs(target, xs).values(), base.values(), strict=True)
        )


def config_of(path) -> dict:
    return json.loads((path / "adapter_config.json").read_text())


def family_apply(target: nn.Module, path, mode: str, strength: float = 1.0, config: dict | None = None):
    """The family's merge / runtime forms driven directly (what the planner does, with the config passed)."""
    from safetensors.torch import load_file

    family = FAMILIES["peft_oft"]
    config = config_of(path) if config is None else config
    hooks = []
    for key, tensor in load_file(str(path / "adapter_model.safetensors")).items():
        name = key.removeprefix("base_model.model.").removesuffix(".oft_R.weight")
        module = target.get_submodule(name)
        f = family.load_with_config({"oft_R": tensor}, {"oft_R": key}, config)
        assert family.check_target(f, tuple(module.weight.shape)) is None
        rows = module.weight.shape[0]
        if mode == "merge":
            with torch.no_grad():
                flat = module.weight.view(rows, -1)
                family.add_delta_from_base(
                    flat, f, 0, rows, strength, base=flat.clone(), strength=strength, scale=1.0
                )
            continue
        term = family.host_runtime_term(f, 0, 0, rows, module=module)
        assert term.linear_in_strength and not term.needs_base
        spec = None
        if isinstance(module, nn.Conv2d):
            from loraweave.families.base import ConvSpec

            spec = ConvSpec(
                F.conv2d, {"stride": module.stride, "padding": module.padding, "dilation": module.dilation}
            )

        def hook(mod, args, out, fn=term.fn, spec=spec):
            return out + strength * fn(args[0], spec)

        hooks.append(module.register_forward_hook(hook))
    return hooks


CONFIGS = {
    "neumann5_block4": {},  # PEFT's defaults
    "exact_block4": {"use_cayley_neumann": False},
    "neumann5_r6": {"r": 6, "oft_block_size": 0},
    "exact_r6": {"r": 6, "oft_block_size": 0, "use_cayley_neumann": False},
    "neumann2": {"num_cayley_neumann_terms": 2},
    "neumann3": {"num_cayley_neumann_terms": 3},
    "neumann4": {"num_cayley_neumann_terms": 4},
    "neumann7": {"num_cayley_neumann_terms": 7},
    "block_share": {"block_share": True},
    "block_share_exact": {"block_share": True, "use_cayley_neumann": False},
    "coft": {"coft": True, "eps": 0.05},
    "coft_exact": {"coft": True, "eps": 0.05, "use_cayley_neumann": False},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_family_matches_peft(tmp_path, name):
    """Every rotation form from adapter_config.json: merge and runtime equal PEFT's forward and merge."""
    pristine, model, path = make_peft(tmp_path, **CONFIGS[name])
    xs = inputs()

    class Handle:  # the family driven directly: no planner involved
        def __init__(self, target, mode):
            self.hooks = family_apply(target, path, mode)
            self.target, self.mode = target, mode
            self.report = type("R", (), {"keys_applied": len(LAYERS), "keys_total": len(LAYERS)})
            self.backup = {
                n: m.weight.detach().clone() for n, m in pristine.named_modules() if hasattr(m, "weight")
            }

        def remove(self):
            for h in self.hooks:
                h.remove()
            with torch.no_grad():
                for n, w in self.backup.items():
                    self.target.get_submodule(n).weight.copy_(w)

    check_against_peft(pristine, model, xs, Handle)


def test_directory_with_default_config(tmp_path):
    """loraweave.apply(model, PEFT directory): adapter_model.safetensors keys land; PEFT's default form."""
    pristine, model, path = make_peft(tmp_path)
    check_against_peft(
        pristine, model, inputs(), lambda m, mode: loraweave.apply(m, str(path), mode=mode, strict=True)
    )


@pytest.mark.parametrize("name", ["exact_r6", "neumann3", "block_share_exact", "coft"])
def test_directory_config_reaches_the_family(tmp_path, name):
    pristine, model, path = make_peft(tmp_path, **CONFIGS[name])
    check_against_peft(
        pristine, model, inputs(), lambda m, mode: loraweave.apply(m, str(path), mode=mode, strict=True)
    )


def test_inject_adapter_state_dict_without_config():
    """A bare state dict (inject_adapter_in_model + get_peft_model_state_dict): PEFT 0.21's defaults apply."""
    from peft import OFTConfig, get_peft_model_state_dict, inject_adapter_in_model

    pristine = Net()
    torch.manual_seed(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = inject_adapter_in_model(
            OFTConfig(target_modules=["lin", "c1"], oft_block_size=4, r=0, init_weights=False),
            copy.deepcopy(pristine),
        )
    sd = {k: v.detach() * 3 for k, v in get_peft_model_state_dict(model).items()}
    assert set(sd) == {"lin.oft_R.weight", "c1.oft_R.weight"}
    model.load_state_dict({k.replace(".oft_R.", ".oft_R.default."): v for k, v in sd.items()}, strict=False)
    xs = inputs()
    ref = {n: model.get_submodule(n)(xs[n]).detach() for n in ("lin", "c1")}
    for mode in ("merge", "runtime"):
        target = copy.deepcopy(pristine)
        handle = loraweave.apply(target, sd, mode=mode, strict=True)
        for n in ref:
            assert rel_err(target.get_submodule(n)(xs[n]), ref[n]) <= TOL, (mode, n)
        handle.remove()


@pytest.mark.parametrize("strength", [0.5, -1.0])
def test_strength_interpolates_the_rotation(tmp_path, strength):
    """R_s = I + s(R − I): W' = W·M_sᵀ, independent fp64 formula from PEFT's block-diagonal M; merge ==
    runtime."""
    pristine, model, path = make_peft(tmp_path)
    xs = inputs()
    refs = {}
    for name in LAYERS:
        layer = model.base_model.model.get_submodule(name)
        m = layer.get_delta_weight("default").double()
        m_s = torch.eye(m.shape[0], dtype=torch.float64) + strength * (
            m - torch.eye(m.shape[0], dtype=torch.float64)
        )
        base = pristine.get_submodule(name)
        w = (base.weight.double().flatten(1) @ m_s.mT).view_as(base.weight)
        bias = None if base.bias is None else base.bias.double()
        x = xs[name].double()
        refs[name] = (
            F.linear(x, w, bias)
            if isinstance(base, nn.Linear)
            else F.conv2d(x, w, bias, stride=base.stride, padding=base.padding)
        )
    got = {}
    for mode in ("merge", "runtime"):
        target = copy.deepcopy(pristine)
        handle = loraweave.apply(target, str(path), mode=mode, strength=strength, strict=True)
        got[mode] = outputs(target, xs)
        for name in LAYERS:
            assert rel_err(got[mode][name], refs[name]) <= TOL, (
                mode,
                name,
                rel_err(got[mode][name], refs[name]),
            )
        if mode == "runtime":  # a live strength change on the runtime path: back to PEFT at s = 1
            handle.set_strength(handle.report.adapters[0]["name"], 1.0)
            forward, _, _ = peft_refs(model, xs)
            for name, out in outputs(target, xs).items():
                if name in forward:
                    assert rel_err(out, forward[name]) <= TOL, name
        handle.remove()


def test_peft_conv_forward_against_its_merge():
    """Why k×k convolutions follow PEFT's merge: PEFT 0.21's Conv2d forward is not the identity at R = I; from
    0.22 its forward is, and it equals the merge at any R (so following the merge follows both)."""
    from packaging.version import Version
    from peft import OFTConfig, get_peft_model

    pristine = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1))
    x = torch.randn(2, 4, 7, 7, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            copy.deepcopy(pristine), OFTConfig(target_modules=["0"], oft_block_size=4, r=0)
        )
    with torch.no_grad():
        assert rel_err(copy.deepcopy(model).merge_and_unload()(x), pristine(x)) <= TOL
        if Version(peft.__version__) < Version("0.22"):
            assert rel_err(model(x), pristine(x)) > 0.5  # identity init, yet the output changes
            return
        assert rel_err(model(x), pristine(x)) <= TOL
        for name, param in model.named_parameters():
            if "oft_R" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
        merged = copy.deepcopy(model).merge_and_unload()
        assert rel_err(model(x), pristine(x)) > 0.05  # R moved the output
        assert rel_err(model(x), merged(x)) <= TOL


def test_legacy_neumann_series_before_peft_018():
    """peft_version < 0.18 (or missing in an OFT config): R = I + Σ_{k=1}^{t−1} 2Q^k, independent fp64
    formula."""
    g = torch.Generator().manual_seed(3)
    vec = torch.randn(6, 6, generator=g) * 0.3
    w = torch.randn(5, 24, generator=g)
    q = torch.zeros(6, 4, 4, dtype=torch.float64)
    iu = torch.triu_indices(4, 4, 1)
    q[:, iu[0], iu[1]] = vec.double()
    q = q - q.mT
    eye = torch.eye(4, dtype=torch.float64)
    for terms, version in ((5, "0.17.1"), (4, None), (3, "0.15.0")):
        r = eye + sum(2 * torch.linalg.matrix_power(q, k) for k in range(1, terms))
        ref = w.double() @ torch.block_diag(*r).mT
        cfg = {
            "peft_type": "OFT",
            "oft_block_size": 4,
            "use_cayley_neumann": True,
            "num_cayley_neumann_terms": terms,
        }
        if version:
            cfg["peft_version"] = version
        f = FAMILIES["peft_oft"].load_with_config({"oft_R": vec}, {"oft_R": "x.oft_R.weight"}, cfg)
        assert f.legacy_series and "PEFT < 0.18" in f.form
        out = w.clone()
        FAMILIES["peft_oft"].add_delta_from_base(out, f, 0, 5, 1.0, base=w.clone())
        assert rel_err(out, ref) <= TOL, terms
    cfg |= {"peft_version": "0.18.0"}
    assert not FAMILIES["peft_oft"].load_with_config({"oft_R": vec}, {"oft_R": "k"}, cfg).legacy_series


def test_row_pieces_land_independently():
    """The input rotation is row-local: any slice of output rows (a fused key split over modules) is exact."""
    g = torch.Generator().manual_seed(4)
    f = FAMILIES["peft_oft"].load({"oft_R": torch.randn(6, 6, generator=g)}, {"oft_R": "k"})
    w = torch.randn(10, 24, generator=g)
    full = w.clone()
    FAMILIES["peft_oft"].add_delta_from_base(full, f, 0, 10, 0.7, base=w)
    assert FAMILIES["peft_oft"].check_piece(f, 3, 5) is None and f.rows is None
    part = w[3:8].clone()
    FAMILIES["peft_oft"].add_delta_from_base(part, f, 3, 5, 0.7, base=w[3:8])
    assert rel_err(part, full[3:8]) <= 1e-7


def test_rejections_and_config_handling():
    target = Net()
    g = torch.Generator().manual_seed(5)
    cases = {
        "shape mismatch": [
            {"lin.oft_R.weight": torch.randn(5, 6, generator=g)},  # 5 blocks of 4 = 20 columns, layer has 24
            {"lin.oft_R.weight": torch.randn(6, 5, generator=g)},  # 5 is not b(b-1)/2
            {
                "lin.oft_R.weight": torch.randn(1, 10, generator=g)
            },  # shared block of 5 does not tile 24 columns
            {"lin.oft_R.weight": torch.randn(6, 6, 1, generator=g)},
        ],
        "unsupported family": [
            {"lin.oft_R.weight": torch.randn(6, 6, generator=g), "lin.rescale": torch.ones(20, 1)}
        ],
        "bad tensor": [{"lin.oft_R.weight": torch.full((6, 6), float("nan"))}],
    }
    for kind, sds in cases.items():
        for sd in sds:
            report = loraweave.plan(target, sd)
            assert reason_prefixes(report) == {kind: len(sd)}, (kind, sorted(sd), report.unmatched)
    shared = loraweave.plan(target, {"c3.oft_R.weight": torch.randn(1, 6, generator=g)})  # one block, 9 uses
    assert shared.unmatched == [] and shared.keys_applied == 1
    load, key = FAMILIES["peft_oft"].load, {"oft_R": "x.oft_R.weight"}
    vec = {"oft_R": torch.randn(6, 6, generator=g)}
    with pytest.raises(peft_oft.PartRejected, match="before PEFT 0.14"):
        load(vec, key, config={"peft_type": "OFT", "r": 8})
    with pytest.raises(peft_oft.PartRejected, match="block_share"):
        load(vec, key, config={"peft_type": "OFT", "oft_block_size": 4, "block_share": True})
    with pytest.raises(peft_oft.PartRejected, match="components disagree"):
        load(vec, key, config={"unet.use_cayley_neumann": True, "text_encoder.use_cayley_neumann": False})
    prefixed = load(
        vec, key, config={"transformer.use_cayley_neumann": False, "transformer.peft_version": "0.21.0"}
    )
    assert prefixed.neumann_terms is None  # diffusers-style component prefixes are read
    lora_cfg = load(vec, key, config={"peft_type": "LORA", "r": 4, "lora_alpha": 4})
    assert lora_cfg.neumann_terms == 5 and "defaults" in lora_cfg.form and not lora_cfg.legacy_series
    assert "no adapter config" in load(vec, key).form


def test_meta_planning_and_runtime_refusals(tmp_path):
    """A PEFT directory plans on a meta-device model; the runtime path refuses a weight it cannot read."""
    _, _, path = make_peft(tmp_path)
    with torch.device("meta"):
        meta = Net()
    report = loraweave.plan(meta, str(path))
    assert report.unmatched == [] and report.keys_applied == len(LAYERS)
    f = FAMILIES["peft_oft"].load({"oft_R": torch.zeros(6, 6)}, {"oft_R": "k"})
    with pytest.raises(peft_oft.PartRejected, match="offloaded"):
        FAMILIES["peft_oft"].host_runtime_term(f, 0, 0, 20, module=meta.lin)
    with pytest.raises(peft_oft.PartRejected, match="host module"):
        FAMILIES["peft_oft"].host_runtime_term(f, 0, 0, 20, module=None)


def test_runtime_dtype_and_cost(tmp_path):
    """bf16 layers on the runtime path stay close to the fp32 merge; the report names the rotation form."""
    pristine, _, path = make_peft(tmp_path)
    xs = inputs()
    ref_model = copy.deepcopy(pristine)
    loraweave.apply(ref_model, str(path), mode="merge", strict=True)
    ref = outputs(ref_model, xs)
    target = copy.deepcopy(pristine).to(torch.bfloat16)
    handle = loraweave.apply(target, str(path), mode="runtime", strict=True)
    got = outputs(target, {n: x.to(torch.bfloat16) for n, x in xs.items()})
    for name in LAYERS:
        assert rel_err(got[name].float(), ref[name]) <= 2e-2, name
    costs = " ".join(m.cost for m in handle.report.applied)
    assert "input rotation" in costs and "dense ΔW cached" in costs and "Cayley-Neumann, 5 terms" in costs
    assert not math.isnan(sum(float(o.float().sum()) for o in got.values()))
