#!/usr/bin/env bash
# Create .venv with the CPU torch wheel (never a multi-GB CUDA build) and install loraweave.
# Usage: scripts/setup.sh [extra]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-diffusers}"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# Pin the CPU wheel first; the package's own torch requirement is a range this satisfies.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[${extra}]"
# The comfy tests import ComfyUI in place (../shared/comfyui/ComfyUI); its requirements, torch held at the pin.
if [ "$extra" = test ]; then
  .venv/bin/pip install -q -r scripts/comfyui-requirements.txt -c <(echo torch==2.13.0)
  # The newest tree (../shared/comfyui-latest/ComfyUI) pins another web frontend: beside the venv's own, for
  # its browser tests (tests/helpers/comfy_server.py serves it with --front-end-root).
  frontend=1.49.6
  .venv/bin/pip install -q --no-deps --target ".venv/comfyui-frontend-$frontend" \
    "comfyui-frontend-package==$frontend"
fi
