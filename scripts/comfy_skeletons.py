"""Write src/loraweave/comfy/skeletons/<arch>.json (never edited by hand): the diffusers reference tree of
every architecture the ComfyUI pack maps (loraweave.comfy.targets.COMFY_ARCHS) at its catalog config, as
loraweave.comfy.skeletons.record describes it. Needs diffusers; tests/test_comfy_skeletons.py checks the files
against it.

Usage: .venv/bin/python scripts/comfy_skeletons.py"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from loraweave.comfy.skeletons import FOLDER, record
    from loraweave.comfy.targets import COMFY_ARCHS

    FOLDER.mkdir(exist_ok=True)
    for arch in sorted(set(COMFY_ARCHS.values())):
        data = record(arch)
        if data is None:
            print(f"{arch}: no catalog entry or diffusers class; skipped", file=sys.stderr)
            continue
        path = FOLDER / f"{arch}.json"
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"{arch}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
