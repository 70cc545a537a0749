"""ComfyUI's own LoRA key map for text encoders, as a script run in a subprocess (ComfyUI in place,
read-only): `python comfy_keys.py < names.json` prints the LoRA key names ComfyUI accepts for a model whose
state dict holds `names` (JSON list). ComfyUI is imported by the shared headless harness
(comfy_env.import_comfy); a subprocess still, because that harness puts torchvision/torchaudio stubs in
sys.modules and sys.meta_path, which must not leak into a test session that has not opted into ComfyUI (the
comfy-marked modules import it in process on purpose)."""

from __future__ import annotations

import json
import sys

from comfy_env import import_comfy  # this script's folder is sys.path[0]


class StateDictNames:
    """The one thing ComfyUI's key map reads of a model: its state dict's names."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def state_dict(self) -> dict:
        return dict.fromkeys(self.names)


def main() -> None:
    comfy = import_comfy()
    print(json.dumps(sorted(comfy.lora.model_lora_keys_clip(StateDictNames(json.load(sys.stdin)), {}))))


if __name__ == "__main__":
    main()
