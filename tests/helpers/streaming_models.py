"""Tiny Flux models, LoRAs and budget arithmetic for the layer-streaming tests, and host copies packed as for
CUDA."""

from __future__ import annotations

import torch

from loraweave.streaming import hostmem

RANK = 4


def flux_deep(seed: int):
    """tiny_flux with six single blocks: big double blocks first, so a partial resident prefix exists."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=6,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
        guidance_embeds=True,
    ).eval()


def flux_batch2(model, seed: int = 1) -> torch.Tensor:
    """Batch 2, as classifier-free guidance runs it (cond and uncond stacked)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return model(
            hidden_states=torch.randn(2, 16, 16, generator=g),
            encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
            pooled_projections=torch.randn(2, 32, generator=g),
            timestep=torch.tensor([0.5, 0.5]),
            guidance=torch.tensor([3.5, 3.5]),
            img_ids=torch.zeros(16, 3),
            txt_ids=torch.zeros(5, 3),
            return_dict=False,
        )[0]


def lora_sd(model: torch.nn.Module, seed: int, prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """A peft-layout LoRA on every Linear of the model (rest and blocks alike)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            sd[f"{prefix}.{name}.lora_A.weight"] = torch.randn(RANK, m.in_features, generator=g) * 0.1
            sd[f"{prefix}.{name}.lora_B.weight"] = torch.randn(m.out_features, RANK, generator=g) * 0.1
    return sd


def _aligned(n: int) -> int:
    return (n + 255) // 256 * 256


def aligned_bytes(module: torch.nn.Module) -> int:
    return sum(_aligned(t.numel() * t.element_size()) for t in [*module.parameters(), *module.buffers()])


def flux_blocks(model) -> list[torch.nn.Module]:
    return [*model.transformer_blocks, *model.single_transformer_blocks]


def travelling_bytes(block: torch.nn.Module) -> int:
    """A block's LoRA factors in its slot: down (r×in) and up (out×r) per Linear, fp32, each 256-aligned."""
    return sum(
        _aligned(RANK * m.in_features * 4) + _aligned(m.out_features * RANK * 4)
        for m in block.modules()
        if isinstance(m, torch.nn.Linear)
    )


def kept_factor_bytes(model) -> int:
    """Factor bytes that stay on the device: the whole LoRA (down, up, scale) of layers outside the blocks,
    and the per-rank scale vector of every layer inside them."""
    inside = {id(m) for b in flux_blocks(model) for m in b.modules()}
    return sum(
        (RANK * m.in_features + m.out_features * RANK + RANK) * 4 if id(m) not in inside else RANK * 4
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )


def footprint(block: torch.nn.Module, lora: bool) -> int:
    return aligned_bytes(block) + (travelling_bytes(block) if lora else 0)


def rest_bytes(model) -> int:
    return aligned_bytes(model) - sum(aligned_bytes(b) for b in flux_blocks(model))


def min_budget(model, lora: bool = False, resident: int = 0) -> int:
    """Rest (+ kept factors) + the first `resident` blocks + two slots of the largest streamed block,
    recounted from the model: the least that plan needs."""
    sizes = [footprint(b, lora) for b in flux_blocks(model)]
    return (
        rest_bytes(model)
        + (kept_factor_bytes(model) if lora else 0)
        + sum(sizes[:resident])
        + 2 * max(sizes[resident:])
    )


def pack_like_cuda(monkeypatch) -> None:
    """Host copies packed and grouped as for a CUDA device (pinned rounding), in unpinned CPU memory."""
    monkeypatch.setattr(hostmem, "pins", lambda device, storage: True)
    monkeypatch.setattr(hostmem, "host_buffer", lambda n, storage, pin: torch.empty(n, dtype=torch.uint8))
