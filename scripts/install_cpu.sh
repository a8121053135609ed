#!/usr/bin/env bash
# Install what the CPU test suite needs into the active Python (a venv is made at ./.venv if none is active).
# sglang is installed --no-deps plus the subset of its dependencies that its import path needs
# (requirements-cpu.txt): the full set pulls several GB of GPU-only packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then  # standalone use
  [ -d .venv ] || python3 -m venv .venv
  . .venv/bin/activate
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q -r requirements-cpu.txt
python -m pip install -q --no-deps sglang==0.5.17
python -m pip install -q --no-deps --no-build-isolation -e .
python -c "import importlib.metadata as md; print('installed: sglang', md.version('sglang'), '| torch', md.version('torch'), '| sglang-h20', md.version('sglang-h20'))"
