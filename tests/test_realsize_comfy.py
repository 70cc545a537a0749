"""The ComfyUI pack's merge path at the sizes Flux.1 users load: ComfyUI's own Flux.1-dev (hidden 3072, 19 +
38 blocks, detected by ComfyUI from a full-size state dict, helpers/realsize_comfy.py) on the meta device, one
layer at a time given seeded bf16 values.

`loraweave.comfy.load_lora_for_models(mode="merge")` puts loraweave's adapter (a `WeightAdapterBase` subclass)
in the clone's patch list; the merged weight is then what ComfyUI itself computes: `ModelPatcher.
patch_weight_to_device(key, return_weight=True)` (an fp32 copy; `comfy.lora.calculate_weight`, which narrows
the weight to each patch's `(0, start, length)` offset before our `calculate_weight` writes into it; then
`comfy.float. stochastic_rounding` back to bf16, round-to-nearest for bf16 in v0.19.3), and the lowvram
per-layer path (`comfy. model_patcher.LowVramPatch`, what ComfyUI's ops run on the bf16 cast of a weight at
every forward: the ΔW rounded to bf16 and added in bf16).

- `single_blocks.0.linear1` (21504 x 3072 = 66M elements): q | k | v | mlp, from a diffusers-named file with
  rank-16 LoRAs on `attn.to_q`, `attn.to_v` and `proj_mlp` (three offsets; k's rows stay bit for bit);
- `double_blocks.0.img_attn.qkv` (9216 x 3072): `attn.to_q/to_k/to_v`, three offsets;
- `single_blocks.7.linear2` (3072 x 15360, diffusers' `proj_out`): leighwoods' real Flux LoRA (PEFT names,
  rank 16, fp16), the file that crashed loraweave's own merge at this size (test_realsize_acceptance.py).

Rows checked: every 97th plus the last, and the first and last row of each offset range, against W + s·B·A in
fp64 (helpers/realsize.py's bounds: one bf16 ulp of the exact value + the fp32 accumulation on Σ|terms|; the
lowvram path adds one bf16 ulp of ΔW, its separate rounding). Rows no adapter covers must keep their bits."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.realsize import LoraFactors, RealLayer, lora_for, sample_rows, ulp
from helpers.realsize_comfy import comfy_layer, meta_flux_patcher
from safetensors.torch import load_file

from loraweave.comfy import load_lora_for_models
from loraweave.comfy.targets import reference_tree

# 2 threads on 2 shared cores spin in OpenMP barriers: ~10x a merge's CPU time (and wall time) under load
pytestmark = pytest.mark.usefixtures("one_thread")
SEED = 13
STRENGTH = 0.8
HIDDEN, MLP = 3072, 12288
LEIGHWOODS = "lora/leighwoods__public-loras__lora.safetensors"
# ComfyUI module -> {diffusers module (under `transformer.`): first row of its range in the fused weight}
FUSED = {
    "single_blocks.0.linear1": {
        "single_transformer_blocks.0.attn.to_q": 0,
        "single_transformer_blocks.0.attn.to_v": 2 * HIDDEN,
        "single_transformer_blocks.0.proj_mlp": 3 * HIDDEN,
    },
    "double_blocks.0.img_attn.qkv": {
        "transformer_blocks.0.attn.to_q": 0,
        "transformer_blocks.0.attn.to_k": HIDDEN,
        "transformer_blocks.0.attn.to_v": 2 * HIDDEN,
    },
}
RANGE_ROWS = {"proj_mlp": MLP}  # rows of each diffusers module's range (HIDDEN for q, k, v)

Ranges = list[tuple[int, LoraFactors]]  # (first row in the ComfyUI weight, the LoRA on those rows)


@pytest.fixture(scope="module")
def patcher():
    p = meta_flux_patcher(torch.bfloat16)
    assert reference_tree(p) is not None, "loraweave has no reference tree for ComfyUI's full-size Flux"
    return p


def fused_file(module: str) -> tuple[dict[str, torch.Tensor], Ranges]:
    """A diffusers/PEFT-named file with one rank-16 LoRA per piece of ComfyUI's fused `module` (‖B·A‖ = 5 % of
    the piece's ‖W‖), and where each lands."""
    sd: dict[str, torch.Tensor] = {}
    ranges: Ranges = []
    for i, (name, start) in enumerate(FUSED[module].items()):
        rows = RANGE_ROWS.get(name.rpartition(".")[2], HIDDEN)
        lora = lora_for(RealLayer("flux", name, (rows, HIDDEN)), seed=SEED + i)
        sd |= {f"transformer.{k}": v for k, v in lora.state_dict(name).items()}
        ranges.append((start, lora))
    return sd, ranges


