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
python -m pip install -q -r requirements-cpu.txt 2>&1 | grep -v "is ignored: it is neither" || true
python -m pip install -q --no-deps sglang==0.5.17
python -m pip install -q --no-deps --no-build-isolation -e .
# headless Chromium renders the observability report in its test (skipped, with the reason, where absent)
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "note: chromium could not be installed; the report rendering test will be skipped"
fi
python -c "import importlib.metadata as md; print('installed: sglang', md.version('sglang'), '| torch', md.version('torch'), '| sglang-h20', md.version('sglang-h20'))"
