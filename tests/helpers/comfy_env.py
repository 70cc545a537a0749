"""Headless, in-process, CPU import of a ComfyUI source tree: v0.19.3 (../shared/comfyui/ComfyUI) by default,
or the newest one (../shared/comfyui-latest/ComfyUI, master of 2026-08-22) when LORAWEAVE_COMFYUI=latest. One
process imports one tree, so scripts/test.sh runs the comfy tests a second time with the variable set.

`import_comfy()` returns the imported `comfy` package after the recipe of ../shared/comfyui/README.md:
diffusers and transformers first (they probe torchvision once at import), then a stub `torchvision` (and
`torchaudio`) in sys.modules, then `comfy.cli_args.args.cpu = True` before `comfy.model_management` is
imported. A missing ComfyUI tree is a failure, never a skip."""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
COMFYUI_TREES = {
    "v0.19.3": REPO_ROOT.parent / "shared" / "comfyui" / "ComfyUI",
    "latest": REPO_ROOT.parent / "shared" / "comfyui-latest" / "ComfyUI",
}
COMFYUI_TREE = os.environ.get("LORAWEAVE_COMFYUI", "v0.19.3")
assert COMFYUI_TREE in COMFYUI_TREES, f"LORAWEAVE_COMFYUI={COMFYUI_TREE!r}: one of {sorted(COMFYUI_TREES)}"
COMFYUI_DIR = COMFYUI_TREES[COMFYUI_TREE]
# ComfyUI imports these at module level (cosmos, cascade, audio VAEs); the PyPI wheels would pull a CUDA
# torch.
STUBBED = ("torchvision", "torchaudio")


class _StubModule(types.ModuleType):
    """A module whose every attribute is another stub: enough for `from torchvision import transforms`."""

    __path__: list[str] = []  # a package, so `import torchvision.transforms` resolves through sys.modules

    def __getattr__(self, name: str) -> types.ModuleType:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _StubModule(f"{self.__name__}.{name}")
        sys.modules[child.__name__] = child
        setattr(self, name, child)
        return child


class _StubFinder:
    """Resolves `import torchvision.x.y` to stubs (a plain sys.modules entry covers only the top name)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        return None


def _install_stubs() -> None:
    for name in STUBBED:
        if name not in sys.modules:
            sys.modules[name] = _StubModule(name)
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())


def comfy_dir() -> Path:
    # Loud on purpose: the comfy tests prove nothing without the real ComfyUI tree.
    assert (COMFYUI_DIR / "comfy" / "model_patcher.py").is_file(), (
        f"missing ComfyUI {COMFYUI_TREE} source at {COMFYUI_DIR}"
    )
    return COMFYUI_DIR


def import_comfy() -> types.ModuleType:
    """Import ComfyUI headless on CPU (once per process) and return the `comfy` package with its core modules
    loaded: model_management, model_patcher, sd, lora, supported_models, model_detection, weight_adapter."""
    root = str(comfy_dir())
    if "comfy.model_management" not in sys.modules:
        import diffusers  # noqa: F401  (before the stub: diffusers probes torchvision once at import)
        import transformers  # noqa: F401

        _install_stubs()
        if root not in sys.path:
            sys.path.insert(0, root)
        import comfy.options  # noqa: F401  (no enable_args_parsing: args come from parse_args([]))
        from comfy.cli_args import args

        args.cpu = True
    import comfy.lora
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    import comfy.weight_adapter

    assert comfy.model_management.cpu_state == comfy.model_management.CPUState.CPU, (
        "ComfyUI did not start on CPU"
    )
    return comfy


# The cache_args keys main.py passes on either tree: the newest reads "ram_inactive" by key (v0.19.3 has no
# such key and reads the others with .get). A classic cache with no RAM headroom, as the tests had.
CACHE_ARGS = {"lru": 0, "ram": 0, "ram_inactive": 0}


def prompt_executor(server):
    """ComfyUI's PromptExecutor with a classic cache, built as main.py builds it, reporting to `server`."""
    import_comfy()
    import execution

    return execution.PromptExecutor(
        server, cache_type=execution.CacheType.CLASSIC, cache_args=dict(CACHE_ARGS)
    )
