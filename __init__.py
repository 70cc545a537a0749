"""ComfyUI custom-node entry for a clone of this repository: the ComfyUI registry and ComfyUI-Manager install
a pack by cloning its repository into custom_nodes/ and importing the folder. This puts the clone's src/ first
on sys.path and hands ComfyUI loraweave's entry point and web folder. It is not part of the loraweave package
(the src/ layout keeps it out of the wheel); the other way in is `pip install loraweave[comfy]` and
`loraweave comfy install COMFYUI_DIR`. loraweave's own requirements (torch, safetensors, tqdm) ship with
ComfyUI."""

import os
import sys

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

from loraweave.comfy.extension import WEB_DIRECTORY, comfy_entrypoint  # noqa: E402  (needs src/ on sys.path)

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
