"""Two ComfyUI-pack mechanisms that ran only on tiny models, at the width Flux.1 users load (hidden 3072,
bf16), on ComfyUI's own full-size Flux built on the meta device, one layer materialized at a time (helpers/
realsize_comfy.py):

- Runtime mode borrowing the factors of a file read whole. The pack reads a LoRA file whole into memory of its
  own (`load_adapter(read=True)`: `SafetensorsFile.owned`), and a RuntimePath keeps such factors as they are
  (views, no copy) where one pair covers the layer (a kohya fused `single_blocks.0.linear1` /
  `double_blocks.0.img_attn. qkv` LoRA: one down, its up split over the q|k|v(|mlp) row ranges); from a mapped
  file it copies them once. Checked: every tensor of the FactorHolder (what ComfyUI's model management counts
  and moves) that is not the path's own scale vector is the file's memory (same data pointers, nothing else
  held); a mapped file's factors are held exactly once (bytes = the file's factor bytes, none of them the
  mapping's). The layer's runtime output equals the merged weight's output x·(W + s·B·A)ᵀ + b computed in
  fp64, to 2 bf16 ulp of |y| + |s·B·A·x| (the base GEMM's and the final add's roundings), 4 bf16 eps of the
  largest |s·B·A·x| (the term's own roundings) and √fan_in·2⁻²⁴ of |x|·|W|ᵀ + |s|·|B|·|A|·|x| (fp32
  accumulation); the term exceeds that bound on most elements, so the check can fail.
- The ComfyUI subclass mapping (`comfy_arch` walks the model config's MRO): ComfyUI's FluxInpaint (Flux Fill,
  384 input channels) at full width. A diffusers-named (PEFT) LoRA on x_embedder (3072x384, Fill's own width),
  the double block's to_q/to_k/to_v (one fused qkv, three offsets), a single block's to_q and proj_mlp
  (linear1, two offsets) and proj_out (linear2), norm_out.linear (adaLN_modulation.1, its halves swapped) and
  the final proj_out lands on every one of those ComfyUI Linears, and core's LoraLoader lands the same file on
  the same keys. Each merged weight equals core's bit for bit, both as ComfyUI's fp32 `calculate_weight`
  result and as the bf16 weight `patch_weight_to_device` returns; the fp32 result equals W + s·ΔW in fp64
  within 1e-6 relative (Frobenius norm, every 97th row, the last and both ends of every offset range)."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.realsize import LoraFactors, RealLayer, lora_for, sample_rows, ulp
from helpers.realsize_comfy import comfy_layer, meta_flux_patcher
from safetensors.torch import save_file

from loraweave.comfy import load_lora_for_models
from loraweave.comfy.runtime import KEY, apply_runtime
from loraweave.formats.adapter import load_adapter

pytestmark = [pytest.mark.realsize, pytest.mark.comfy, pytest.mark.usefixtures("one_thread")]
HIDDEN, MLP = 3072, 12288
SEED = 29
STRENGTH = 0.8
RANK, ALPHA = 16, 8.0  # s = STRENGTH · ALPHA / RANK
REL_TOL = 1e-6
FUSED_ROWS = {"single_blocks.0.linear1": 3 * HIDDEN + MLP, "double_blocks.0.img_attn.qkv": 3 * HIDDEN}


@pytest.fixture(scope="module")
def flux():
    return meta_flux_patcher(torch.bfloat16)


def kohya_fused(module: str, seed: int) -> tuple[dict[str, torch.Tensor], LoraFactors]:
    """A kohya LoRA on the whole fused `module` (one down, one up over every row), bf16 as trainers save
    it."""
    lora = lora_for(RealLayer("flux", module, (FUSED_ROWS[module], HIDDEN)), rank=RANK, seed=seed)
    lora = LoraFactors(lora.a.bfloat16(), lora.b.bfloat16())
    stem = "lora_unet_" + module.replace(".", "_")
    sd = {
        f"{stem}.lora_down.weight": lora.a,
        f"{stem}.lora_up.weight": lora.b,
        f"{stem}.alpha": torch.tensor(ALPHA),
    }
    return sd, lora


def runtime_path(flux, path):
    """(the clone, its one RuntimePath, its FactorHolder) of the file at `path` read as `read` says."""
    model, _, report = apply_runtime(flux, None, path, STRENGTH, 0.0)
    assert report.keys_applied == report.keys_total == 3, report.summary()
    state = model.get_attachment(KEY)
    (rp,) = state.paths
    return model, rp, state.holder


def output64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, lora: LoraFactors, s: float):
    """(y = x·(W + s·B·A)ᵀ + b, s·B·A·x, the fp32 accumulation bound, 2·ulp-scale |y| + |term|) in fp64, W
    converted 4096 rows at a time."""
    x64 = x.double().reshape(-1, x.shape[-1])
    a, b = lora.a.double(), lora.b.double()
    term = s * (x64 @ a.T) @ b.T
    base = torch.empty_like(term)
    magnitude = torch.empty_like(term)
    for start in range(0, weight.shape[0], 4096):
        w = weight[start : start + 4096].double()
        base[:, start : start + 4096] = x64 @ w.T
        magnitude[:, start : start + 4096] = x64.abs() @ w.abs().T
    base += bias.double()
    magnitude += abs(s) * (x64.abs() @ a.abs().T) @ b.abs().T
    accumulation = x.shape[-1] ** 0.5 * 2.0**-24 * magnitude
    return base + term, term, accumulation


@pytest.mark.parametrize("module", list(FUSED_ROWS))
def test_runtime_borrows_a_file_read_whole_and_equals_the_merged_output(flux, tmp_path, module):
    sd, lora = kohya_fused(module, SEED)
    path = tmp_path / "fused.safetensors"
    save_file(sd, str(path))
    down_key, up_key = (k for k in sd if not k.endswith(".alpha"))
    owned, mapped = load_adapter(path, read=True), load_adapter(path)
    assert owned.source.owned and not mapped.source.owned
    file_bytes = sum(t.numel() * t.element_size() for t in (lora.a, lora.b))

    # read whole: the holder's pair is the file's memory (the same pointers), nothing else is held but the
    # scales
    _, rp, holder = runtime_path(flux, owned)
    file_ptrs = {owned.source.get(k).data_ptr() for k in (down_key, up_key)}
    assert {rp.down.data_ptr(), rp.up.data_ptr()} == file_ptrs, "the runtime path copied a file read whole"
    held = {p.data_ptr(): p for p in holder.parameters()}
    assert set(held) == file_ptrs | {rp.scale.data_ptr()}
    assert (
        rp.scale.numel() == RANK
        and sum(p.numel() * p.element_size() for p in held.values()) == file_bytes + 4 * RANK
    )

    # mapped: one copy, made once (pointers outside the mapping, bytes exactly the factors')
    _, rp_mapped, holder_mapped = runtime_path(flux, mapped)
    mapped_ptrs = {mapped.source.get(k).data_ptr() for k in (down_key, up_key)}
    pair = [rp_mapped.down, rp_mapped.up]
    assert not {t.data_ptr() for t in pair} & mapped_ptrs, "a mapped file's factors were borrowed"
    assert sum(t.numel() * t.element_size() for t in pair) == file_bytes
    assert {p.data_ptr() for p in holder_mapped.parameters()} == {
        t.data_ptr() for t in (*pair, rp_mapped.scale)
    }
    assert torch.equal(rp_mapped.down, lora.a) and torch.equal(rp_mapped.up, lora.b)

    s = STRENGTH * ALPHA / RANK
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(2, 3, HIDDEN, generator=g).bfloat16()
    with comfy_layer(flux, module, SEED) as weight, torch.no_grad():
        layer = flux.model.diffusion_model.get_submodule(module)
        want, term, accumulation = output64(x, weight.detach(), layer.bias.detach(), lora, s)
        tol = 2 * ulp(want.abs() + term.abs(), torch.bfloat16) + 4 * 2.0**-8 * term.abs().max() + accumulation
        assert float((term.abs() > tol).double().mean()) > 0.5, (
            "the adapter is below the tolerance: a void check"
        )
        for what, path_ in (("read whole", rp), ("mapped", rp_mapped)):
            path_.attach()
            try:
                got = layer(x).double().reshape(want.shape)
            finally:
                path_.detach()
            err = (got - want).abs()
            assert bool((err <= tol).all()), (
                f"{module} ({what}): worst |err| - tol = {float((err - tol).max()):.3g}"
            )
        assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, layer.bias)), "the path stayed on"


# Flux Fill: diffusers module -> (ComfyUI module, first row of its range there, rows, fan_in)
FILL = {
    "x_embedder": ("img_in", 0, HIDDEN, 384),
    "transformer_blocks.0.attn.to_q": ("double_blocks.0.img_attn.qkv", 0, HIDDEN, HIDDEN),
    "transformer_blocks.0.attn.to_k": ("double_blocks.0.img_attn.qkv", HIDDEN, HIDDEN, HIDDEN),
    "transformer_blocks.0.attn.to_v": ("double_blocks.0.img_attn.qkv", 2 * HIDDEN, HIDDEN, HIDDEN),
    "single_transformer_blocks.37.attn.to_q": ("single_blocks.37.linear1", 0, HIDDEN, HIDDEN),
    "single_transformer_blocks.37.proj_mlp": ("single_blocks.37.linear1", 3 * HIDDEN, MLP, HIDDEN),
    "single_transformer_blocks.37.proj_out": ("single_blocks.37.linear2", 0, HIDDEN, HIDDEN + MLP),
    "norm_out.linear": ("final_layer.adaLN_modulation.1", 0, 2 * HIDDEN, HIDDEN),
    "proj_out": ("final_layer.linear", 0, 64, HIDDEN),
}


@pytest.fixture(scope="module")
def fill():
    return meta_flux_patcher(torch.bfloat16, "FluxInpaint", in_channels=96, out_channels=16)


def fill_file() -> tuple[dict[str, torch.Tensor], dict[str, LoraFactors]]:
    sd, loras = {}, {}
    for i, (name, (_, _, rows, fan_in)) in enumerate(FILL.items()):
        lora = lora_for(RealLayer("flux", name, (rows, fan_in)), rank=RANK, seed=SEED + 10 + i)
        loras[name] = LoraFactors(lora.a.bfloat16(), lora.b.bfloat16())
        sd |= {f"transformer.{k}": v for k, v in loras[name].state_dict(name).items()}
    return sd, loras


def ranges_of(module: str, loras: dict[str, LoraFactors]) -> list[tuple[int, LoraFactors]]:
    """(first row in ComfyUI's weight, the LoRA on those rows) of every diffusers module on `module`; the
    final adaLN's halves are swapped (diffusers' scale|shift is ComfyUI's shift|scale)."""
    out = []
    for name, (target, start, _rows, _) in FILL.items():
        if target != module:
            continue
        lora = loras[name]
        if module == "final_layer.adaLN_modulation.1":
            out += [(0, LoraFactors(lora.a, lora.b[HIDDEN:])), (HIDDEN, LoraFactors(lora.a, lora.b[:HIDDEN]))]
        else:
            out.append((start, lora))
    return out


def test_flux_fill_subclass_lands_every_linear_and_equals_core_at_real_size(fill):
    from loraweave.comfy.targets import comfy_arch

    c = import_comfy()
    assert type(fill.model.model_config).__name__ == "FluxInpaint" and comfy_arch(fill) == "flux"
    sd, loras = fill_file()
    ours, _, report = load_lora_for_models(fill, None, sd, STRENGTH, 0.0, mode="merge", strict=True)
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    core, _ = c.sd.load_lora_for_models(fill, None, sd, STRENGTH, 0.0)
    modules = sorted({target for target, *_ in FILL.values()})
    keys = {f"diffusion_model.{m}.weight" for m in modules}
    assert set(ours.patches) == keys and set(core.patches) == keys, (set(ours.patches), set(core.patches))
    for module in modules:
        key = f"diffusion_model.{module}.weight"
        ranges = ranges_of(module, loras)
        with comfy_layer(fill, module, SEED) as weight, torch.no_grad():
            merged = {}
            for who, clone in (("ours", ours), ("core", core)):
                merged[who] = c.lora.calculate_weight(clone.patches[key], weight.detach().float(), key)
            assert torch.equal(merged["ours"], merged["core"]), f"{module}: fp32 merge differs from core's"
            ends = {r for start, lora in ranges for r in (start, start + lora.b.shape[0] - 1)}
            rows = torch.tensor(sorted({*sample_rows(weight.shape[0]).tolist(), *ends}))
            want = weight.detach()[rows].double()
            for start, lora in ranges:
                inside = (rows >= start) & (rows < start + lora.b.shape[0])
                want[inside] += STRENGTH * lora.delta_rows(rows[inside] - start)[0]
            got = merged["ours"][rows].double()
            rel = float((got - want).norm() / want.norm())
            moved = float((want - weight.detach()[rows].double()).norm() / want.norm())
            assert rel < REL_TOL < moved, (
                f"{module}: relative error {rel:.3g} (the adapter moved it {moved:.3g})"
            )
            merged.clear()  # the fp32 copies, before the bf16 ones
            for who, clone in (("ours", ours), ("core", core)):
                merged[who] = clone.patch_weight_to_device(
                    key, device_to=torch.device("cpu"), return_weight=True
                )
            assert merged["ours"].dtype == torch.bfloat16
            assert torch.equal(merged["ours"], merged["core"]), f"{module}: bf16 weight differs from core's"
