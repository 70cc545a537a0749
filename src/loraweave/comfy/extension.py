"""ComfyUI's entry point to the node pack: `comfy_entrypoint()` returns the ComfyExtension listing the
LoraWeave nodes (ComfyUI v0.19.3 calls it for a custom_nodes module that has no NODE_CLASS_MAPPINGS). ComfyUI
is imported only when it is called, so `import loraweave.comfy.extension` works without ComfyUI."""

from __future__ import annotations

from pathlib import Path

# The shim exports this as WEB_DIRECTORY: ComfyUI serves it, and its script shows the nodes' report text.
WEB_DIRECTORY = str(Path(__file__).parent / "web")


def _extension_class():
    from comfy_api.latest import ComfyExtension

    from .multi_loader import LoraWeaveMultiLoader
    from .nodes import NODES

    class LoraWeaveExtension(ComfyExtension):
        async def get_node_list(self) -> list:
            return [*NODES, LoraWeaveMultiLoader]

    return LoraWeaveExtension


async def comfy_entrypoint():
    """The ComfyExtension of the LoraWeave nodes (ComfyUI awaits this)."""
    return _extension_class()()
