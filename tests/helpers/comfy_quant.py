"""Tiny quantized ComfyUI Flux checkpoints, written the way ComfyUI's own files declare their quantization and
loaded by ComfyUI's own loader (`comfy.sd.load_diffusion_model`, what UNETLoader runs).

- A `comfy_quant` (mixed-precision) file: every block Linear of the hidden-128 Flux (comfy_models.flux_state_
  dict) stored by ComfyUI's own layout class for `fmt` (`QuantizedTensor.from_float(w, QUANT_ALGOS[fmt]
  ["comfy_tensor_layout"])`, the tensors its `state_dict` names: `weight`, `weight_scale`,
  `weight_scale_2`, `weight_s_rel`...) beside a `<layer>.comfy_quant` JSON entry `{"format": fmt}`;
  embedders, norms and the final layer stay fp32 (the "mixed" of mixed precision).
- An "fp8_scaled" file (the older format): fp8 e4m3fn weights with a per-tensor `<layer>.scale_weight` and the
  `scaled_fp8` marker, which ComfyUI's `convert_old_quants` turns into `comfy_quant` float8_e4m3fn at load.

`FORMATS` is what the imported tree registers (`comfy.quant_ops.QUANT_ALGOS`) plus "fp8_scaled": v0.19.3 has
float8_e4m3fn, float8_e5m2, nvfp4, mxfp8; the latest tree adds int8_tensorwise, convrot_w4a4 and
asym_w4a8_int8."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .comfy_env import import_comfy
from .comfy_models import flux_state_dict

# ConvRot's regular Hadamard groups must be a power of 4 dividing every in_features of the tiny Flux (128,
# 512, 640): 64 (the layouts' default, 256, does not divide 128 or 640).
CONVROT_GROUP = 64
ROTATED = ("convrot_w4a4", "asym_w4a8_int8")  # stored in a Hadamard-rotated basis
# Layouts whose ComfyUI forward on CPU runs comfy_kitchen's eager quantized kernel (activations quantized
# too); the others are disabled for native compute on CPU: dequantize, float GEMM (comfy.ops pick_operations).
ACTIVATION_QUANTIZED = ("int8_tensorwise", "convrot_w4a4", "asym_w4a8_int8")
LEGACY = "fp8_scaled"
# UNETLoader's weight_dtype: an fp32 file loaded with the weights cast to float8 (no scale; ComfyUI's
# manual_cast ops up-cast per forward): plain tensors, not QuantizedTensors.
WEIGHT_DTYPES = {"weight_dtype_fp8_e4m3fn": torch.float8_e4m3fn, "weight_dtype_fp8_e5m2": torch.float8_e5m2}
BLOCK_WEIGHT = re.compile(r"^(double|single)_blocks\.\d+\..*\.weight$")


def quant_algos() -> dict:
    import_comfy()
    import comfy.quant_ops

    return comfy.quant_ops.QUANT_ALGOS


def formats() -> list[str]:
    """Every format the imported tree registers, the legacy fp8_scaled file, then plain float8 weights."""
    return [*quant_algos(), LEGACY, *WEIGHT_DTYPES]


def layout_of(fmt: str) -> str:
    """The comfy_kitchen layout of `fmt`; for the plain float8 weights, their dtype's name."""
    if fmt in WEIGHT_DTYPES:
        return str(WEIGHT_DTYPES[fmt]).removeprefix("torch.")
    return quant_algos()["float8_e4m3fn" if fmt == LEGACY else fmt]["comfy_tensor_layout"]


