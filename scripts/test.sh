#!/usr/bin/env bash
# Install everything from scratch and run the whole test suite plus ruff and mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # configuration: pyproject.toml [tool.mypy] (strict on engine, families, mechanisms, resolve)
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
# The comfy tests again on the newest ComfyUI tree (tests/helpers/comfy_env.py: one tree per process).
LORAWEAVE_COMFYUI=latest .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@" -m comfy  # -m last: comfy only