def checked_rows(n_rows: int, ranges: Ranges) -> torch.Tensor:
    """Every 97th row plus the last, and both ends of every range (where a wrong offset shows first)."""
    ends = {r for start, lora in ranges for r in (start, start + lora.b.shape[0] - 1)}
    return torch.tensor(sorted({*sample_rows(n_rows).tolist(), *ends}))


def expected(original: torch.Tensor, rows: torch.Tensor, ranges: Ranges, strength: float):
    """(W + s·ΔW, s·ΔW, s·Σ|terms|, touched) on `rows` in fp64; rows outside every range keep W."""
    base = original.double().reshape(len(rows), -1)
    delta, magnitude = torch.zeros_like(base), torch.zeros_like(base)
    touched = torch.zeros(len(rows), dtype=torch.bool)
    for start, lora in ranges:
        inside = (rows >= start) & (rows < start + lora.b.shape[0])
        d, m = lora.delta_rows(rows[inside] - start)
        delta[inside], magnitude[inside] = strength * d, strength * m
        touched |= inside
    return base + delta, delta, magnitude, touched


def assert_patched(got, original, rows, ranges, strength, what, lowvram=False) -> None:
    """Rows of ComfyUI's patched weight against the fp64 formula; untouched rows bit for bit; the adapter
    moved most touched elements by more than the tolerance (so the check could fail)."""
    got = got.detach()[rows].reshape(len(rows), -1).double()
    expect, delta, magnitude, touched = expected(original, rows, ranges, strength)
    rank = ranges[0][1].rank
    # one bf16 ulp of the exact value, the fp32 rank-r sum on Σ|terms|, W' = W + ΔW rounded to fp32 once; the
    # lowvram path rounds ΔW to bf16 before its bf16 add: one more bf16 ulp, of ΔW
    tol = ulp(expect, torch.bfloat16) + (rank + 2) * 2.0**-24 * magnitude + 2.0**-24 * expect.abs()
    if lowvram:
        tol += ulp(delta, torch.bfloat16)
    err = (got - expect).abs()
    bad = touched[:, None] & (err > tol)
    n_bad = int(bad.sum())
    assert n_bad == 0, (
        f"{what}: {n_bad} elements off, worst {float((err - tol)[bad].max()):.3g} over the bound"
    )
    assert torch.equal(got[~touched], original.reshape(len(rows), -1)[~touched].double()), (
        f"{what}: rows no adapter covers changed"
    )
    moved = delta[touched].abs() > 2 * tol[touched]
    assert float(moved.double().mean()) > 0.5, (
        f"{what}: the adapter is below the tolerance; the check is void"
    )


def merged_clone(patcher, sd):
    model, _, report = load_lora_for_models(patcher, None, sd, STRENGTH, 0.0, mode="merge", strict=True)
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    return model


