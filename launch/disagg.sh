#!/usr/bin/env bash
# Disaggregated serving on one host: Dynamo frontend + a prefill and a decode vLLM (or mock), each with its
# own `trio-sidecar run --disaggregation-mode prefill|decode`.
#
# Usage:
#   launch/disagg.sh [--mock] [--etcd-nats] [-- EXTRA `trio-sidecar run` FLAGS (both sidecars)]
#
# vLLM moves the KV cache between the two engines itself (NIXL, --kv-transfer-config with kv_producer /
# kv_consumer); the sidecars only relay kv_transfer_params through Dynamo. The mocks emulate that handoff on
# the wire (synthetic transfer parameters, no KV data). Real vLLM disaggregation needs the NIXL connector,
# which the CPU build does not provide.
#
# Environment (defaults; MODEL, SERVED_MODEL_NAME, HTTP_HOST, HTTP_PORT, NAMESPACE, ROUTER_MODE,
# FRONTEND_ARGS, VLLM, VLLM_ARGS, MOCK_ENGINE_ARGS, PYTHON, TRIO_SIDECAR, READY_TIMEOUT, STOP_TIMEOUT and
# WORK_DIR as in launch/agg.sh):
#   DECODE_GRPC_PORT         decode vLLM/mock gRPC port on 127.0.0.1 (50051; the mock also accepts 0)
#   PREFILL_GRPC_PORT        prefill vLLM/mock gRPC port on 127.0.0.1 (50052; the mock also accepts 0)
#   DECODE_VLLM_HTTP_PORT    decode vLLM's own HTTP port on 127.0.0.1 (18001)
#   PREFILL_VLLM_HTTP_PORT   prefill vLLM's own HTTP port on 127.0.0.1 (18002)
#   DECODE_NIXL_PORT         decode vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT (20097)
#   PREFILL_NIXL_PORT        prefill vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT (20098)
#   PREFILL_KV_EVENTS_PORT   prefill vLLM's KV-event ZMQ port on 127.0.0.1 (20081)
#
# Security: vLLM's gRPC port is unauthenticated. Both are bound to 127.0.0.1 here and must never be exposed.

set -euo pipefail
# shellcheck source=launch/agg.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/agg.sh"

launch_disagg_main() {
    launch_parse_args "$@"
    DECODE_GRPC_PORT=${DECODE_GRPC_PORT:-50051}
    PREFILL_GRPC_PORT=${PREFILL_GRPC_PORT:-50052}
    DECODE_VLLM_HTTP_PORT=${DECODE_VLLM_HTTP_PORT:-18001}
    PREFILL_VLLM_HTTP_PORT=${PREFILL_VLLM_HTTP_PORT:-18002}
    DECODE_NIXL_PORT=${DECODE_NIXL_PORT:-20097}
    PREFILL_NIXL_PORT=${PREFILL_NIXL_PORT:-20098}
    PREFILL_KV_EVENTS_PORT=${PREFILL_KV_EVENTS_PORT:-20081}
    LAUNCH_INSTANCES=2
    launch_setup
    launch_etcd_nats

    local decode_endpoint prefill_endpoint
    if ((LAUNCH_USE_MOCK)); then
        launch_mock decode-mock "$DECODE_GRPC_PORT" decode
        decode_endpoint=$LAUNCH_GRPC_ENDPOINT
        launch_mock prefill-mock "$PREFILL_GRPC_PORT" prefill
        prefill_endpoint=$LAUNCH_GRPC_ENDPOINT
    else
        LAUNCH_VLLM_ENV=("VLLM_NIXL_SIDE_CHANNEL_HOST=$LOOPBACK" "VLLM_NIXL_SIDE_CHANNEL_PORT=$DECODE_NIXL_PORT")
        launch_vllm decode-vllm "$DECODE_GRPC_PORT" "$DECODE_VLLM_HTTP_PORT" \
            --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
        decode_endpoint=$LAUNCH_GRPC_ENDPOINT
        LAUNCH_VLLM_ENV=("VLLM_NIXL_SIDE_CHANNEL_HOST=$LOOPBACK" "VLLM_NIXL_SIDE_CHANNEL_PORT=$PREFILL_NIXL_PORT")
        launch_vllm prefill-vllm "$PREFILL_GRPC_PORT" "$PREFILL_VLLM_HTTP_PORT" \
            --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}' \
            --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://$LOOPBACK:$PREFILL_KV_EVENTS_PORT\",\"topic\":\"kv\"}"
        prefill_endpoint=$LAUNCH_GRPC_ENDPOINT
    fi
    launch_frontend
    launch_sidecar decode-sidecar "$decode_endpoint" --disaggregation-mode decode
    launch_sidecar prefill-sidecar "$prefill_endpoint" --disaggregation-mode prefill
    launch_wait_ready
    launch_supervise
}

launch_disagg_main "$@"
