"""Nunchaku's own transformers (Z-Image, Qwen-Image, Flux.1 v2) built from its real classes on CPU.

Full size on the meta device (every module name and width of the released configs, no storage) for the key
maps; tiny and real (a float diffusers model, then Nunchaku's `_patch_model`, then every `SVDQW4A4Linear` /
`AWQW4A16Linear` quantised from the float weights it replaced) for outputs. The fused rows are the ones
Nunchaku's forward reads: `to_qkv` = [q; k; v], `add_qkv_proj` = [add_q; add_k; add_v], the SwiGLU
`net.0.proj` = [value; gate] (Z-Image: [w3; w1]), Flux's `mlp_fc1` = `proj_mlp`.
"""

from __future__ import annotations

import copy
import inspect

import torch

from helpers.common import real_config
from helpers.nunchaku_cpu import build_awq_linear, build_svdq_linear, import_nunchaku

CLASSES = {
    "z-image": ("transformer_zimage", "NunchakuZImageTransformer2DModel"),
    "qwen-image": ("transformer_qwenimage", "NunchakuQwenImageTransformer2DModel"),
    "flux": ("transformer_flux_v2", "NunchakuFluxTransformer2DModelV2"),
}
CONFIGS = {
    "z-image": "z-image-turbo__transformer_config.json",
    "qwen-image": "qwen-image__transformer_config.json",
    "flux": "flux1-dev__transformer_config.json",
}
RANK = 32  # Nunchaku's released checkpoints' low-rank branch


def nunchaku_class(arch: str) -> type:
    module, name = CLASSES[arch]
    return getattr(import_nunchaku(f"nunchaku.models.transformers.{module}"), name)


def meta_model(arch: str):
    """The released config's transformer, patched the way Nunchaku's `from_pretrained` patches it, on meta."""
    cls = nunchaku_class(arch)
    # the released configs carry a few extra entries; Nunchaku's __init__ passes *args/**kwargs to diffusers'
    takes = inspect.signature(cls.__bases__[0].__init__).parameters
    config = {k: v for k, v in real_config(CONFIGS[arch]).items() if k in takes}
    with torch.device("meta"):
        model = cls(**config)  # not from_config: it reads the keywords off Nunchaku's (*args, **kwargs)
        model._patch_model(precision="int4", rank=RANK)
    return model


def tiny_float_zimage(seed: int = 0):
    """A float Z-Image small enough for CPU whose quantised layers meet Nunchaku's 128-multiple widths."""
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=384,  # 3 heads x 128; the SwiGLU's hidden width int(384 / 3 * 8) = 1024
        n_layers=2,
        n_refiner_layers=1,
        n_heads=3,
        n_kv_heads=3,
        cap_feat_dim=64,
        axes_dims=[32, 48, 48],
        axes_lens=[64, 32, 32],
    ).eval()
    with torch.no_grad():  # diffusers zero-initialises some layers: give every weight a scale of its own
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _zimage_pairs(float_model) -> dict[str, torch.Tensor]:
    """{Nunchaku module path: the float weight it holds}, fused in Nunchaku's row order."""
    out = {}
    for stack in ("layers", "noise_refiner", "context_refiner"):
        for i, block in enumerate(getattr(float_model, stack)):
            a, ff = block.attention, block.feed_forward
            out[f"{stack}.{i}.attention.to_qkv"] = torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight])
            out[f"{stack}.{i}.attention.to_out.0"] = a.to_out[0].weight
            out[f"{stack}.{i}.feed_forward.net.0.proj"] = torch.cat([ff.w3.weight, ff.w1.weight])
            out[f"{stack}.{i}.feed_forward.net.2"] = ff.w2.weight
    return out


def tiny_nunchaku_zimage(float_model, rank: int = RANK):
    """Nunchaku's Z-Image holding `float_model`'s weights: its own class and `_patch_model`, each
    SVDQW4A4Linear quantised from the float weight it replaced (bf16), every other module the float one."""
    cls = nunchaku_class("z-image")
    model = cls(**{k: v for k, v in dict(float_model.config).items() if not k.startswith("_")})
    model.load_state_dict(float_model.state_dict())
    model._patch_model(precision="int4", rank=rank)
    for path, weight in _zimage_pairs(float_model).items():
        parent, _, name = path.rpartition(".")
        layer = build_svdq_linear(weight.detach().float(), rank=rank)
        model.get_submodule(parent).register_module(name, layer)
    return model.eval()


