"""A tiny FluxTransformer2DModel (diffusers' real class, seeded) loaded the way diffusers users load quantized
Flux: torchao float8 through
`from_pretrained(..., quantization_config=TorchAoConfig(Float8WeightOnlyConfig()))`, GGUF through
`from_single_file(file.gguf, quantization_config=GGUFQuantizationConfig(...))` on a file written here with
`gguf.GGUFWriter`. Adapter files of the five families for its layers, each with an fp64 ΔW formula written
from the family's definition (no loraweave math), and byte snapshots of every stored tensor.

Widths: heads of 128 (Flux's own head width) x 2 = 256 and FFN 1024, so that every projection's input width
is a multiple of a K-quant super-block (256); x_embedder takes Flux's 64 packed latent channels."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from helpers.common import gen, random_q4k_blocks

FLUX_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 128,
    "num_attention_heads": 2,
    "joint_attention_dim": 256,
    "pooled_projection_dim": 256,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
}

# One layer of each kind a Flux LoRA targets: double-block attention and FFN, the AdaLN modulation,
# single-block attention, MLP and output projection, the image embedder.
TARGETS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.add_v_proj",
    "transformer_blocks.0.ff.net.0.proj",
    "transformer_blocks.0.ff.net.2",
    "transformer_blocks.0.norm1.linear",
    "single_transformer_blocks.0.attn.to_k",
    "single_transformer_blocks.0.proj_mlp",
    "single_transformer_blocks.0.proj_out",
    "x_embedder",
)
FAMILIES = ("lora", "lokr", "loha", "dora", "oft")
COMPUTE = torch.float32  # the default compute dtype; bf16 (what users run) is a parameter


def float_flux(seed: int = 0) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**FLUX_CONFIG).eval()


def saved_flux(folder: Path, seed: int = 0) -> Path:
    """The float model as a diffusers folder (config.json + safetensors), what `from_pretrained` reads."""
    float_flux(seed).save_pretrained(folder)
    return folder


def torchao_flux(folder: Path, dtype: torch.dtype = COMPUTE) -> nn.Module:
    """diffusers' own torchao path: TorchAoConfig(Float8WeightOnlyConfig()), the float8 config torchao 0.18
    runs on CPU (Float8DynamicActivationFloat8WeightConfig asserts CUDA capability >= 8.9)."""
    from diffusers import FluxTransformer2DModel, TorchAoConfig
    from torchao.quantization import Float8WeightOnlyConfig

    return FluxTransformer2DModel.from_pretrained(
        folder, quantization_config=TorchAoConfig(Float8WeightOnlyConfig()), torch_dtype=dtype
    ).eval()


def q4k_blocks(rows: int, cols: int, absmax: float, seed: int) -> np.ndarray:
    """Well-formed random Q4_K super-blocks of a (rows, cols) weight reaching about `absmax`."""
    step = absmax / (15 * 32)  # mid-range 6-bit scales reach absmax
    return random_q4k_blocks(rows, cols, seed, d=step, dmin=step * 8)


def write_gguf(model: nn.Module, path: Path, qtype: str) -> dict[str, str]:
    """Every tensor of `model` under its diffusers name; each Linear weight whose input width is a multiple of
    the type's block stored as `qtype`, everything else F32. Returns {layer: type written}."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    linears = {f"{n}.weight": n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    writer = gguf.GGUFWriter(str(path), arch="flux")
    written = {}
    for i, (key, tensor) in enumerate(model.state_dict().items()):
        data = tensor.detach().float().numpy()
        if key in linears and data.shape[1] % block == 0:
            if qtype == "Q4_K":
                blocks = q4k_blocks(*data.shape, float(np.abs(data).max()), seed=i)
            else:
                blocks = gguf.quants.quantize(data, kind)
            writer.add_tensor(key, blocks, raw_dtype=kind)
            written[linears[key]] = qtype
        else:
            writer.add_tensor(key, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def gguf_flux(
    folder: Path, qtype: str, seed: int = 0, dtype: torch.dtype = COMPUTE
) -> tuple[nn.Module, dict[str, str]]:
    """diffusers' own GGUF path: from_single_file on a file with diffusers' key names (loaded as is, no
    conversion), the config from the saved folder, GGUFQuantizationConfig(compute_dtype=fp32)."""
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    path = folder / f"flux-{qtype}.gguf"
    written = write_gguf(float_flux(seed), path, qtype)
    model = FluxTransformer2DModel.from_single_file(
        str(path),
        config=str(folder),
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        torch_dtype=dtype,
    ).eval()
    return model, written


def quantized_flux(fmt: str, folder: Path, dtype: torch.dtype = COMPUTE) -> nn.Module:
    """The format ("torchao-float8" or "gguf-<TYPE>") loaded through diffusers from a float model saved in
    `folder`, computing in `dtype`."""
    if not (folder / "config.json").is_file():
        saved_flux(folder)
    if fmt == "torchao-float8":
        return torchao_flux(folder, dtype)
    return gguf_flux(folder, fmt.removeprefix("gguf-"), dtype=dtype)[0]


def flux_pipe(transformer: nn.Module):
    """diffusers' FluxPipeline holding `transformer` (every other component None): what the drop-in wraps."""
    from diffusers import FluxPipeline

    keys = FluxPipeline._get_signature_keys(FluxPipeline)[0]
    return FluxPipeline(**(dict.fromkeys(keys) | {"transformer": transformer}))


# ------------------------------------------------------------------------------------- the base's own weight


def own_weight(layer: nn.Module) -> torch.Tensor:
    """The weight the layer's own forward computes with, by the base library's own dequantizer (torchao's
    `dequantize()`, diffusers' `dequantize_gguf_tensor` cast to compute_dtype; a Nunchaku SVDQW4A4Linear:
    int4 residual / smooth + up·down, unpacked by the tests' own unpackers), in fp64."""
    if type(layer).__name__ == "SVDQW4A4Linear":
        from helpers.nunchaku_cpu import svdq_weight

        return svdq_weight(layer)
    weight = layer.weight
    name = type(weight).__name__
    if name == "GGUFParameter":
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

        return dequantize_gguf_tensor(weight).to(layer.compute_dtype).double()
    if hasattr(weight, "dequantize"):
        return weight.dequantize().double()
    return weight.detach().double()


def own_bias(layer: nn.Module) -> torch.Tensor | float:
    """The bias the layer adds, in output order, fp64 (Nunchaku stores it packed)."""
    if type(layer).__name__ == "SVDQW4A4Linear":
        from helpers.nunchaku_cpu import svdq_parts

        return svdq_parts(layer)["bias"]
    return 0.0 if layer.bias is None else layer.bias.double()


def storage_kind(layer: nn.Module) -> str:
    """What holds the layer's weight: "Float8Tensor", "GGUF Q4_K", ... or "float32"."""
    weight = layer.weight
    if type(weight).__name__ == "GGUFParameter":
        import gguf

        return f"GGUF {gguf.GGMLQuantizationType(int(weight.quant_type)).name}"
    if type(weight) in (torch.Tensor, nn.Parameter):
        return str(weight.dtype).removeprefix("torch.")
    return type(weight).__name__


# ------------------------------------------------------------------------------------- storage bytes


def _raw(name: str, t: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """A tensor subclass (torchao) by its inner tensors, recursively; the rest as plain bytes (a GGUFParameter
    is its raw uint8 blocks)."""
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ != "GGUFParameter":
        inner, _ = t.__tensor_flatten__()
        for attr in inner:
            _raw(f"{name}.{attr}", getattr(t, attr), out)
        return
    plain = t.as_subclass(torch.Tensor).detach()
    out[name] = plain.contiguous().reshape(-1).view(torch.uint8).clone()
    out[name + "#dtype"] = torch.tensor([hash(str(plain.dtype)), *plain.shape])


def storage_bytes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every stored tensor of the model (quantized data, scales, biases, norms) as bytes, cloned."""
    out: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        _raw(name, t, out)
    return out


def changed_bytes(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    now = storage_bytes(model)
    if now.keys() != before.keys():
        return sorted(now.keys() ^ before.keys())
    return [k for k in now if not torch.equal(now[k], before[k])]


# ------------------------------------------------------------------------------------- adapters + fp64 ΔW

Delta = Callable[[torch.Tensor], torch.Tensor]  # fp64 base weight (out, in) -> fp64 ΔW at strength 1


@dataclass(frozen=True)
class Gained:
    """A ΔW formula whose family also transforms the base's own output y ↦ G·y (DoRA's row gain, OFT's
    rotation): `gain(w)` = ‖G − I‖∞, how much of the base output's own error the change carries."""

    delta: Delta
    gain: Callable[[torch.Tensor], float]

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return self.delta(w)


def _lora(o: int, i: int, g: torch.Generator, sd: dict, key: str) -> Delta:
    r, alpha = 4, 2.0
    down, up = torch.randn(r, i, generator=g) * 0.05, torch.randn(o, r, generator=g) * 0.05
    sd |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(alpha)}
    return lambda w: up.double() @ down.double() * (alpha / r)


