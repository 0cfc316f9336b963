#!/usr/bin/env bash
# KV-aware routing on one host: Dynamo frontend with --router-mode kv + two aggregated workers (vLLM or the
# mock, each with its own `trio-sidecar run`). Each engine publishes KV-cache events on ZMQ; its sidecar
# relays them to the router, which sends a request to the worker that already holds its prefix.
#
# Usage:
#   launch/agg_kv_router.sh [--mock] [--etcd-nats] [-- EXTRA `trio-sidecar run` FLAGS (both sidecars)]
#
# Environment (defaults; MODEL, SERVED_MODEL_NAME, HTTP_HOST, HTTP_PORT, NAMESPACE, FRONTEND_ARGS, VLLM,
# VLLM_ARGS, MOCK_ENGINE_ARGS, PYTHON, TRIO_SIDECAR, READY_TIMEOUT, STOP_TIMEOUT and WORK_DIR as in
# launch/agg.sh):
#   ROUTER_MODE             frontend --router-mode (kv)
#   WORKER0_GRPC_PORT       first vLLM/mock gRPC port on 127.0.0.1 (50051; the mock also accepts 0)
#   WORKER1_GRPC_PORT       second vLLM/mock gRPC port on 127.0.0.1 (50052; the mock also accepts 0)
#   WORKER0_VLLM_HTTP_PORT  first vLLM's own HTTP port on 127.0.0.1 (18001)
#   WORKER1_VLLM_HTTP_PORT  second vLLM's own HTTP port on 127.0.0.1 (18002)
#   WORKER0_KV_EVENTS_PORT  first vLLM's KV-event ZMQ port on 127.0.0.1 (20080; the mocks pick free ports)
#   WORKER1_KV_EVENTS_PORT  second vLLM's KV-event ZMQ port on 127.0.0.1 (20081)
#
# Security: vLLM's gRPC port is unauthenticated. Both are bound to 127.0.0.1 here and must never be exposed.

set -euo pipefail
# shellcheck source=launch/agg.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/agg.sh"

launch_kv_router_main() {
    launch_parse_args "$@"
    ROUTER_MODE=${ROUTER_MODE:-kv}
    LAUNCH_INSTANCES=2
    launch_setup
    launch_etcd_nats

    local endpoints=() i var grpc_port http_port kv_port
    for i in 0 1; do
        var=WORKER${i}_GRPC_PORT
        grpc_port=${!var:-$((50051 + i))}
        var=WORKER${i}_VLLM_HTTP_PORT
        http_port=${!var:-$((18001 + i))}
        var=WORKER${i}_KV_EVENTS_PORT
        kv_port=${!var:-$((20080 + i))}
        if ((LAUNCH_USE_MOCK)); then
            launch_mock "mock-$i" "$grpc_port" aggregated
        else
            launch_vllm "vllm-$i" "$grpc_port" "$http_port" \
                --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://$LOOPBACK:$kv_port\",\"topic\":\"kv\"}"
        fi
        endpoints+=("$LAUNCH_GRPC_ENDPOINT")
    done
    launch_frontend
    for i in 0 1; do
        launch_sidecar "trio-sidecar-$i" "${endpoints[i]}"
    done
    launch_wait_ready
    launch_supervise
}

launch_kv_router_main "$@"
