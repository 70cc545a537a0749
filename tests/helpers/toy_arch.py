"""A test-only architecture declared in this one file: a tiny DiT with one block chain (`toy_blocks.N.mix` /
`.gate`). tests/test_arch_registry.py registers it (arch.registry.registered) and checks that detection, the
catalog, the block maps and the support matrix script pick it up with no other change;
tests/test_comfy_toy_arch.py checks that the ComfyUI node pack does, through the record's ComfyUI facets.

ComfyUI's side of it (`ComfyToy`, as a pack adding the architecture to ComfyUI would write it) keeps the
original names: one fused `blocks.N.mix_gate` (mix | gate rows) per block, at the widths its `unet_config`
gives. `TOY_TABLE`, the record's alias table, maps those names onto the toy's modules: registering the record
is all it takes (arch.aliases reads the tables from the registry)."""

from __future__ import annotations

import torch

from loraweave.arch.record import Architecture, BlockMap, ComfyFacets, Layouts, Skeleton
from loraweave.arch.spec import Alias, ArchTable


class ToyTransformer(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(width, width)
        self.toy_blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"mix": torch.nn.Linear(width, width), "gate": torch.nn.Linear(width, width)})
            for _ in range(depth)
        )

    @classmethod
    def from_config(cls, config: dict) -> ToyTransformer:
        """As diffusers' classes build from a config (the catalog and the ComfyUI pack build skeletons so)."""
        return cls(**config)


class ComfyToy(torch.nn.Module):
    """The toy as ComfyUI holds it: `unet_model` of ComfyUI's BaseModel (its keyword arguments are
    unet_config)."""

    def __init__(
        self, hidden: int = 8, layers: int = 4, device=None, dtype=None, operations=None, **_
    ) -> None:
        super().__init__()
        self.dtype = dtype  # ComfyUI's BaseModel reads its diffusion model's dtype
        linear = operations.Linear if operations is not None else torch.nn.Linear
        self.proj_in = linear(hidden, hidden, device=device, dtype=dtype)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"mix_gate": linear(hidden, 2 * hidden, device=device, dtype=dtype)})
            for _ in range(layers)
        )


TOY_TABLE = ArchTable(
    "toy-dit",
    ("ToyTransformer",),
    (Alias("blocks.{i}.mix_gate", ("toy_blocks.{i}.mix", "toy_blocks.{i}.gate")),),
)


def toy_from_comfy(unet_config: dict) -> dict:
    """ComfyUI's unet_config of a ComfyToy -> the toy's config at the model's widths."""
    return {"width": unet_config["hidden"], "depth": unet_config["layers"]}


TOY = Architecture(
    "toy-dit",
    (TOY_TABLE,),
    signature=r"^toy_blocks_\d+_(mix|gate)$",
    skeleton=Skeleton(
        "transformer", "ToyTransformer", {"width": 8, "depth": 4}, {}, "tests/helpers/toy_arch.py"
    ),
    cli_names=("toy", "toy-1"),
    blocks=BlockMap("toy", (("T", "toy_blocks", 4),)),
    layouts=Layouts(
        "toy-dit", "toy names (toy_blocks.N.mix/gate)", "none (test only)", "test_arch_registry.py"
    ),
    comfy=ComfyFacets(("ToyComfy",), toy_from_comfy),  # no shipped skeleton: its class builds the tree
)


def toy_lora(depth: int = 4, width: int = 8, rank: int = 2) -> dict[str, torch.Tensor]:
    """A diffusers/PEFT-named LoRA on every block Linear of the toy."""
    out = {}
    for i in range(depth):
        for name in ("mix", "gate"):
            out[f"transformer.toy_blocks.{i}.{name}.lora_A.weight"] = torch.randn(rank, width)
            out[f"transformer.toy_blocks.{i}.{name}.lora_B.weight"] = torch.randn(width, rank)
    return out


def comfy_toy(hidden: int = 6, layers: int = 3, seed: int = 0):
    """A ComfyUI MODEL of the toy: supported_models class `ToyComfy` (a pack's), ComfyUI's BaseModel building
    a ComfyToy from unet_config with ComfyUI's own operations, seeded weights; a ModelPatcher on the CPU."""
    from helpers.comfy_env import import_comfy

    c = import_comfy()
    import comfy.model_base
    import comfy.supported_models_base

    class ToyComfy(comfy.supported_models_base.BASE):
        unet_config: dict = {}
        unet_extra_config: dict = {}

        def get_model(self, state_dict, prefix="", device=None):
            return comfy.model_base.BaseModel(self, device=device, unet_model=ComfyToy)

    config = ToyComfy({"hidden": hidden, "layers": layers})
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.diffusion_model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return c.model_patcher.ModelPatcher(
        model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
    )