def quantized_entry(key: str, weight: torch.Tensor, fmt: str) -> dict:
    """{key: tensor} of one weight stored by ComfyUI's layout class for `fmt`, with its comfy_quant entry."""
    from comfy_kitchen.tensor import QuantizedTensor

    kwargs: dict = {}
    conf: dict = {"format": fmt}
    if fmt.startswith("float8"):
        kwargs["scale"] = "recalculate"  # a per-tensor scale, as fp8 "scaled" checkpoints carry
    if fmt in ROTATED:
        kwargs["convrot_groupsize"] = conf["convrot_groupsize"] = CONVROT_GROUP
    tensor = QuantizedTensor.from_float(weight, layout_of(fmt), **kwargs)
    out = dict(tensor.state_dict(key))
    stem = key.removesuffix(".weight")
    out[f"{stem}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    return out


def flux_sd(fmt: str, seed: int = 0, **params) -> dict[str, torch.Tensor]:
    """The tiny Flux's BFL state dict (`params` override comfy_models.FLUX_PARAMS) with every block Linear
    quantized as `fmt` (module docstring)."""
    bfl = flux_state_dict(seed, **params)
    out: dict[str, torch.Tensor] = {}
    if fmt == LEGACY:
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    for key, value in bfl.items():
        if fmt in WEIGHT_DTYPES or not (BLOCK_WEIGHT.match(key) and value.dim() == 2):
            out[key] = value
        elif fmt == LEGACY:
            scale = value.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
            out[key] = (value / scale).to(torch.float8_e4m3fn)
            out[key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(1)
        else:
            out.update(quantized_entry(key, value, fmt))
    return out


def write_flux(folder: Path, fmt: str, seed: int = 0) -> Path:
    path = folder / f"flux-{fmt}.safetensors"
    save_file(flux_sd(fmt, seed), str(path))
    return path


def load_flux(path: Path, fmt: str):
    """ComfyUI's own loader on `path`: a ModelPatcher over its Flux whose block Linears hold QuantizedTensors
    of `fmt`'s layout, or plain float8 weights of a WEIGHT_DTYPES format (asserted)."""
    from loraweave.quant.comfy_kitchen import is_quantized_tensor, layout_name

    c = import_comfy()
    options = {"dtype": WEIGHT_DTYPES[fmt]} if fmt in WEIGHT_DTYPES else {}
    patcher = c.sd.load_diffusion_model(str(path), model_options=options, disable_dynamic=True)
    assert type(patcher.model.model_config).__name__ == "Flux", "ComfyUI did not detect Flux"
    layers = quantized_linears(patcher)
    assert len(layers) >= 8, sorted(layers)
    layouts = {
        f"QuantizedTensor:{layout_name(m.weight)}" if is_quantized_tensor(m.weight) else str(m.weight.dtype)
        for m in layers.values()
    }
    want = f"torch.{layout_of(fmt)}" if fmt in WEIGHT_DTYPES else f"QuantizedTensor:{layout_of(fmt)}"
    assert layouts == {want}, layouts
    return patcher


def quantized_linears(patcher) -> dict[str, torch.nn.Module]:
    """{ComfyUI module name: layer} of the block Linears holding a quantized weight (a QuantizedTensor or a
    float8 tensor; modulation left out: its 6x-wide output only slows the checks)."""
    from loraweave.comfy.quantized import is_quantized

    return {
        name: m
        for name, m in patcher.model.diffusion_model.named_modules()
        if isinstance(getattr(m, "in_features", None), int)
        and is_quantized(m._parameters.get("weight"))
        and re.match(r"^\w+\.\d+\.(?!\w*mod)", name)
    }


def storage(patcher) -> dict[str, torch.Tensor]:
    """{layer.tensor: bytes} of every quantized weight of the diffusion model (data and scales), copied."""
    from loraweave.comfy.quantized import is_quantized
    from loraweave.quant.comfy_kitchen import is_quantized_tensor, stored_tensors

    out = {}
    for name, m in patcher.model.diffusion_model.named_modules():
        weight = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if is_quantized_tensor(weight):
            for field, t in stored_tensors(weight).items():
                out[f"{name}.{field}"] = t.detach().reshape(-1).view(torch.uint8).clone()
        elif is_quantized(weight):
            out[f"{name}.weight"] = weight.detach().reshape(-1).view(torch.uint8).clone()
    return out


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@dataclass
class Reference:
    """One layer's fp64 reference: W_q (its own dequantized weight), W' (W_q with the file merged) and, for
    the families whose runtime form acts on the layer's output (OFT rotates it, DoRA rescales it), the
    operator G they apply to it (out x out; None for the others)."""

    w_q: torch.Tensor
    merged: torch.Tensor
    on_output: torch.Tensor | None = None

    def term(self, x: torch.Tensor, y0: torch.Tensor) -> torch.Tensor:
        """The exact adapter term for input `x` given the layer's own pre-bias output `y0`, in fp64:
        x·(W' − W_q)ᵀ, plus G·(y0 − x·W_qᵀ) where the family acts on the output (that is its term: G·y0 +
        what does not depend on W; equal to the first when y0 = x·W_qᵀ exactly)."""
        x, y0 = x.double(), y0.double()
        term = x @ (self.merged - self.w_q).T
        if self.on_output is not None:
            term = term + (y0 - x @ self.w_q.T) @ self.on_output.T
        return term


def merged_fp64(patcher, sd: dict, strength: float) -> dict[str, Reference]:
    """{ComfyUI module: Reference} in fp64, W' merged by loraweave's families' merge math (families/*.
    add_delta, checked against LyCORIS and PEFT in tests/test_family_*.py) on the plan the pack makes of `sd`.
    OFT's G is its merge on an identity base ((R − I)·I); DoRA's is diag(a − 1), a read off W' = a ⊙ W_c with
    W_c = W_q + γ·up·down from the file (both asserted to reproduce W' − W_q)."""
    from loraweave.comfy.api import read_lora
    from loraweave.comfy.quantized import dequantized
    from loraweave.comfy.targets import plan_for_patcher
    from loraweave.families.contribution import add_contribution

    plan = plan_for_patcher(patcher, read_lora(sd), strength)
    out: dict[str, Reference] = {}
    families: dict[str, str] = {}
    live = patcher.model.diffusion_model
    for pp in plan.planned:
        for piece in pp.pieces:
            if piece.module not in out:
                base = dequantized(live.get_submodule(piece.module).weight).double()
                out[piece.module] = Reference(base, base.clone())
            ref = out[piece.module]
            rows = slice(piece.dst_start, piece.dst_start + piece.length)
            add_contribution(ref.merged[rows], pp, piece, ref.w_q)
            families[piece.module] = pp.family.name
            if pp.family.name == "oft":
                if ref.on_output is None:
                    ref.on_output = torch.zeros(base.shape[0], base.shape[0], dtype=torch.float64)
                eye = torch.eye(base.shape[0], dtype=torch.float64)
                add_contribution(ref.on_output[rows], pp, piece, eye)
    for name, ref in out.items():
        if families[name] == "dora":
            stem = "lora_unet_" + name.replace(".", "_")
            down = sd[f"{stem}.lora_down.weight"].double()
            gamma = sd[f"{stem}.alpha"].item() / down.shape[0]
            w_c = ref.w_q + gamma * sd[f"{stem}.lora_up.weight"].double() @ down
            a = (ref.merged * w_c).sum(1) / w_c.square().sum(1)
            assert torch.allclose(a[:, None] * w_c, ref.merged, rtol=0, atol=1e-12), "W' is not a ⊙ W_c"
            ref.on_output = torch.diag(a - 1)
        if families[name] == "oft":
            assert torch.allclose(ref.on_output @ ref.w_q, ref.merged - ref.w_q, rtol=0, atol=1e-12)
    return out
