"""`loraweave comfy demo DIR`: the node pack tried on a machine without model weights. Writes a tiny
Flux.1-dev (BFL layout, hidden 128, one double and one single block, seeded: ComfyUI's "Load Diffusion Model"
detects it as Flux), a kohya LoRA for it with trigger words, an `extra_model_paths.yaml` pointing ComfyUI at
both, and an API-format workflow: the model through LoraWeave Loader (model only), its report shown by core's
Preview as Text, and LoraWeave Inspect on the same file. Nothing is downloaded; nothing is rendered (the model
comes with no text encoder or VAE)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import WriteError
from ..io.write import atomic_path, save_file

MODEL_FILE = "loraweave_demo_flux.safetensors"
LORA_FILE = "loraweave_demo_lora.safetensors"
WORKFLOW_FILE = "loraweave_demo_workflow.json"
YAML_FILE = "extra_model_paths.yaml"
MODEL_PATH = Path("models", "diffusion_models", MODEL_FILE)
LORA_PATH = Path("models", "loras", LORA_FILE)
HIDDEN, TEXT_WIDTH, LATENT_WIDTH, MLP_RATIO = 128, 32, 64, 4  # latent: 16 channels x 2x2 patches
RANK, ALPHA = 4, 2.0
TRIGGER_WORDS = {"1_lwdemo": {"lwdemo": 12, "tiny flux": 3}}  # kohya's ss_tag_frequency: Inspect's triggers


def flux_linears(hidden: int = HIDDEN) -> dict[str, tuple[int, int]]:
    """Each Linear of the tiny Flux: BFL name -> (out, in) features. One attention head of width `hidden`
    (ComfyUI reads the head count as hidden / 128, the sum of Flux's rotary axes)."""
    mlp = MLP_RATIO * hidden
    shapes = {
        "img_in": (hidden, LATENT_WIDTH),
        "time_in.in_layer": (hidden, 256),
        "time_in.out_layer": (hidden, hidden),
        "vector_in.in_layer": (hidden, TEXT_WIDTH),
        "vector_in.out_layer": (hidden, hidden),
        "guidance_in.in_layer": (hidden, 256),
        "guidance_in.out_layer": (hidden, hidden),
        "txt_in": (hidden, TEXT_WIDTH),
    }
    for stream in ("img", "txt"):
        block = f"double_blocks.0.{stream}_"
        shapes |= {
            f"{block}mod.lin": (6 * hidden, hidden),
            f"{block}attn.qkv": (3 * hidden, hidden),
            f"{block}attn.proj": (hidden, hidden),
            f"{block}mlp.0": (mlp, hidden),
            f"{block}mlp.2": (hidden, mlp),
        }
    shapes |= {
        "single_blocks.0.linear1": (3 * hidden + mlp, hidden),
        "single_blocks.0.linear2": (hidden, hidden + mlp),
        "single_blocks.0.modulation.lin": (3 * hidden, hidden),
        "final_layer.linear": (LATENT_WIDTH, hidden),
        "final_layer.adaLN_modulation.1": (2 * hidden, hidden),
    }
    return shapes


NORMS = tuple(
    f"{where}norm.{kind}_norm.scale"
    for where in ("double_blocks.0.img_attn.", "double_blocks.0.txt_attn.", "single_blocks.0.")
    for kind in ("query", "key")
)


def tiny_flux(seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's state dict: seeded weights (x0.05) and biases, RMSNorm scales of one."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (out, inp) in flux_linears().items():
        tensors[f"{name}.weight"] = torch.randn(out, inp, generator=g) * 0.05
        tensors[f"{name}.bias"] = torch.randn(out, generator=g) * 0.05
    return tensors | {name: torch.ones(HIDDEN) for name in NORMS}


def demo_lora(seed: int = 1) -> dict[str, torch.Tensor]:
    """A kohya LoRA (rank 4, alpha 2) on every Linear of the two blocks."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (out, inp) in flux_linears().items():
        if name.startswith(("double_blocks.", "single_blocks.")):
            stem = "lora_unet_" + name.replace(".", "_")
            tensors[f"{stem}.lora_down.weight"] = torch.randn(RANK, inp, generator=g) * 0.1
            tensors[f"{stem}.lora_up.weight"] = torch.randn(out, RANK, generator=g) * 0.1
            tensors[f"{stem}.alpha"] = torch.tensor(ALPHA)
    return tensors


def workflow() -> dict:
    """The API-format prompt (ComfyUI's page loads it when the file is dropped on it; POST /prompt runs
    it)."""
    model = ["1", 0]
    return {
        "1": {
            "class_type": "UNETLoader",
            "inputs": {"unet_name": MODEL_FILE, "weight_dtype": "default"},
            "_meta": {"title": "Load Diffusion Model (tiny Flux, random weights)"},
        },
        "2": {
            "class_type": "LoraWeaveLoaderModelOnly",
            "inputs": {
                "model": model,
                "lora_name": LORA_FILE,
                "strength_model": 1.0,
                "mode": "auto",
                "strict": False,
            },
        },
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
        "4": {"class_type": "LoraWeaveInspect", "inputs": {"lora_name": LORA_FILE, "model": model}},
    }


def yaml_text(folder: Path) -> str:
    """ComfyUI's extra_model_paths.yaml entry for the demo's models (main.py --extra-model-paths-config)."""
    return (
        "loraweave_demo:\n"
        f"  base_path: {json.dumps(str(folder))}\n"
        f"  diffusion_models: {MODEL_PATH.parent.as_posix()}\n"
        f"  loras: {LORA_PATH.parent.as_posix()}\n"
    )


@dataclass(frozen=True)
class DemoFiles:
    """What `write_demo` wrote, by role, and the ComfyUI command line that loads the models."""

    folder: str
    model: str
    lora: str
    workflow: str
    extra_model_paths: str
    comfyui_args: str

    def to_dict(self) -> dict:
        return asdict(self)


def write_demo(folder: str | Path, overwrite: bool = False) -> DemoFiles:
    """Write the demo's four files under `folder` (created if its parent exists; its other files stay).
    A file of the demo already there is refused unless `overwrite`."""
    root = Path(folder).resolve()
    names = (MODEL_PATH, LORA_PATH, Path(WORKFLOW_FILE), Path(YAML_FILE))
    if not root.parent.is_dir():
        raise WriteError(f"output {folder}: its folder does not exist (create it first)")
    if root.exists() and not root.is_dir():
        raise WriteError(f"output {folder} is a file; the demo writes a folder there (name another output)")
    there = [name for name in names if (root / name).exists()]
    if there and not overwrite:
        raise WriteError(f"output {Path(folder) / there[0]} exists (pass --force to replace it)")
    with atomic_path(root, folder=True) as tmp:
        for name in names:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(tiny_flux(), tmp / MODEL_PATH)
        meta = {"ss_tag_frequency": json.dumps(TRIGGER_WORDS), "ss_network_dim": str(RANK)}
        save_file(demo_lora(), tmp / LORA_PATH, metadata=meta)
        (tmp / WORKFLOW_FILE).write_text(json.dumps(workflow(), indent=2) + "\n")
        (tmp / YAML_FILE).write_text(yaml_text(root))
    return DemoFiles(
        folder=str(root),
        model=str(root / MODEL_PATH),
        lora=str(root / LORA_PATH),
        workflow=str(root / WORKFLOW_FILE),
        extra_model_paths=str(root / YAML_FILE),
        comfyui_args=f"--extra-model-paths-config {root / YAML_FILE}",
    )
