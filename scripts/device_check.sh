#!/usr/bin/env bash
# The CUDA checks, in one command for a GPU machine: streaming (issue 8), offload with streams and CUDA devices
# (issue 17), undo records in pinned host memory (issue 15), then benchmarks/stream_gpu.py (step time vs resident
# at 100/50/25 % budgets, prefix and spread placements), then the compile tests (whole-model inductor included).
#
# Uses the machine's own python3 with CUDA torch; loraweave runs from src/ (pure Python). Packages the machine
# lacks travel as wheels in .whl/ (ignored by git; on this workplace's H200 image: diffusers, importlib_metadata):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl diffusers==0.42.1 importlib_metadata
# then run with .whl carried:  bash scripts/device_check.sh   (results under $OUT, default ./out)
set -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-} SDNQ_USE_TORCH_COMPILE=0 PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
"$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_streaming_cuda.py tests/test_undo_cuda.py \
    tests/test_offload.py 2>&1 | tee "$OUT/cuda_tests.log"
tests=$?
"$PY" benchmarks/stream_gpu.py --out "$OUT/stream_gpu.json" 2>&1 | tee "$OUT/stream_gpu.log"
bench=$?
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_compile.py 2>&1 \
    | tee "$OUT/compile_tests.log"
compiled=$?
echo "cuda tests rc=$tests  benchmark rc=$bench  compile rc=$compiled"
exit $(( tests || bench || compiled ))
