#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (unit + integration on the default model).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
