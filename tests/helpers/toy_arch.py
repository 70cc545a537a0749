"""A test-only architecture declared in this one file: a tiny DiT with one block chain (`toy_blocks.N.mix` /
`.gate`). tests/test_arch_registry.py registers it (arch.registry.registered) and checks that detection, the
catalog, the block maps and the support matrix script pick it up with no other change."""

from __future__ import annotations

import torch

from loraweave.arch.record import Architecture, BlockMap, Layouts, Skeleton


class ToyTransformer(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(width, width)
        self.toy_blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"mix": torch.nn.Linear(width, width), "gate": torch.nn.Linear(width, width)})
            for _ in range(depth)
        )


TOY = Architecture(
    "toy-dit",
    signature=r"^toy_blocks_\d+_(mix|gate)$",
    skeleton=Skeleton(
        "transformer", "ToyTransformer", {"width": 8, "depth": 4}, {}, "tests/helpers/toy_arch.py"
    ),
    cli_names=("toy", "toy-1"),
    blocks=BlockMap("toy", (("T", "toy_blocks", 4),)),
    layouts=Layouts(
        "toy-dit", "toy names (toy_blocks.N.mix/gate)", "none (test only)", "test_arch_registry.py"
    ),
)


def toy_lora(depth: int = 4, width: int = 8, rank: int = 2) -> dict[str, torch.Tensor]:
    """A diffusers/PEFT-named LoRA on every block Linear of the toy."""
    out = {}
    for i in range(depth):
        for name in ("mix", "gate"):
            out[f"transformer.toy_blocks.{i}.{name}.lora_A.weight"] = torch.randn(rank, width)
            out[f"transformer.toy_blocks.{i}.{name}.lora_B.weight"] = torch.randn(width, rank)
    return out
