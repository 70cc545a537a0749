"""ComfyUI's own LoRA key map for text encoders, as a script run in a subprocess (ComfyUI in place, read-only):
`python comfy_keys.py COMFYUI_DIR < names.json` prints the LoRA key names ComfyUI accepts for a model whose
state dict holds `names` (JSON list). A subprocess, because importing ComfyUI headless needs a torchvision stub in
sys.modules, which must not leak into the test session (shared/comfyui/README.md)."""

from __future__ import annotations

import json
import sys
import types


class StateDictNames:
    """The one thing ComfyUI's key map reads of a model: its state dict's names."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def state_dict(self) -> dict:
        return dict.fromkeys(self.names)


def main(comfy_dir: str) -> None:
    import diffusers  # noqa: F401  (they probe torchvision once, before the stub)
    import transformers  # noqa: F401

    stub = types.ModuleType("torchvision")
    stub.transforms = types.ModuleType("torchvision.transforms")
    sys.modules.update({"torchvision": stub, "torchvision.transforms": stub.transforms})
    sys.path.insert(0, comfy_dir)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.lora

    print(json.dumps(sorted(comfy.lora.model_lora_keys_clip(StateDictNames(json.load(sys.stdin)), {}))))


if __name__ == "__main__":
    main(sys.argv[1])
