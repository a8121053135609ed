#!/usr/bin/env bash
# The test command (README, CI): install what the CPU suite needs into ./.venv, then run it.
# GPU tests (marker `gpu`) are skipped without a Hopper GPU; scripts/gpu_check.sh runs them on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || { [ -d .venv ] || python3 -m venv .venv; . .venv/bin/activate; }
bash scripts/install_cpu.sh
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}   # Triton kernels run on the CPU interpreter here
python -m pytest test -q "$@"
