"""The pack on GGUF models as ComfyUI-GGUF loads them (../shared/quantized/ComfyUI-GGUF, in place): a Flux
(hidden 256) and an SD1.5 UNet (320 channels) written here with gguf.GGUFWriter in Q8_0, Q4_K, Q4_0, Q5_K and
F16 rows (helpers/comfy_gguf.py: the gguf package quantizes Q8_0/Q4_0 in numpy; Q4_K/Q5_K are packed there and
read back by gguf's own dequantizer), loaded by `UnetLoaderGGUF`. Runs on both ComfyUI trees.

- auto = runtime for LoRA, LoKr, LoHa, DoRA, OFT: each layer's output equals the GGUF base's own output (the
  layer's forward before the adapter, i.e. its own dequantized weight) plus the exact adapter term, computed
  in fp64 by loraweave's merge on a float64 copy of that dequantized weight. Bound: |ours − ref| ≤
  2⁻²⁰·max|ref| per layer (fp32 roundings of the term and of the one add; the base's own rounding is in
  both sides). Every GGML tensor's bytes are unchanged while applied and after.
- No per-step re-patch: counted ComfyUI-GGUF dequantizations (ops.dequantize_tensor) and patch applications
  (comfy.lora.calculate_weight) per forward of the whole model: ours adds no dequantization and no patch;
  core's LoraLoader re-applies every patched GGML weight at every forward.
- merge: ComfyUI's patch list, applied by GGMLOps at every forward (it cannot requantize): exact as well, the
  blocks unchanged, and each report row names the backend, why, and the ρ it keeps in the compute dtype.
- Hostile: a tensor whose bytes do not hold its declared shape loads in ComfyUI-GGUF (and fails inside torch
  at forward); the pack refuses it with QuantizedWeightError naming the layer, the model unchanged."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import comfy_gguf as cg
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, dotted, target_linears

import loraweave
from loraweave.comfy import load_lora_for_models
from loraweave.errors import QuantizedWeightError

pytestmark = pytest.mark.comfy
FAMILIES = ("lora", "lokr", "loha", "dora", "oft")
STRENGTH = 0.8
REL_BOUND = 2.0**-20


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    model, types, _ = cg.flux_gguf(tmp_path_factory.mktemp("gguf"))
    return model, types


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    return cg.sd15_gguf(tmp_path_factory.mktemp("gguf_sd"))


def targets(model) -> dict[str, torch.nn.Module]:
    """The block linears of the model (attention, MLP, fused qkv / linear1): GGML layers of every type."""
    dm = model.model.diffusion_model
    return {n: m for n, m in target_linears(dm).items() if "blocks" in n}


def flux_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 16, 4, 4, generator=g),
        torch.tensor([0.7]),
        torch.randn(1, 5, 32, generator=g),
        torch.randn(1, 32, generator=g),
    )


def flux_forward(dm) -> torch.Tensor:
    x, t, ctx, y = flux_inputs()
    with torch.no_grad():
        return dm(x, t, ctx, y=y, guidance=torch.tensor([3.5]))


class Tree(torch.nn.Module):
    """Float64 linears at the given dotted paths (intermediate containers made as needed)."""

    def __init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        super().__init__()
        for path, (w, b) in weights.items():
            parent: torch.nn.Module = self
            *heads, leaf = path.split(".")
            for h in heads:
                if not hasattr(parent, h):
                    parent.add_module(h, torch.nn.Module())
                parent = getattr(parent, h)
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=torch.float64)
            with torch.no_grad():
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            parent.add_module(leaf, lin)


def fp64_deltas(layers: dict[str, torch.nn.Module], sd: dict) -> dict[str, torch.Tensor]:
    """{path: W' − W} in fp64: loraweave's merge of `sd` on float64 copies of each layer's own dequantized
    weight (so DoRA's norm and OFT's rotation see the GGUF base itself)."""
    base = {n: (cg.layer_weight(m).double(), None) for n, m in layers.items()}
    tree = Tree(base)
    plain = {k.removeprefix("diffusion_model."): v for k, v in sd.items()}
    loraweave.apply(tree, plain, mode="merge", strength=STRENGTH)
    return {n: tree.get_submodule(n).weight.detach() - base[n][0] for n in layers}


def layer_outputs(layers: dict[str, torch.nn.Module], inputs: dict[str, torch.Tensor]):
    with torch.no_grad():
        return {n: m(inputs[n]).clone() for n, m in layers.items()}


def check_exact(model_with, base_model, sd: dict, only_quantized: bool = False) -> int:
    """Each target layer's output with the adapter loaded equals its base output + x·(W' − W)ᵀ (fp64); the
    GGML bytes are unchanged while loaded and after (`only_quantized`: only the quantized layers are
    checked while loaded, as a merge rounds an F16 row into a patched copy). Returns the layers checked."""
    c = import_comfy()
    layers = {n: m for n, m in targets(base_model).items() if cg.is_ggml(m) or not only_quantized}
    g = torch.Generator().manual_seed(3)
    inputs = {n: torch.randn(2, 3, m.in_features, generator=g) for n, m in layers.items()}
    before = cg.storage_bytes(base_model)
    base_out = layer_outputs(layers, inputs)
    deltas = fp64_deltas(layers, sd)
    c.model_management.load_models_gpu([model_with])
    try:
        ours = layer_outputs(layers, inputs)
        during = cg.storage_bytes(base_model)
        kept = {k for k in before if not only_quantized or cg.is_ggml(owner(base_model, k))}
        assert_bytes_equal({k: before[k] for k in kept}, {k: during[k] for k in kept})
    finally:
        c.model_management.unload_all_models()
        model_with.detach(unpatch_all=True)
    assert_bytes_equal(before, cg.storage_bytes(base_model))
    for n in layers:
        ref = base_out[n].double() + inputs[n].double() @ deltas[n].T
        err = (ours[n].double() - ref).abs().max().item()
        term = (ref - base_out[n].double()).abs().max().item()
        assert term > 100 * REL_BOUND * ref.abs().max().item(), f"{n}: the adapter term is too small to test"
        assert err <= REL_BOUND * ref.abs().max().item(), (n, err, ref.abs().max().item())
    return len(layers)


def owner(model, key: str) -> torch.nn.Module:
    return model.model.diffusion_model.get_submodule(key.rsplit(".", 1)[0])


def assert_bytes_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert not changed, changed[:5]


def test_files_hold_every_type_and_k_quants_read_back(flux, sd15, tmp_path):
    """The Flux file holds every type the issue names; pack_k's Q4_K/Q5_K blocks dequantize (gguf's numpy
    dequantizer, the layout's oracle) to the nearest level of each sub-block's grid: within half a step."""
    _, types = flux
    assert {"Q8_0", "Q4_K", "Q4_0", "Q5_K", "F16"} <= set(types.values()), types
    sd_types = {int(m.weight.tensor_type) for m in sd15.model.diffusion_model.modules() if cg.is_ggml(m)}
    assert len(sd_types) >= 3, sd_types
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    for qtype, levels in (("Q4_K", 15), ("Q5_K", 31)):
        back = cg.dequantize(cg.quantize(w, qtype), qtype).reshape(-1, 32)
        sub = w.reshape(-1, 32)
        step = (sub.max(1) - np.minimum(sub.min(1), 0)) / levels
        # fp16 d/dmin and 6-bit scales move each grid by up to 1/63 of its range beyond the half step
        assert (np.abs(back - sub) <= (0.5 + 1 / 63 * levels) * step[:, None] + 1e-6).all(), qtype
        assert np.abs(back - sub).max() > 0  # a lossy grid: the check would notice a pass-through


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_runs_every_family_at_runtime_exact_on_flux(flux, family):
    model, _ = flux
    sd = adapter_file(targets(model), family, dotted("diffusion_model."))
    ours, _, report = load_lora_for_models(model, None, sd, STRENGTH, 0.0)  # auto
    assert report.mode == "runtime" and report.keys_applied == report.keys_total == len(sd)
    rows = {r.module: r for r in report.applied}
    assert set(rows) == set(targets(model))
    ggml = [r for r in rows.values() if r.backend == "comfy_gguf"]
    assert len(ggml) == len(rows), [r.module for r in rows.values() if r.backend != "comfy_gguf"]
    assert all("no per-step patch" in r.why for r in ggml)
    assert check_exact(ours, model, sd) == len(rows)


@pytest.mark.parametrize("family", ("lora", "dora", "oft"))
def test_auto_runtime_exact_on_sd15(sd15, family):
    sd = adapter_file(targets(sd15), family, dotted("diffusion_model."))
    ours, _, report = load_lora_for_models(sd15, None, sd, STRENGTH, 0.0)
    assert report.mode == "runtime" and report.keys_applied == report.keys_total == len(sd)
    assert check_exact(ours, sd15, sd) >= 8


def counted_forward(model, steps: int = 2) -> tuple[int, int, torch.Tensor]:
    """(dequantizations, patch applications) per forward of the whole model, and its output."""
    c = import_comfy()
    c.model_management.load_models_gpu([model])
    try:
        with cg.CallCounter() as counter:
            for _ in range(steps):
                out = flux_forward(model.model.diffusion_model)
    finally:
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)
    assert counter.dequantize % steps == 0 and counter.patch % steps == 0
    return counter.dequantize // steps, counter.patch // steps, out


def test_no_per_step_repatch_against_core(flux):
    """Per forward: ComfyUI-GGUF dequantizes each quantized layer (and its bias) once whatever the LoRA;
    core's LoraLoader also runs calculate_weight on every patched quantized weight, ours on none (the GGML
    patch list stays empty). The whole model's output: ours equals core's within fp32 rounding."""
    c = import_comfy()
    model, _ = flux
    layers = targets(model)
    sd = adapter_file(layers, "lora", dotted("diffusion_model."))
    quantized = sum(1 for m in layers.values() if cg.is_ggml(m))
    assert quantized >= 8
    base_deq, base_patch, base_out = counted_forward(model)
    ours_model, _, report = load_lora_for_models(model, None, sd, STRENGTH, 0.0)
    assert report.mode == "runtime"
    core_model, _ = c.sd.load_lora_for_models(model, None, sd, STRENGTH, 0.0)
    ours_deq, ours_patch, ours_out = counted_forward(ours_model)
    core_deq, core_patch, core_out = counted_forward(core_model)
    # get_weight runs dequantize_tensor on a quantized layer's weight and on its (F32) bias
    per_forward = sum(1 + (m.bias is not None) for m in cg.ggml_layers(model).values())
    assert base_patch == 0 and base_deq == per_forward
    assert (ours_deq, ours_patch) == (base_deq, 0)
    assert core_deq == base_deq and core_patch == quantized, (core_deq, core_patch, quantized)
    assert (ours_out - base_out).abs().max() > 1e-3  # the LoRA changes the output
    assert torch.allclose(ours_out, core_out, rtol=1e-4, atol=1e-4 * core_out.abs().max().item())


def test_merge_goes_through_the_patch_list_exact_and_reports_it(flux):
    """mode=merge on a GGUF model: ComfyUI's patch list, applied by GGMLOps at forward (ComfyUI-GGUF cannot
    requantize); exact within the same bound, blocks unchanged; each GGML row says so, ρ = 1 in fp32. The
    F16 row is merged by ComfyUI-GGUF as core merges (a patched F16 copy while loaded): its ρ is that
    rounding's."""
    model, _ = flux
    sd = adapter_file(targets(model), "lokr", dotted("diffusion_model."))
    merged, _, report = load_lora_for_models(model, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.mode == "merge" and report.keys_applied == report.keys_total == len(sd)
    rows = [r for r in report.applied if r.backend == "comfy_gguf"]
    assert len(rows) == len(report.applied) == len(targets(model))
    quantized = [r for r in rows if cg.is_ggml(targets(model)[r.module])]
    f16 = [r for r in rows if r not in quantized]
    assert len(f16) == 1 and "F16" in f16[0].why and 0.9 < f16[0].retention < 1.0, f16
    assert all("every forward" in r.why and abs(r.retention - 1.0) < 1e-6 for r in quantized)
    as_dict = report.to_dict()
    assert all(r["backend"] == "comfy_gguf" and r["retention"] is not None for r in as_dict["applied"])
    assert check_exact(merged, model, sd, only_quantized=True) == len(quantized)
    _, patches, _ = counted_forward(merged)
    assert patches == sum(1 for m in targets(model).values() if cg.is_ggml(m))


def test_bf16_merge_retention_is_measured_below_one(flux):
    """The report's ρ is measured, not assumed: in bf16 compute GGMLOps rounds W + ΔW to bf16."""
    from loraweave.comfy.gguf_weights import patched_retention

    model, _ = flux
    layers = targets(model)
    sd = adapter_file(layers, "lora", dotted("diffusion_model."))
    merged, _, _ = load_lora_for_models(model, None, sd, STRENGTH * 0.01, 0.0, mode="merge")
    name = "double_blocks.0.img_attn.qkv"
    key = f"diffusion_model.{name}.weight"
    rho16 = patched_retention(layers[name], merged.patches[key], key, torch.bfloat16)
    rho32 = patched_retention(layers[name], merged.patches[key], key, torch.float32)
    assert rho32 == pytest.approx(1.0, abs=1e-6) and 0.0 < rho16 < 0.999, (rho16, rho32)


def test_wrong_block_size_is_a_typed_error_naming_the_layer(tmp_path):
    """img_attn.proj's bytes hold 256 x 224 Q4_0 values while its orig_shape says 256 x 256: ComfyUI-GGUF
    loads it (its forward then fails inside torch); the pack refuses with the layer named, in both modes,
    the model unchanged."""
    c = import_comfy()
    state = cg.flux_state_dict_gguf()
    bad = "double_blocks.0.img_attn.proj.weight"
    tensors = {}
    for key, tensor in state.items():
        data = tensor.numpy()
        if key == bad:
            tensors[key] = (cg.quantize(data[:, :224], "Q4_0"), "Q4_0")
        elif data.ndim == 2 and data.shape[1] % 32 == 0 and data.size > 1024:
            tensors[key] = (cg.quantize(data, "Q8_0"), "Q8_0")
        else:
            tensors[key] = (data.astype(np.float32), "F32")
    path = tmp_path / "bad.gguf"
    cg.write_raw(path, "flux", tensors, {bad: (256, 256)})
    model = cg.load_gguf(path)  # ComfyUI-GGUF takes the file
    layer = model.model.diffusion_model.get_submodule(bad.removesuffix(".weight"))
    assert tuple(layer.weight.shape) == (256, 256)
    with pytest.raises(RuntimeError):  # what a forward does with it
        layer(torch.randn(1, 256))
    sd = adapter_file(targets(model), "lora", dotted("diffusion_model."))
    before = cg.storage_bytes(model)
    for mode in ("auto", "merge"):
        with pytest.raises(QuantizedWeightError, match=r"diffusion_model\.double_blocks\.0\.img_attn\.proj"):
            load_lora_for_models(model, None, copy.copy(sd), STRENGTH, 0.0, mode=mode)
    assert_bytes_equal(before, cg.storage_bytes(model))
    assert not model.patches and not model.get_attachment("loraweave")
    c.model_management.unload_all_models()


def test_diffusers_named_lora_lands_through_the_reference_tree(flux):
    """A PEFT (diffusers-named) Flux LoRA needs the reference tree at the model's widths, matched by shapes:
    the GGML layers' logical shapes (not the stand-ins of their storage that ComfyUI-GGUF's state_dict
    gives) make it fit. to_q lands on the first third of the Q4_K fused qkv, proj_out on the Q5_K linear2;
    the outputs equal those of the same factors written on ComfyUI's names (q rows of up, the rest zero)."""
    model, _ = flux
    g = torch.Generator().manual_seed(9)
    r = 4
    a_q, b_q = torch.randn(r, 256, generator=g) * 0.1, torch.randn(256, r, generator=g) * 0.1
    a_o, b_o = torch.randn(r, 1280, generator=g) * 0.1, torch.randn(256, r, generator=g) * 0.1
    peft = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a_q,
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": b_q,
        "transformer.single_transformer_blocks.0.proj_out.lora_A.weight": a_o,
        "transformer.single_transformer_blocks.0.proj_out.lora_B.weight": b_o,
    }
    qkv, out = "diffusion_model.double_blocks.0.img_attn.qkv", "diffusion_model.single_blocks.0.linear2"
    comfy_named = {
        f"{qkv}.lora_down.weight": a_q,
        f"{qkv}.lora_up.weight": torch.cat([b_q, torch.zeros(512, r)]),
        f"{qkv}.alpha": torch.tensor(float(r)),
        f"{out}.lora_down.weight": a_o,
        f"{out}.lora_up.weight": b_o,
        f"{out}.alpha": torch.tensor(float(r)),
    }
    c = import_comfy()
    layers = {n: model.model.diffusion_model.get_submodule(n) for n in (qkv[16:], out[16:])}
    x = {n: torch.randn(3, m.in_features, generator=g) for n, m in layers.items()}
    outputs = []
    for sd in (peft, comfy_named):
        ours, _, report = load_lora_for_models(model, None, sd, STRENGTH, 0.0)
        assert report.keys_applied == report.keys_total == len(sd), report.kinds()
        c.model_management.load_models_gpu([ours])
        try:
            outputs.append(layer_outputs(layers, x))
        finally:
            c.model_management.unload_all_models()
            ours.detach(unpatch_all=True)
    base = layer_outputs(layers, x)
    for n in layers:
        assert (outputs[0][n] - base[n]).abs().max() > 1e-3
        torch.testing.assert_close(outputs[0][n], outputs[1][n], rtol=1e-6, atol=1e-6)


