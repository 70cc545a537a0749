#!/usr/bin/env bash
# Install loraweave (CPU torch + diffusers extra) and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh diffusers
.venv/bin/loraweave demo "$@"
