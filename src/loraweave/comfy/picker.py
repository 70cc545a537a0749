"""What the LoRA picker shows beside each file of ComfyUI's "loras" folders: the architecture its header's
names and shapes say it was trained for (no tensor is read), and whether it fits the model a loader last
ran on (the engine's decision, engine/decide.py `fits_model`: a file that is unsure is never marked). The
web script asks GET ROUTE?model=<architecture>, the name a loader's run sends beside its report (MODEL_UI);
`lora_archs` computes the answer and can be called without a server."""

from __future__ import annotations

import asyncio
import logging
import sys

from ..arch.fit import FileArch, file_arch, label, model_arch
from ..engine.decide import fits_model
from ..errors import LoraweaveError
from ..formats.adapter import load_adapter
from ..io.file_cache import FileCache
from .lora_files import FOLDER

log = logging.getLogger("loraweave")

ROUTE = "/loraweave/lora_archs"
MODEL_UI = "loraweave_model"  # the ui field that names the architecture of the model a loader ran on
FILES_KEPT = 4096  # header detections kept, by file identity: a rewritten file is read again
header_archs: FileCache[FileArch | None] = FileCache(FILES_KEPT, weigh_files=False)
_routes_added = False


def header_arch(path: str) -> FileArch | None:
    """The architecture the .safetensors file at `path` was trained for, read from its header only (None:
    its detection names no one model, or it is no readable .safetensors file). Kept by file identity."""
    return header_archs.read(path, read_header_arch)


def read_header_arch(path) -> FileArch | None:
    if not str(path).lower().endswith(".safetensors"):
        return None
    try:
        return file_arch(load_adapter(path, header_only=True))
    except (LoraweaveError, OSError) as exc:
        log.debug("comfy picker_unread path=%s why=%s", path, exc)
        return None


def lora_archs(model: str | None = None) -> dict:
    """{"model": {name, label} or None, "files": {lora_name: {arch, label, fits}}} for every file of the
    loras folders: `arch` and `label` None where the header names no one model; `fits` False for a file of
    another architecture than registered architecture `model`, True for one it takes, None when unsure."""
    import folder_paths

    taker = model_arch(model)
    files = {}
    for name in folder_paths.get_filename_list(FOLDER):
        path = folder_paths.get_full_path(FOLDER, name)
        found = header_arch(path) if path else None
        files[name] = {
            "arch": found.name if found else None,
            "label": label(found.name) if found else None,
            "fits": fits_model(found, taker),
        }
    said = {"name": taker.name, "label": label(taker.name)} if taker else None
    return {"model": said, "files": files}


def add_routes(routes) -> None:
    """Add ROUTE to aiohttp route table `routes` (ComfyUI's PromptServer.instance.routes)."""
    from aiohttp import web

    @routes.get(ROUTE)
    async def lora_archs_route(request):
        # header reads off the event loop: a folder of many files would hold up the server
        found = await asyncio.to_thread(lora_archs, request.query.get("model") or None)
        return web.json_response(found)


def register_routes() -> None:
    """Add ROUTE to ComfyUI's server, once; nothing where no server runs (a script, the tests' executor)."""
    global _routes_added
    # ComfyUI's server module as its main.py imported it (never imported here: a script has no server)
    server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    if _routes_added or server is None:
        return
    add_routes(server.routes)
    _routes_added = True
