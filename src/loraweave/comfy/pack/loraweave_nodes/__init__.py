"""ComfyUI shim for the loraweave node pack, written by `loraweave comfy install` (and removed by
`loraweave comfy uninstall`). The nodes live in the loraweave package, which must be installed into the Python
that runs ComfyUI (`pip install loraweave`); this file only hands ComfyUI their entry point and web folder."""

from loraweave.comfy.extension import WEB_DIRECTORY, comfy_entrypoint

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