@pytest.mark.parametrize("module", list(FUSED))
def test_fused_offsets_merge_through_comfy_at_real_size(patcher, module):
    sd, ranges = fused_file(module)
    model = merged_clone(patcher, sd)
    key = f"diffusion_model.{module}.weight"
    offsets = sorted(off for _, _, _, off, _ in model.patches[key])
    assert offsets == [(0, start, lora.b.shape[0]) for start, lora in ranges], offsets
    with comfy_layer(patcher, module, SEED) as weight:
        rows = checked_rows(weight.shape[0], ranges)
        original = weight.detach()[rows].clone()
        merged = model.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
        assert merged.dtype == torch.bfloat16 and merged.shape == weight.shape
        assert_patched(merged, original, rows, ranges, STRENGTH, f"{module} (patch_weight_to_device)")
        del merged
        if module == "single_blocks.0.linear1":  # lowvram: the patch on the bf16 cast, bf16 intermediate
            lowvram = import_comfy().model_patcher.LowVramPatch(key, model.patches)
            low = lowvram(weight.detach().clone())
            assert low.dtype == torch.bfloat16
            assert_patched(low, original, rows, ranges, STRENGTH, f"{module} (LowVramPatch)", lowvram=True)
        # the clone's patches never wrote into the shared model
        assert torch.equal(weight.detach()[rows], original)


def test_leighwoods_proj_out_merges_through_comfy_at_real_size(patcher, realdata):
    tensors = load_file(realdata / LEIGHWOODS)
    model = merged_clone(patcher, tensors)
    module, live = "single_blocks.7.linear2", "single_transformer_blocks.7.proj_out"
    key = f"diffusion_model.{module}.weight"
    assert [off for _, _, _, off, _ in model.patches[key]] == [None]  # the whole weight: no offset
    lora = LoraFactors(
        tensors[f"transformer.{live}.lora_A.weight"], tensors[f"transformer.{live}.lora_B.weight"]
    )
    assert lora.a.shape == (16, 15360) and lora.b.shape == (HIDDEN, 16)  # no alpha in the file: scale 1
    with comfy_layer(patcher, module, SEED) as weight:
        assert weight.shape == (HIDDEN, HIDDEN + MLP)
        rows = sample_rows(HIDDEN)
        original = weight.detach()[rows].clone()
        merged = model.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
        assert_patched(merged, original, rows, [(0, lora)], STRENGTH, f"{module} (leighwoods)")


KOHYA_FUSED = {"single_blocks.0.linear1": 3 * HIDDEN + MLP, "double_blocks.0.img_attn.qkv": 3 * HIDDEN}


@pytest.mark.parametrize("module", list(KOHYA_FUSED))
def test_kohya_fused_module_merges_as_one_patch_at_real_size(patcher, module):
    # A kohya LoRA on a whole fused module is laid out by the resolver as q, k, v (, mlp) pieces and goes back
    # to ComfyUI as one patch, as core adds it: no offsets, W + s·B·A in fp64 within the bound, core's bits.
    rows = KOHYA_FUSED[module]
    lora = lora_for(RealLayer("flux", module, (rows, HIDDEN)), seed=SEED + 7)
    stem = "lora_unet_" + module.replace(".", "_")
    sd = {
        f"{stem}.lora_down.weight": lora.a,
        f"{stem}.lora_up.weight": lora.b,
        f"{stem}.alpha": torch.tensor(16.0),
    }
    model = merged_clone(patcher, sd)
    core, _ = import_comfy().sd.load_lora_for_models(patcher, None, sd, STRENGTH, 0.0)
    key = f"diffusion_model.{module}.weight"
    assert [off for _, _, _, off, _ in model.patches[key]] == [None]
    with comfy_layer(patcher, module, SEED) as weight:
        checked = checked_rows(weight.shape[0], [(0, lora)])
        original = weight.detach()[checked].clone()
        cpu = torch.device("cpu")
        merged = model.patch_weight_to_device(key, device_to=cpu, return_weight=True)
        assert_patched(merged, original, checked, [(0, lora)], STRENGTH, f"{module} (kohya, whole)")
        assert torch.equal(merged, core.patch_weight_to_device(key, device_to=cpu, return_weight=True))
