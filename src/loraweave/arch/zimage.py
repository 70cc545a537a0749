"""Z-Image (Lumina2/NextDiT family) transformer: original/ComfyUI names -> diffusers modules."""

from __future__ import annotations

from .spec import Alias, ArchTable


def _block_aliases(stack: str) -> tuple[Alias, ...]:
    b = f"{stack}.{{i}}.attention"
    return (
        Alias(f"{b}.qkv", (f"{b}.to_q", f"{b}.to_k", f"{b}.to_v")),
        Alias(f"{b}.out", (f"{b}.to_out.0",)),
    )


ZIMAGE = ArchTable(
    name="z-image",
    classes=("ZImageTransformer2DModel",),
    aliases=(
        *_block_aliases("layers"),
        *_block_aliases("noise_refiner"),
        *_block_aliases("context_refiner"),
        Alias("x_embedder", ("all_x_embedder.2-1",)),
        Alias("final_layer.linear", ("all_final_layer.2-1.linear",)),
        Alias("final_layer.adaLN_modulation.1", ("all_final_layer.2-1.adaLN_modulation.1",)),
    ),
)
