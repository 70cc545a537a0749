"""GGUF models for ComfyUI-GGUF (../shared/quantized/ComfyUI-GGUF, used in place): files written here with
`gguf.GGUFWriter`, loaded by ComfyUI-GGUF's own `UnetLoaderGGUF` through ComfyUI's folder_paths.

Quant types: the `gguf` package (0.19.0) quantizes Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16 (and TQ1_0/TQ2_0)
in numpy; every K-quant raises NotImplementedError. Q4_K and Q5_K blocks are packed here (`pack_k`) from the
format (d, dmin, 12 bytes of 6-bit sub-block scales and mins, 4-bit quants, Q5_K's 32 bytes of high bits) with
a plain min/max quantizer, not llama.cpp's search; `gguf.quants.dequantize` reads them back as the oracle of
the layout (`pack_k` is checked against it in test_comfy_gguf_files.py).

Models: a Flux.1-dev shaped DiT at hidden 256 (2 heads; every block linear's row length a multiple of 256, so
each takes any type) and an SD1.5 UNet at the widths ComfyUI's detection needs (320 channels, context 768;
one level, one res block), whose conv weights are stored as (n/256, 256) rows with ComfyUI-GGUF's
`comfy.gguf.orig_shape` metadata, as its converter does for SD1."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .comfy_env import REPO_ROOT, import_comfy

GGUF_DIR = REPO_ROOT.parent / "shared" / "quantized" / "ComfyUI-GGUF"
QTYPES = ("Q8_0", "Q4_K", "Q4_0", "Q5_K", "F16")  # the rows the issue names
QK_K = 256


def gguf_pack():
    """ComfyUI-GGUF imported in place as the package `comfyui_gguf` (its modules import each other
    relatively; the folder's name is no identifier). ComfyUI first: its `__init__` imports the nodes only
    inside ComfyUI."""
    import_comfy()
    if "comfyui_gguf" not in sys.modules:
        assert (GGUF_DIR / "ops.py").is_file(), f"missing ComfyUI-GGUF source at {GGUF_DIR}"
        spec = importlib.util.spec_from_file_location(
            "comfyui_gguf", GGUF_DIR / "__init__.py", submodule_search_locations=[str(GGUF_DIR)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["comfyui_gguf"] = module
        spec.loader.exec_module(module)
    import comfyui_gguf.dequant
    import comfyui_gguf.nodes
    import comfyui_gguf.ops  # noqa: F401

    return sys.modules["comfyui_gguf"]


# ---- K-quant packing (Q4_K, Q5_K): super-blocks of 256 = 8 sub-blocks of 32 ----


def _scales_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(n, 12) uint8: 8 six-bit scales and mins; the high 2 bits of sub-blocks 4..7 sit in bytes 0..7."""
    lo = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6)], axis=1)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, md], axis=1).astype(np.uint8)


def pack_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """(rows, cols/256 · type_size) uint8 Q4_K or Q5_K blocks of float `w` (rows, cols), cols % 256 == 0."""
    bits = {"Q4_K": 4, "Q5_K": 5}[qtype]
    nmax = (1 << bits) - 1
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / nmax
    minv = -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minv.max(-1) / 63).astype(np.float16)
    d32, dm32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dm32 > 0, np.rint(minv / dm32), 0).clip(0, 63).astype(np.uint8)
        s = (d32 * sc)[..., None]
        m = (dm32 * mn)[..., None]
        q = np.where(s > 0, np.rint((x + m) / s), 0).clip(0, nmax).astype(np.uint8)
    n = x.shape[0]
    pairs = q.reshape(n, 4, 2, 32)  # sub-blocks 2i (low nibble) and 2i+1 (high nibble) share 32 bytes
    qs = ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _scales_bytes(sc, mn)]
    if bits == 5:  # bit j of byte l: the fifth bit of value l of sub-block j
        high = (q >> 4) & 1
        parts.append(sum(high[:, j, :].astype(np.uint8) << j for j in range(8)).astype(np.uint8))
    parts.append(qs.astype(np.uint8))
    return np.concatenate(parts, axis=1).reshape(w.shape[0], -1)


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """GGUF data of `w` (2-D, float) in `qtype`: the gguf package's numpy quantizer, pack_k for K-quants."""
    from gguf import GGMLQuantizationType, quants

    if qtype in ("Q4_K", "Q5_K"):
        return pack_k(w, qtype)
    return quants.quantize(w.astype(np.float32), GGMLQuantizationType[qtype])


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(data, GGMLQuantizationType[qtype])


