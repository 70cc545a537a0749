"""ComfyUI core's LoraLoader next to ours on the tiny SD1.5, weight by weight and bit by bit, per family:
core's merged weights are first checked against an independent fp64 formula (core is "right" within TOL), then
ours must equal them bit for bit. Runs in process and as a script under each ATen CPU dispatch
(ATEN_CPU_CAPABILITY=default, avx2, avx512), where the vectorised mul/add kernels differ (an FMA where a fused
scale would round differently).

Families: kohya LoRA on every attention/feed-forward Linear, LoCon on every Conv2d (k x k down), Tucker LoCon
(1x1 down, `lora_mid` k x k core, 1x1 up) on every k x k Conv2d, LoHa and LoKr on the Linears."""

from __future__ import annotations

import json

import torch

from .comfy_env import import_comfy
from .comfy_files import adapter_file, conv_lora, kohya, target_linears

TOL = 1e-6  # relative, per weight
STRENGTH = 0.7
RANK = 2


def tucker_locon(model: torch.nn.Module, prefix: str, seed: int = 12) -> dict[str, torch.Tensor]:
    """LyCORIS Tucker LoCon on every k x k Conv2d of `model` (k > 1): 1x1 down, (r, r, k, k) mid, 1x1 up."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1):
            out, inp, kh, kw = m.weight.shape
            stem = prefix + name.replace(".", "_")
            sd[f"{stem}.lora_down.weight"] = torch.randn(RANK, inp, 1, 1, generator=g)
            sd[f"{stem}.lora_mid.weight"] = torch.randn(RANK, RANK, kh, kw, generator=g) * 0.3
            sd[f"{stem}.lora_up.weight"] = torch.randn(out, RANK, 1, 1, generator=g) * 0.1
            sd[f"{stem}.alpha"] = torch.tensor(1.0)
    return sd


def fp64_delta(sd: dict[str, torch.Tensor], stem: str, shape: torch.Size) -> torch.Tensor:
    """γ·ΔW of a LoRA / LoCon / Tucker LoCon part in fp64 (the LyCORIS formulas, written out here)."""
    up = sd[f"{stem}.lora_up.weight"].double().flatten(1)
    down = sd[f"{stem}.lora_down.weight"].double()
    mid = sd.get(f"{stem}.lora_mid.weight")
    if mid is not None:  # ΔW[o, i, h, w] = Σ_{m,n} up[o, m] · mid[m, n, h, w] · down[n, i]
        delta = torch.einsum("om,mnhw,ni->oihw", up, mid.double(), down.flatten(1))
    else:
        delta = (up @ down.flatten(1)).reshape(shape)
    return sd[f"{stem}.alpha"].double() / down.shape[0] * delta.reshape(shape)


def files(m) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "lora": adapter_file(target_linears(m.diffusers), "lora", kohya("lora_unet_")),
        "locon": conv_lora(m.diffusers, "lora_unet_"),
        "tucker": tucker_locon(m.diffusers, "lora_unet_"),
        "loha": adapter_file(target_linears(m.diffusers), "loha", kohya("lora_unet_")),
        "lokr": adapter_file(target_linears(m.diffusers), "lokr", kohya("lora_unet_")),
    }


def compare(m, sd: dict[str, torch.Tensor], fp64: bool) -> dict:
    """{"keys", "core_rel" (core vs fp64, or vs ours where fp64 is False), "identical"} of one file."""
    from loraweave.comfy import load_lora_for_models

    c = import_comfy()
    ours, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    core, _ = c.sd.load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0)
    assert set(core.patches) == set(ours.patches) and ours.patches, "core and ours patch different weights"
    # ComfyUI's own key map, read backwards for the stems this file uses (for the fp64 reference only).
    stems = c.lora.model_lora_keys_unet(m.patcher.model, {}).items()
    key_map = {v: k for k, v in stems if isinstance(v, str) and f"{k}.alpha" in sd}
    cpu = torch.device("cpu")
    worst, identical = 0.0, 0
    for key in ours.patches:
        theirs = core.patch_weight_to_device(key, device_to=cpu, return_weight=True)
        mine = ours.patch_weight_to_device(key, device_to=cpu, return_weight=True)
        if fp64:
            base = m.patcher.get_model_object(key).detach().double()
            ref = base + STRENGTH * fp64_delta(sd, key_map[key], base.shape)
        else:
            ref = mine.double()
        rel = ((theirs.double() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, rel)
        identical += int(torch.equal(theirs, mine))
    return {"keys": len(ours.patches), "core_rel": worst, "identical": identical}


def run() -> dict:
    """Every family's comparison on a fresh tiny SD1.5, with the ATen CPU dispatch it ran under."""
    from .comfy_models import BUILDERS

    m = BUILDERS["sd15"]()
    out = {name: compare(m, sd, fp64=name in ("lora", "locon", "tucker")) for name, sd in files(m).items()}
    return {"capability": torch.backends.cpu.get_cpu_capability(), "families": out}


if __name__ == "__main__":
    print(json.dumps(run()))
