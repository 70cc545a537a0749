"""`loraweave comfy install | uninstall`: put the node pack's shim into a ComfyUI's custom_nodes folder
(ComfyUI v0.19.3 has no entry-point discovery: a pack is a folder there) and take away exactly what was put
there.

The shim is the folder `pack/loraweave_nodes` shipped inside this package; install copies its files and a
manifest of their hashes, uninstall removes only files whose hash still matches. `yaml_entry` is the other way
in: an `extra_model_paths.yaml` entry whose `custom_nodes` is the shipped `pack` folder, nothing written."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import ArgumentError
from ..io.write import atomic_path

log = logging.getLogger("loraweave")

SHIM_NAME = "loraweave_nodes"
PACK_DIR = Path(__file__).parent / "pack"
SHIM_SOURCE = PACK_DIR / SHIM_NAME
MANIFEST = ".loraweave-install.json"
# What every ComfyUI checkout has at its root (v0.19.3 and the releases around it).
COMFYUI_MARKERS = ("main.py", "nodes.py", "folder_paths.py", "comfy", "comfy_extras")

Action = Literal["install", "uninstall"]


@dataclass
class InstallResult:
    """What install or uninstall did: the ComfyUI it checked, the folder it wrote into, the files touched."""

    action: Action
    comfyui: str
    custom_nodes: str
    shim: str
    files: list[str] = field(default_factory=list)
    left: list[str] = field(
        default_factory=list
    )  # uninstall: files in the shim folder that install never wrote

    def to_dict(self) -> dict:
        return asdict(self)


def check_comfyui(root: str | Path) -> Path:
    """The ComfyUI root, or ArgumentError naming the folder and the first marker it lacks."""
    root = Path(root)
    if not root.is_dir():
        raise ArgumentError(f"{root}: not a ComfyUI folder (no such directory)")
    for marker in COMFYUI_MARKERS:
        if not (root / marker).exists():
            raise ArgumentError(
                f"{root}: not a ComfyUI folder (no {marker}; expected {', '.join(COMFYUI_MARKERS)})"
            )
    return root.resolve()


def custom_nodes_of(root: str | Path, base_directory: str | Path | None = None) -> Path:
    """The custom_nodes folder ComfyUI at `root` reads; with `--base-directory BASE` (ComfyUI's own flag)
    BASE's."""
    comfyui = check_comfyui(root)
    base = Path(base_directory).resolve() if base_directory is not None else comfyui
    if base_directory is not None and not base.is_dir():
        raise ArgumentError(f"{base}: base directory does not exist")
    return base / "custom_nodes"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _shim_files() -> list[Path]:
    return sorted(p for p in SHIM_SOURCE.iterdir() if p.is_file() and p.suffix == ".py")


def _manifest(shim: Path) -> dict | None:
    path = shim / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError("files is not a name -> sha256 table")
    except (ValueError, KeyError, TypeError) as exc:
        raise ArgumentError(f"{path}: unreadable install manifest, field 'files': {exc}") from exc
    return data


def install(root: str | Path, base_directory: str | Path | None = None) -> InstallResult:
    """Write the shim folder into custom_nodes (again over an earlier install of ours); refuse a folder of
    that name that loraweave did not write."""
    from .. import __version__

    comfyui = check_comfyui(root)
    nodes_dir = custom_nodes_of(comfyui, base_directory)
    shim = nodes_dir / SHIM_NAME
    if shim.exists() and _manifest(shim) is None:
        raise ArgumentError(
            f"{shim}: exists and was not written by loraweave comfy install; move it away first"
        )
    nodes_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    with atomic_path(shim, folder=True) as tmp:
        for src in _shim_files():
            shutil.copyfile(src, tmp / src.name)
            files[src.name] = _sha256(src)
        manifest = {"written_by": f"loraweave {__version__}", "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("comfy install shim=%s files=%d", shim, len(files))
    return InstallResult("install", str(comfyui), str(nodes_dir), str(shim), sorted(files) + [MANIFEST])


def uninstall(root: str | Path, base_directory: str | Path | None = None) -> InstallResult:
    """Remove what install wrote (and the bytecode Python compiled from it); other files stay, and so does the
    folder if they exist. A shim file changed since install is refused, nothing removed."""
    comfyui = check_comfyui(root)
    nodes_dir = custom_nodes_of(comfyui, base_directory)
    shim = nodes_dir / SHIM_NAME
    manifest = _manifest(shim) if shim.is_dir() else None
    if manifest is None:
        raise ArgumentError(f"{shim}: no loraweave install here (no {MANIFEST})")
    for name, digest in manifest["files"].items():
        path = shim / name
        if path.is_file() and _sha256(path) != digest:
            raise ArgumentError(f"{path}: changed since loraweave installed it; nothing removed")
    removed = []
    for name in manifest["files"]:
        if (shim / name).is_file():
            (shim / name).unlink()
            removed.append(name)
    (shim / MANIFEST).unlink()
    removed.append(MANIFEST)
    removed += _remove_bytecode(shim, manifest["files"])
    left = sorted(str(p.relative_to(shim)) for p in shim.rglob("*"))
    if not left:
        shim.rmdir()
    log.info("comfy uninstall shim=%s removed=%d left=%d", shim, len(removed), len(left))
    return InstallResult("uninstall", str(comfyui), str(nodes_dir), str(shim), removed, left)


def _remove_bytecode(shim: Path, names) -> list[str]:
    """__pycache__/<stem>.*.pyc of the shim's own modules (ComfyUI's import wrote them)."""
    cache = shim / "__pycache__"
    if not cache.is_dir():
        return []
    stems = {Path(n).stem for n in names if n.endswith(".py")}
    removed = []
    for pyc in cache.glob("*.pyc"):
        if pyc.name.split(".", 1)[0] in stems:
            pyc.unlink()
            removed.append(str(pyc.relative_to(shim)))
    if not any(cache.iterdir()):
        cache.rmdir()
    return removed


def yaml_entry(root: str | Path) -> str:
    """The `extra_model_paths.yaml` entry (in the ComfyUI root) that loads the pack from this installed
    package."""
    check_comfyui(root)
    return f"loraweave:\n    custom_nodes: {PACK_DIR.resolve()}\n"
