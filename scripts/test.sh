#!/usr/bin/env bash
# Install everything from scratch and run the whole test suite plus ruff and mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # configuration: pyproject.toml [tool.mypy] (strict on engine, families, mechanisms, resolve)
# The comfy tests again on the newest ComfyUI tree (tests/helpers/comfy_env.py: one tree per process), run beside
# the main pass: most tests are single-threaded, so the second core would idle (CI must stay under 30 minutes).
latest_log="$(mktemp)"
LORAWEAVE_COMFYUI=latest .venv/bin/python -m pytest tests -q -p no:cacheprovider --basetemp="$(mktemp -d)/latest" \
  "$@" -m comfy >"$latest_log" 2>&1 &  # -m last: comfy only
latest=$!
trap 'kill "$latest" 2>/dev/null || true' EXIT
main_rc=0
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@" || main_rc=$?
latest_rc=0
wait "$latest" || latest_rc=$?
echo "== the comfy tests on the newest ComfyUI tree (LORAWEAVE_COMFYUI=latest), run beside the main pass:"
cat "$latest_log"
exit $((main_rc || latest_rc))