# ---- files ----

QtypeOf = Callable[[str, tuple[int, ...]], str]  # (key, shape) -> type name; "F32" keeps it unquantized


def block_of(qtype: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]


def write_gguf(path: Path, state: dict[str, torch.Tensor], arch: str, qtype_of: QtypeOf) -> dict[str, str]:
    """Write `state` as a GGUF file of architecture `arch`, each tensor in `qtype_of(key, shape)`; 1-D and
    small tensors stay F32 (as ComfyUI-GGUF's converter keeps them). A tensor of more than 2 dimensions, or
    whose row length the block does not divide, is stored as (n/256, 256) rows with `comfy.gguf.orig_shape`.
    Returns {key: type written}."""
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    written: dict[str, str] = {}
    for key, tensor in state.items():
        data = tensor.detach().float().numpy()
        qtype = "F32" if data.ndim < 2 or data.size <= 1024 else qtype_of(key, tuple(data.shape))
        if qtype not in ("F32", "F16") and (data.ndim > 2 or data.shape[-1] % block_of(qtype)):
            if data.size % QK_K:
                qtype = "F16"
            else:
                writer.add_array(f"comfy.gguf.orig_shape.{key}", [int(d) for d in data.shape])
                data = data.reshape(-1, QK_K)
        if qtype == "F32":
            writer.add_tensor(key, data.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(key, data.astype(np.float16))
        else:
            writer.add_tensor(key, quantize(data, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
        written[key] = qtype
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def write_raw(path: Path, arch: str, tensors: dict, orig_shapes: dict[str, tuple[int, ...]]) -> None:
    """A GGUF file of `tensors` {key: (numpy data, type name)} with `comfy.gguf.orig_shape` entries as given
    (a hostile file declares a shape its bytes do not hold)."""
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=arch)
    for key, shape in orig_shapes.items():
        writer.add_array(f"comfy.gguf.orig_shape.{key}", list(shape))
    for key, (data, qtype) in tensors.items():
        raw = None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(key, data, raw_dtype=raw)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_gguf(path: Path):
    """ComfyUI-GGUF's `UnetLoaderGGUF().load_unet` on `path` (its folder added to ComfyUI's
    diffusion_models)."""
    pack = gguf_pack()
    import folder_paths

    folder_paths.add_model_folder_path("diffusion_models", str(path.parent))
    (model,) = pack.nodes.UnetLoaderGGUF().load_unet(path.name)
    return model


# ---- models ----

FLUX_GGUF = {"hidden_size": 256, "num_heads": 2, "axes_dim": [16, 56, 56]}


def mixed_flux_types(key: str, shape: tuple[int, ...]) -> str:
    """Every type the issue names on the tiny Flux's block linears; the rest Q8_0 (or F16 if unaligned)."""
    table = {
        "img_attn.qkv": "Q4_K",
        "img_attn.proj": "Q5_K",
        "img_mlp.0": "Q8_0",
        "img_mlp.2": "Q4_0",
        "txt_attn.qkv": "F16",
        "txt_attn.proj": "Q4_0",
        "txt_mlp.0": "Q5_K",
        "txt_mlp.2": "Q4_K",
        "linear1": "Q4_K",
        "linear2": "Q5_K",
    }
    found = next((t for k, t in table.items() if f".{k}." in key), None)
    return found or ("Q8_0" if shape[-1] % 32 == 0 else "F16")


def one_type(qtype: str) -> QtypeOf:
    return lambda key, shape: qtype if shape[-1] % block_of(qtype) == 0 else "F16"


def flux_state_dict_gguf(seed: int = 0, **params) -> dict[str, torch.Tensor]:
    from .comfy_models import flux_state_dict

    return flux_state_dict(seed, **{**FLUX_GGUF, **params})


def flux_gguf(directory: Path, qtype_of: QtypeOf = mixed_flux_types, seed: int = 0, **params):
    """(ComfyUI-GGUF MODEL, {key: type}, the float state dict): the tiny Flux written as GGUF and loaded."""
    state = flux_state_dict_gguf(seed, **params)
    name = f"flux_{seed}_{abs(hash((qtype_of, tuple(sorted(params.items(), key=str))))) % 10**8}.gguf"
    path = directory / name
    types = write_gguf(path, state, "flux", qtype_of)
    return load_gguf(path), types, state


# SD1.5 at the widths ComfyUI's detection needs (model_channels 320, context 768); one level keeps it small.
SD15_CONFIG = {
    "model_channels": 320,
    "channel_mult": [1],
    "num_res_blocks": [1],
    "transformer_depth": [1],
    "transformer_depth_output": [1, 1],
    "transformer_depth_middle": 1,
    "context_dim": 768,
    "num_heads": 8,
    "use_linear_in_transformer": False,
    "in_channels": 4,
    "out_channels": 4,
    "use_spatial_transformer": True,
    "legacy": False,
    "adm_in_channels": None,
    "use_temporal_resblock": False,
    "use_temporal_attention": False,
}


def sd15_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """LDM-named (`input_blocks.…`) SD1.5 UNet weights at SD15_CONFIG's shapes, seeded."""
    import_comfy()
    import comfy.ldm.modules.diffusionmodules.openaimodel as openaimodel
    import comfy.ops

    config = {k: v for k, v in SD15_CONFIG.items() if k not in ("transformer_depth_middle",)}
    with torch.device("meta"):
        unet = openaimodel.UNetModel(
            **config,
            transformer_depth_middle=SD15_CONFIG["transformer_depth_middle"],
            image_size=32,
            dtype=torch.float32,
            operations=comfy.ops.disable_weight_init,
        )
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in unet.state_dict().items()}


def mixed_sd_types(key: str, shape: tuple[int, ...]) -> str:
    """Q4_K on attention, Q5_K on feed-forward, Q8_0 on convs, Q4_0 on proj_in/out, F16 elsewhere."""
    if ".attn" in key:
        return "Q4_K" if ".to_" in key else "Q8_0"
    if ".ff." in key:
        return "Q5_K"
    if "proj_in" in key or "proj_out" in key:
        return "Q4_0"
    return "Q8_0" if len(shape) == 4 else "F16"


@functools.cache
def _sd15_file(directory: str) -> Path:
    path = Path(directory) / "sd15.gguf"
    write_gguf(path, sd15_state_dict(), "sd1", mixed_sd_types)
    return path


def sd15_gguf(directory: Path):
    """ComfyUI-GGUF MODEL of the SD1.5 UNet (ComfyUI's detection picks SD15)."""
    model = load_gguf(_sd15_file(str(directory)))
    assert type(model.model.model_config).__name__ == "SD15", type(model.model.model_config).__name__
    return model


# ---- what a test compares ----


def is_ggml(module: torch.nn.Module) -> bool:
    """Whether `module`'s weight is a quantized GGMLTensor (F16/F32 rows are not)."""
    return gguf_pack().dequant.is_quantized(getattr(module, "weight", None))


def ggml_layers(patcher) -> dict[str, torch.nn.Module]:
    """{name: module} of every layer of the diffusion model whose weight is a quantized GGMLTensor."""
    pack = gguf_pack()
    return {
        n: m
        for n, m in patcher.model.diffusion_model.named_modules()
        if pack.dequant.is_quantized(getattr(m, "weight", None))
    }


def storage_bytes(patcher) -> dict[str, torch.Tensor]:
    """A copy of every diffusion-model tensor's storage as uint8 (GGML blocks, F16 rows, F32 vectors)."""
    return {
        k: torch.Tensor(v).detach().reshape(-1).view(torch.uint8).clone()
        for k, v in patcher.model.diffusion_model.state_dict(keep_vars=True).items()
        if v is not None and v.device.type != "meta"
    }


def layer_weight(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the GGML layer computes with (ComfyUI-GGUF's own dequantization, its patches applied)."""
    return module.get_weight(module.weight, dtype)


class CallCounter:
    """Counts ComfyUI-GGUF's per-forward dequantizations (ops.dequantize_tensor) and patch applications
    (comfy.lora.calculate_weight, which GGMLLayer.get_weight calls for a weight carrying patches)."""

    def __init__(self) -> None:
        self.dequantize = 0
        self.patch = 0

    def __enter__(self) -> CallCounter:
        import comfy.lora

        ops = gguf_pack().ops
        self._saved = (ops.dequantize_tensor, comfy.lora.calculate_weight)
        dequant, calc = self._saved

        def counted_dequantize(*args, **kwargs):
            self.dequantize += 1
            return dequant(*args, **kwargs)

        def counted_calculate(*args, **kwargs):
            self.patch += 1
            return calc(*args, **kwargs)

        ops.dequantize_tensor = counted_dequantize
        comfy.lora.calculate_weight = counted_calculate
        return self

    def __exit__(self, *exc) -> None:
        import comfy.lora

        ops = gguf_pack().ops
        ops.dequantize_tensor, comfy.lora.calculate_weight = self._saved