def test_locon_on_reshaped_q8_convs_of_sd15(sd15):
    """LoCon on the SD1.5 3x3 convolutions, whose Q8_0 blocks are stored as (n/256, 256) rows under
    `comfy.gguf.orig_shape` (the runtime path takes the kernel dims from the logical shape): each conv's
    output equals its own output + conv(x, s·ΔW) in fp64, per element within 2⁻²²·|ref| plus the fp32
    accumulation bound √(in·k² + r)·2⁻²⁴·s·conv(conv(|x|, |down|), |up|) (the 3x3 convs sum 2880 products,
    so a bound on max|ref| alone would not hold); bytes unchanged."""
    c = import_comfy()
    dm = sd15.model.diffusion_model
    convs = {
        n: m
        for n, m in dm.named_modules()
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3) and cg.is_ggml(m)
    }
    assert len(convs) >= 4
    g = torch.Generator().manual_seed(21)
    sd: dict[str, torch.Tensor] = {}
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for n, m in convs.items():
        out, inp, kh, kw = m.weight.shape
        down, up = torch.randn(2, inp, kh, kw, generator=g) * 0.05, torch.randn(out, 2, 1, 1, generator=g)
        stem = f"diffusion_model.{n}"
        sd |= {
            f"{stem}.lora_down.weight": down,
            f"{stem}.lora_up.weight": up,
            f"{stem}.alpha": torch.tensor(1.0),
        }
        deltas[n] = (down.double(), up.double())
    x = {n: torch.randn(1, m.in_channels, 8, 8, generator=g) for n, m in convs.items()}
    before = cg.storage_bytes(sd15)
    with torch.no_grad():
        base = {n: m(x[n]) for n, m in convs.items()}
    ours, _, report = load_lora_for_models(sd15, None, sd, STRENGTH, 0.0)
    assert report.mode == "runtime" and report.keys_applied == report.keys_total == len(sd)
    c.model_management.load_models_gpu([ours])
    try:
        with torch.no_grad():
            got = {n: m(x[n]) for n, m in convs.items()}
        assert_bytes_equal(before, cg.storage_bytes(sd15))
    finally:
        c.model_management.unload_all_models()
        ours.detach(unpatch_all=True)
    assert_bytes_equal(before, cg.storage_bytes(sd15))
    conv = torch.nn.functional.conv2d
    s = STRENGTH * 1.0 / 2  # strength · alpha / rank
    for n, m in convs.items():
        down, up = deltas[n]
        x64 = x[n].double()
        term = s * conv(conv(x64, down, None, m.stride, m.padding), up)
        ref = base[n].double() + term
        magnitude = s * conv(conv(x64.abs(), down.abs(), None, m.stride, m.padding), up.abs())
        bound = 2.0**-22 * ref.abs() + (down[0].numel() + 2) ** 0.5 * 2.0**-24 * magnitude
        assert (got[n].double() - ref).abs().le(bound).all(), n
        assert (term.abs() > bound).float().mean() > 0.5  # the term exceeds the bound: the check can fail
