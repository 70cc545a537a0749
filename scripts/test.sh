#!/usr/bin/env bash
# Install everything from scratch and run the whole test suite plus ruff and mypy.
# --quick: no set-up where .venv exists, no ruff/mypy, one pytest process without the slow, realsize and comfy
# tiers (the rest of the arguments go to pytest). CI runs the script without it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--quick" ]; then
  shift
  [ -x .venv/bin/python ] || bash scripts/setup.sh test
  exec .venv/bin/python -m pytest tests -q -p no:cacheprovider -m "not slow and not realsize and not comfy" "$@"
fi
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # configuration: pyproject.toml [tool.mypy] (strict on engine, families, mechanisms, resolve)
# Two processes, one per core, each with one torch thread (two 2-thread processes on 2 cores spin in OpenMP
# barriers): the tests that never import ComfyUI, and beside them the comfy tests on ComfyUI v0.19.3 and then a
# second time on the newest tree (tests/helpers/comfy_env.py: one tree per process). Every test runs; CI must
# stay under 30 minutes.
export OMP_NUM_THREADS=1
comfy_log="$(mktemp)"
(
  rc=0  # both trees run whatever the first says
  .venv/bin/python -m pytest tests -q -p no:cacheprovider --basetemp="$(mktemp -d)/comfy" "$@" -m comfy || rc=1
  LORAWEAVE_COMFYUI=latest .venv/bin/python -m pytest tests -q -p no:cacheprovider \
    --basetemp="$(mktemp -d)/latest" "$@" -m comfy || rc=1  # -m last: comfy only
  exit "$rc"
) >"$comfy_log" 2>&1 &
comfy=$!
trap 'kill "$comfy" 2>/dev/null || true' EXIT
main_rc=0
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@" -m "not comfy" || main_rc=$?
comfy_rc=0
wait "$comfy" || comfy_rc=$?
echo "== the comfy tests, on ComfyUI v0.19.3 and then on the newest tree (LORAWEAVE_COMFYUI=latest):"
cat "$comfy_log"
exit $((main_rc || comfy_rc))