def tiny_float_qwen(seed: int = 0):
    """A float Qwen-Image of one block, 2 heads x 128 (widths Nunchaku's 128-multiple packer takes)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=128,
        num_attention_heads=2,
        joint_attention_dim=64,
        axes_dims_rope=(32, 48, 48),
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _qwen_pairs(float_model) -> dict[str, torch.Tensor]:
    out = {}
    for i, block in enumerate(float_model.transformer_blocks):
        a, b = block.attn, f"transformer_blocks.{i}"
        out[f"{b}.attn.to_qkv"] = torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight])
        out[f"{b}.attn.add_qkv_proj"] = torch.cat(
            [a.add_q_proj.weight, a.add_k_proj.weight, a.add_v_proj.weight]
        )
        out[f"{b}.attn.to_out.0"] = a.to_out[0].weight
        out[f"{b}.attn.to_add_out"] = a.to_add_out.weight
        for mlp in ("img_mlp", "txt_mlp"):
            out[f"{b}.{mlp}.net.0.proj"] = getattr(block, mlp).net[0].proj.weight
            out[f"{b}.{mlp}.net.2"] = getattr(block, mlp).net[2].weight
    return out


def tiny_nunchaku_qwen(float_model, rank: int = RANK):
    """Nunchaku's Qwen-Image holding `float_model`'s weights (its SVDQW4A4Linear layers quantised from them;
    the AWQ modulation left as `_patch_model` makes it: no key lands there)."""
    cls = nunchaku_class("qwen-image")
    model = cls(**{k: v for k, v in dict(float_model.config).items() if not k.startswith("_")})
    model.load_state_dict(float_model.state_dict())
    model._patch_model(precision="int4", rank=rank)
    for path, weight in _qwen_pairs(float_model).items():
        parent, _, name = path.rpartition(".")
        layer = build_svdq_linear(weight.detach().float(), rank=rank)
        model.get_submodule(parent).register_module(name, layer)
    return model.eval()


def tiny_float_flux(seed: int = 0):
    """A float Flux.1 of one double and one single block, 2 heads x 128 (the single block's proj_out takes
    256 attention + 1024 MLP columns)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _flux_single_pairs(float_model) -> dict[str, torch.Tensor]:
    """Nunchaku's single-block layers from the float ones: proj_out split by input columns (attention first,
    as diffusers' `proj_out(cat([attn, mlp]))` reads them) into `attn.to_out` and `mlp_fc2`."""
    out = {}
    for i, block in enumerate(float_model.single_transformer_blocks):
        a, b, width = block.attn, f"single_transformer_blocks.{i}", block.attn.to_q.weight.shape[0]
        out[f"{b}.attn.to_qkv"] = torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight])
        out[f"{b}.mlp_fc1"] = block.proj_mlp.weight
        out[f"{b}.attn.to_out"] = block.proj_out.weight[:, :width]
        out[f"{b}.mlp_fc2"] = block.proj_out.weight[:, width:]
    return out


def interleave_rows(t: torch.Tensor, chunks: int) -> torch.Tensor:
    """A modulation weight (or bias) in Nunchaku's order: its forward reads `out.view(-1, chunks)`, so live
    row d·chunks + c holds diffusers' row c·dim + d."""
    return t.reshape(chunks, t.shape[0] // chunks, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _flux_modulation(float_model) -> dict[str, tuple[torch.nn.Linear, int]]:
    out = {}
    for i, block in enumerate(float_model.transformer_blocks):
        out[f"transformer_blocks.{i}.norm1.linear"] = (block.norm1.linear, 6)
        out[f"transformer_blocks.{i}.norm1_context.linear"] = (block.norm1_context.linear, 6)
    for i, block in enumerate(float_model.single_transformer_blocks):
        out[f"single_transformer_blocks.{i}.norm.linear"] = (block.norm.linear, 3)
    return out


def tiny_nunchaku_flux(float_model, rank: int = RANK):
    """Nunchaku's Flux v2 holding `float_model`'s single-block weights (its SVDQW4A4Linear layers there
    quantised from them) and modulation (each AWQW4A16Linear quantised from the float weight and bias in
    Nunchaku's interleaved row order); the double block's SVDQW4A4Linear left as `_patch_model` makes them."""
    cls = nunchaku_class("flux")
    model = cls(**{k: v for k, v in dict(float_model.config).items() if not k.startswith("_")})
    model.load_state_dict(float_model.state_dict())
    model._patch_model(precision="int4", rank=rank)
    for path, weight in _flux_single_pairs(float_model).items():
        parent, _, name = path.rpartition(".")
        layer = build_svdq_linear(weight.detach().float().contiguous(), rank=rank)
        model.get_submodule(parent).register_module(name, layer)
    for path, (linear, chunks) in _flux_modulation(float_model).items():
        parent, _, name = path.rpartition(".")
        weight, bias = (interleave_rows(t.detach().float(), chunks) for t in (linear.weight, linear.bias))
        model.get_submodule(parent).register_module(name, build_awq_linear(weight, bias))
    return model.eval()


def svdq_paths(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "SVDQW4A4Linear"]


def probe(layer) -> torch.Tensor:
    """The layer's output (N, K) for each basis input e_k (one batch of K tokens), fp64: two probes'
    difference is the ΔW a change applied, whatever carries it (appended rank, runtime term), up to bf16
    output rounding (the 4-bit path sees the same activations both times)."""
    eye = torch.eye(layer.in_features, dtype=layer.proj_up.dtype).unsqueeze(0)
    with torch.no_grad():
        return layer(eye)[0].double().T


def frozen_state(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model, cloned (bytes compared after removal)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_bytes(model, before: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes differ from `before` (dtype and shape included)."""
    now = model.state_dict()
    return [
        k
        for k, v in before.items()
        if k not in now
        or now[k].dtype != v.dtype
        or now[k].shape != v.shape
        or not torch.equal(now[k].detach().reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    ]


def copy_model(model):
    return copy.deepcopy(model)
