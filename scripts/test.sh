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
# barriers): the tests that never import ComfyUI, and beside them the comfy tests on ComfyUI v0.19.3; then each
# runs one share of the comfy tests on the newest tree (tests/helpers/comfy_env.py: one tree per process;
# tests/helpers/module_share.py: the modules dealt by their measured time). Every test runs; CI must stay under
# 30 minutes.
export OMP_NUM_THREADS=1
args=("$@")
latest_share() {  # share $1 of 2 of the comfy tests on the newest tree (a share left empty by -k is no failure)
  local rc=0
  LORAWEAVE_COMFYUI=latest .venv/bin/python -m pytest tests -q -p no:cacheprovider \
    --basetemp="$(mktemp -d)/latest" --module-share "$1/2" "${args[@]}" -m comfy || rc=$?  # -m last: comfy only
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]
}
comfy_log="$(mktemp)"
(
  rc=0  # both trees run whatever the first says
  .venv/bin/python -m pytest tests -q -p no:cacheprovider --basetemp="$(mktemp -d)/comfy" "${args[@]}" -m comfy || rc=1
  echo "== the comfy tests on the newest tree (LORAWEAVE_COMFYUI=latest), share 2 of 2:"
  latest_share 2 || rc=1
  exit "$rc"
) >"$comfy_log" 2>&1 &
comfy=$!
trap 'kill "$comfy" 2>/dev/null || true' EXIT
main_rc=0
.venv/bin/python -m pytest tests -q -p no:cacheprovider "${args[@]}" -m "not comfy" || main_rc=$?
echo "== the comfy tests on the newest tree (LORAWEAVE_COMFYUI=latest), share 1 of 2:"
latest_share 1 || main_rc=1
comfy_rc=0
wait "$comfy" || comfy_rc=$?
echo "== the comfy tests on ComfyUI v0.19.3, then share 2 of 2 on the newest tree:"
cat "$comfy_log"
exit $((main_rc || comfy_rc))
