"""ComfyUI's entry point to the node pack: `comfy_entrypoint()` returns the ComfyExtension listing the
LoraWeave nodes (ComfyUI v0.19.3 calls it for a custom_nodes module that has no NODE_CLASS_MAPPINGS). ComfyUI
is imported only when it is called, so `import loraweave.comfy.extension` works without ComfyUI."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("loraweave")

# The shim exports this as WEB_DIRECTORY: ComfyUI serves it, and its script shows the nodes' report text.
WEB_DIRECTORY = str(Path(__file__).parent / "web")
_warned_about: set[tuple[str, ...]] = set()  # the sets of pack folders a warning has named


def _extension_class():
    from comfy_api.latest import ComfyExtension

    from .cond_nodes import COND_NODES
    from .multi_loader import LoraWeaveMultiLoader
    from .nodes import NODES

    class LoraWeaveExtension(ComfyExtension):
        async def get_node_list(self) -> list:
            return [*NODES, LoraWeaveMultiLoader, *COND_NODES]

    return LoraWeaveExtension


def pack_folders() -> list[str]:
    """The folders of the loaded custom-node modules that hand ComfyUI this entry point (the `loraweave comfy
    install` shim, a clone), one per folder name: ComfyUI keys a pack's web folder by that name, so two names
    serve the web script twice."""
    folders: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        ours = getattr(module, "comfy_entrypoint", None) is comfy_entrypoint
        if file and ours and module.__name__ != __name__:
            folders.setdefault(Path(file).parent.name, str(Path(file).parent))
    return sorted(folders.values())


async def comfy_entrypoint():
    """The ComfyExtension of the LoraWeave nodes (ComfyUI awaits this). Two installs of the pack in one
    ComfyUI are said once in the log (the nodes are the same classes either way)."""
    from .picker import register_routes

    register_routes()  # the LoRA picker's architecture marks
    folders = tuple(pack_folders())
    if len(folders) > 1 and folders not in _warned_about:
        _warned_about.add(folders)
        log.warning(
            "comfy pack_installed_twice folders=%s: the LoraWeave pack is loaded from each (the same nodes; "
            "its web script registers once); keep one: `loraweave comfy uninstall` removes the shim",
            ",".join(folders),
        )
    return _extension_class()()