def _lokr(o: int, i: int, g: torch.Generator, sd: dict, key: str) -> Delta:
    # LyCORIS: ΔW = kron(w1, w2), full factors and no alpha: scale 1
    w1, w2 = torch.randn(4, 8, generator=g) * 0.05, torch.randn(o // 4, i // 8, generator=g) * 0.05
    sd |= {f"{key}.lokr_w1": w1, f"{key}.lokr_w2": w2}
    return lambda w: torch.kron(w1.double(), w2.double())


def _loha(o: int, i: int, g: torch.Generator, sd: dict, key: str) -> Delta:
    r, alpha = 4, 2.0
    shapes = {"hada_w1_a": (o, r), "hada_w1_b": (r, i), "hada_w2_a": (o, r), "hada_w2_b": (r, i)}
    t = {n: torch.randn(*s, generator=g) * 0.2 for n, s in shapes.items()}
    sd |= {f"{key}.{n}": v for n, v in t.items()} | {f"{key}.alpha": torch.tensor(alpha)}
    d = {n: v.double() for n, v in t.items()}
    return lambda w: (d["hada_w1_a"] @ d["hada_w1_b"]) * (d["hada_w2_a"] @ d["hada_w2_b"]) * (alpha / r)


def _dora(o: int, i: int, g: torch.Generator, sd: dict, key: str) -> Delta:
    # LyCORIS DoRA (wd_on_out): W' = m ⊙ (W + γBA) / ‖W + γBA‖ per output row, γ = alpha/rank
    r, alpha = 4, 2.0
    down, up = torch.randn(r, i, generator=g) * 0.05, torch.randn(o, r, generator=g) * 0.05
    m = torch.rand(o, 1, generator=g) + 0.5
    sd |= {
        f"{key}.lora_down.weight": down,
        f"{key}.lora_up.weight": up,
        f"{key}.alpha": torch.tensor(alpha),
        f"{key}.dora_scale": m,
    }

    def delta(w: torch.Tensor) -> torch.Tensor:
        wc = w + up.double() @ down.double() * (alpha / r)
        return m.double() * wc / wc.norm(dim=1, keepdim=True) - w

    def gain(w: torch.Tensor) -> float:  # each output row of the base is rescaled by g = m / ‖W + γBA‖
        wc = w + up.double() @ down.double() * (alpha / r)
        return float((m.double() / wc.norm(dim=1, keepdim=True) - 1).abs().max())

    return Gained(delta, gain)


def _oft(o: int, i: int, g: torch.Generator, sd: dict, key: str) -> Delta:
    # LyCORIS diag-OFT: W' = blockdiag(R)ᵀ·W, R = (I + Q)(I − Q)⁻¹, Q = B − Bᵀ (alpha 0: unconstrained)
    b = 16
    blocks = torch.randn(o // b, b, b, generator=g) * 0.05
    sd |= {f"{key}.oft_blocks": blocks, f"{key}.alpha": torch.tensor(0.0)}
    q = blocks.double() - blocks.double().transpose(1, 2)
    eye = torch.eye(b, dtype=torch.float64)
    rot = (eye + q) @ torch.linalg.inv(eye - q)

    def delta(w: torch.Tensor) -> torch.Tensor:
        return torch.block_diag(*rot.transpose(1, 2)) @ w - w

    # the base's output is rotated: the change carries its error times at most ‖Rᵀ − I‖∞ (largest row sum)
    return Gained(delta, lambda w: float((rot.transpose(1, 2) - eye).abs().sum(-1).max()))


BUILDERS = {"lora": _lora, "lokr": _lokr, "loha": _loha, "dora": _dora, "oft": _oft}


def adapter(
    family: str, model: nn.Module, prefix: str = "", seed: int = 0, targets=TARGETS
) -> tuple[dict[str, torch.Tensor], dict[str, Delta]]:
    """({key: tensor} on `targets`, keys `<prefix><module path>.<role>`; {module path: fp64 ΔW formula})."""
    g = gen(100 + seed + FAMILIES.index(family))
    sd: dict[str, torch.Tensor] = {}
    deltas = {}
    for path in targets:
        layer = model.get_submodule(path)
        deltas[path] = BUILDERS[family](layer.out_features, layer.in_features, g, sd, prefix + path)
    return sd, deltas


def layer_input(layer: nn.Module, seed: int) -> torch.Tensor:
    return torch.randn(2, 3, layer.in_features, generator=gen(seed))


Base = tuple[torch.Tensor, torch.Tensor, float]  # the layer's own output, its own weight, its own rounding


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |t| (fp64)."""
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(t.double().abs().clamp_min(tiny)))) * torch.finfo(dtype).eps


def check_term(
    layer: nn.Module, x: torch.Tensor, base: Base, delta: Delta, strength: float = 1.0, merged: bool = False
) -> float:
    """The largest ratio of |y − base_y − x·ΔWᵀ| to its bound (≤ 1 passes): the layer output with the adapter
    against the quantized base's own output plus the exact fp64 term. `base` (from `baseline`): the layer's
    output, its own dequantized weight and its own error, all taken before the adapter was applied.

    fp32 compute: the term's fp32 arithmetic (1e-5 of its max, as the family tests) plus the fp32 rounding of
    the sum y = base_y + term, a few ulps of max|y|, which the subtraction y − base_y exposes.
    16-bit compute, per element: the change carries the base's own error e_base = max|base_y − (x·Wᵀ + b)|
    (W its own weight, fp64) times ‖G − I‖∞ (0 for additive families; DoRA's row gain, OFT's rotation:
    `Gained`), plus half an ulp of y (the rounding of the sum) and two 16-bit steps of max|term| (the term's
    own roundings); a float layer that was `merged` also holds W + ΔW rounded to 16 bits: half an ulp per
    weight, times |x|."""
    base_y, w, e_base = base
    with torch.no_grad():
        y = layer(x).double()
    term = x.double() @ (strength * delta(w)).T
    miss = (y - base_y.double() - term).abs()
    scale = float(term.abs().max())
    if x.dtype == torch.float32:
        bound = 1e-5 * scale + 4 * torch.finfo(torch.float32).eps * float(y.abs().max())
        return float(miss.max()) / bound
    gain = delta.gain(w) if isinstance(delta, Gained) else 0.0
    elementwise = gain * e_base + 0.5 * ulp(y, x.dtype) + 2 * torch.finfo(x.dtype).eps * scale
    if merged:
        elementwise = elementwise + 0.5 * x.double().abs() @ ulp(w + strength * delta(w), x.dtype).T
    return float((miss / elementwise).max())


def retention(deq_before: torch.Tensor, deq_after: torch.Tensor, intended: torch.Tensor) -> float:
    """ρ = ⟨ΔW_applied, ΔW⟩ / ‖ΔW‖², what a write into the quantized storage kept of the intended ΔW."""
    applied = (deq_after.double() - deq_before.double()).reshape(-1)
    want = intended.double().reshape(-1)
    return float(applied @ want / (want @ want))


def rms(t: torch.Tensor) -> float:
    return math.sqrt(float(t.double().pow(2).mean()))


def config_json(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def baseline(
    model: nn.Module, targets=TARGETS, dtype: torch.dtype = COMPUTE
) -> dict[str, tuple[torch.Tensor, Base]]:
    """{layer: (input, (the layer's own output on it, its own dequantized weight, that output's rounding
    against fp64 on that weight))}, taken before any adapter."""
    out = {}
    for i, path in enumerate(targets):
        layer = model.get_submodule(path)
        x = layer_input(layer, seed=200 + i).to(dtype)
        w = own_weight(layer)
        with torch.no_grad():
            y = layer(x)
        exact = x.double() @ w.T + own_bias(layer)
        out[path] = (x, (y, w, float((y.double() - exact).abs().max())))
    return out


def kohya_names(sd: dict[str, torch.Tensor], stem: str = "lora_transformer_") -> dict[str, torch.Tensor]:
    """Module-path keys (`a.b.c.<role>`) as kohya / LyCORIS name them for a diffusers Flux
    (`<stem>a_b_c.<role>`); a role is the part after the module path (`lora_down.weight`, `lokr_w1`, `alpha`,
    ...)."""
    out = {}
    for key, value in sd.items():
        cut = 2 if key.endswith(".weight") else 1
        parts = key.split(".")
        out[stem + "_".join(parts[:-cut]) + "." + ".".join(parts[-cut:])] = value
    return out


def flux_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    """One forward's inputs for the tiny Flux: 16 image tokens of 64 channels, 5 text tokens."""
    g = gen(seed)
    return {
        "hidden_states": torch.randn(1, 16, FLUX_CONFIG["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, 5, FLUX_CONFIG["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(1, FLUX_CONFIG["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(5, 3),
    }


def write_gguf_layer(path: Path, name: str, blocks: np.ndarray, qtype: str, bias: torch.Tensor) -> None:
    """One quantized Linear (its raw blocks and an F32 bias) in a .gguf file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="flux")
    writer.add_tensor(f"{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.add_tensor(f"{name}.bias", bias.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_linear(path: Path, name: str, in_features: int, out_features: int) -> nn.Module:
    """diffusers' GGUFLinear holding the file's GGUFParameter, as `from_single_file` builds it: made on meta,
    then given the tensors diffusers' `load_gguf_checkpoint` read."""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFLinear

    sd = load_gguf_checkpoint(str(path), return_tensors=True)
    with torch.device("meta"):
        layer = GGUFLinear(in_features, out_features, bias=True, compute_dtype=COMPUTE)
    layer.weight = sd[f"{name}.weight"]
    layer.bias = nn.Parameter(sd[f"{name}.bias"], requires_grad=False)
    return layer.eval()


# ------------------------------------------------------------------------------------- Nunchaku Z-Image

ZIMAGE_CONFIG = {  # widths multiples of 128 (Nunchaku's packer): dim 384 = 3 heads of 128, FFN 1024
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 384,
    "n_layers": 1,
    "n_refiner_layers": 1,
    "n_heads": 3,
    "n_kv_heads": 3,
    "cap_feat_dim": 64,
    "axes_dims": [32, 48, 48],
    "axes_lens": [64, 32, 32],
}
NUNCHAKU_TARGETS = (  # Nunchaku's own names: fused qkv, fused SwiGLU w1/w3 (net.0.proj)
    "layers.0.attention.to_qkv",
    "layers.0.attention.to_out.0",
    "layers.0.feed_forward.net.0.proj",
    "layers.0.feed_forward.net.2",
)


def nunchaku_zimage(seed: int = 0) -> nn.Module:
    """Nunchaku's real NunchakuZImageTransformer2DModel (a diffusers ZImageTransformer2DModel patched by its
    own `_patch_model(precision="int4", rank=32)`, as its `from_pretrained` does), bf16, on the CPU stand-in
    for `nunchaku._C`; each SVDQW4A4Linear holds a seeded float weight quantized and packed by nunchaku's own
    packer (helpers.nunchaku_cpu.build_svdq_linear)."""
    from helpers import nunchaku_cpu

    zimage = nunchaku_cpu.import_nunchaku("nunchaku.models.transformers.transformer_zimage")
    svdq = nunchaku_cpu.import_nunchaku("nunchaku.models.linear").SVDQW4A4Linear
    torch.manual_seed(seed)
    model = zimage.NunchakuZImageTransformer2DModel(**ZIMAGE_CONFIG).to(torch.bfloat16)
    model._patch_model(skip_refiners=True, precision="int4", rank=32)
    g = gen(seed + 1)
    for module in model.modules():
        if isinstance(module, svdq):
            w = torch.randn(module.out_features, module.in_features, generator=g) / module.in_features**0.5
            b = 0.1 * torch.randn(module.out_features, generator=g) if module.bias is not None else None
            built = nunchaku_cpu.build_svdq_linear(w, bias=b, rank=32, dtype=torch.bfloat16)
            module.load_state_dict(built.state_dict())
    return model.eval()


def zimage_pipe(transformer: nn.Module):
    """diffusers' ZImagePipeline holding `transformer` (every other component None)."""
    from diffusers import ZImagePipeline

    keys = ZImagePipeline._get_signature_keys(ZImagePipeline)[0]
    return ZImagePipeline(**(dict.fromkeys(keys) | {"transformer": transformer}))
