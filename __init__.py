"""ComfyUI custom-node entry for a clone of this repository: the ComfyUI registry and ComfyUI-Manager install
a pack by cloning its repository into custom_nodes/ and importing the folder. This puts the clone's src/ first
on sys.path and hands ComfyUI loraweave's entry point and web folder. It is not part of the loraweave package
(the src/ layout keeps it out of the wheel); the other way in is `pip install loraweave[comfy]` and
`loraweave comfy install COMFYUI_DIR`. loraweave's own requirements (torch, safetensors, tqdm) ship with
ComfyUI.

A clone keeps the repository's name, `loraweave`, and a loader that names a module after its folder (older
ComfyUI releases, ComfyUI given a relative custom_nodes path, pytest in such a clone) imports this file as
the module `loraweave`, where `loraweave.comfy` does not exist. This file then hands that name to the real
package in src/ before importing from it; under any other name (ComfyUI's full-path names) nothing changes."""

import importlib.util
import os
import sys

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

_held = sys.modules.get("loraweave")
if _held is not None and getattr(_held, "__file__", None) == __file__:  # this file holds the package's name
    _package_dir = os.path.join(_SRC, "loraweave")
    _spec = importlib.util.spec_from_file_location(
        "loraweave", os.path.join(_package_dir, "__init__.py"), submodule_search_locations=[_package_dir]
    )
    assert _spec is not None and _spec.loader is not None
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["loraweave"] = _package  # an `import loraweave` that loaded this file returns the package
    try:
        _spec.loader.exec_module(_package)
    except BaseException:
        sys.modules["loraweave"] = _held
        raise

from loraweave.comfy.extension import WEB_DIRECTORY, comfy_entrypoint  # noqa: E402  (needs src/ on sys.path)

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
