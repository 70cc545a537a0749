"""Write src/loraweave/comfy/skeletons/<name>.json (never edited by hand): the diffusers reference tree of
every registered architecture whose ComfyUI facets name a shipped skeleton (arch/record.py
ComfyFacets.skeleton) at its catalog config, as loraweave.comfy.skeletons.record describes it. Needs
diffusers; tests/test_comfy_skeletons.py checks the files against it.

Usage: .venv/bin/python scripts/comfy_skeletons.py"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from loraweave.arch.registry import ARCHITECTURES
    from loraweave.comfy.skeletons import FOLDER, record

    FOLDER.mkdir(exist_ok=True)
    shipped = sorted((a.comfy.skeleton, a.name) for a in ARCHITECTURES if a.comfy and a.comfy.skeleton)
    for name, arch in shipped:
        data = record(arch)
        if data is None:
            print(f"{arch}: no catalog entry or diffusers class; skipped", file=sys.stderr)
            continue
        path = FOLDER / f"{name}.json"
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"{arch}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
