"""The RL controls' pure core (docs/rl.md): route plan, body parsing, answers, the rl endpoint, the admin URL.

The expected texts are the native 1.6.1 sidecar's, as observed (docs/dynamo.md#rl-controls).
"""

from __future__ import annotations

import json

import pytest

from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar.core.errors import CannotConnect, InvalidArgument, ProtocolError, native_error_text, status_to_error
from trio_sidecar.core.rl_requests import (
    LORA_ROUTES,
    PauseMode,
    PauseRequest,
    RlCapabilities,
    SleepRequest,
    engine_routes,
    parse_admin_base_url,
    parse_finish_weight_update,
    parse_init_weight_transfer,
    parse_model_taints,
    parse_pause,
    parse_sleep,
    parse_update_weight_version,
    parse_update_weights,
    parse_wake_up,
    rl_dispatch,
    rl_endpoint_name,
    rl_world_size,
    routes_answer,
    system_port_required,
    wake_state_answer,
)
from trio_sidecar.core.status import StatusCode

ALL = RlCapabilities(sleep_mode=True, weight_transfer=True, draft_weight_updates=True)
NATIVE_ROUTES_ALL = [
    "control/get_weight_version",
    "control/is_paused",
    "control/is_sleeping",
    "control/pause_generation",
    "control/resume_generation",
    "control/sleep",
    "control/wake_up",
    "update/finish_weight_update",
    "update/init_weight_transfer_engine",
    "update/model_taints",
    "update/start_draft_weight_update",
    "update/start_weight_update",
    "update/update_weight_version",
    "update/update_weights",
]


def test_the_route_plan_with_every_capability_is_natives_list():
    assert list(engine_routes(ALL, lora=False)) == NATIVE_ROUTES_ALL


def test_the_route_plan_with_lora_lists_the_three_lora_updates_sorted_in():
    routes = engine_routes(ALL, lora=True)
    assert list(routes) == sorted(NATIVE_ROUTES_ALL + list(LORA_ROUTES))
    assert routes.index("update/list_loras") < routes.index("update/model_taints")


def test_without_capabilities_only_the_base_routes_remain():
    assert engine_routes(RlCapabilities(), lora=False) == (
        "control/get_weight_version",
        "control/is_paused",
        "control/is_sleeping",
        "control/pause_generation",
        "control/resume_generation",
        "update/model_taints",
        "update/update_weight_version",
    )


def test_sleep_mode_alone_adds_sleep_and_wake_up_and_draft_needs_weight_transfer():
    assert set(engine_routes(RlCapabilities(sleep_mode=True), lora=False)) - set(
        engine_routes(RlCapabilities(), lora=False)
    ) == {"control/sleep", "control/wake_up"}
    assert "update/start_draft_weight_update" not in engine_routes(
        RlCapabilities(draft_weight_updates=True), lora=False
    )


def test_capabilities_from_server_info():
    info = control_pb2.ServerInfo()
    assert RlCapabilities.from_server_info(info) == RlCapabilities()
    info.rl_capabilities.weight_transfer_backend = "nccl"
    info.rl_capabilities.sleep_mode_enabled = True
    assert RlCapabilities.from_server_info(info) == RlCapabilities(sleep_mode=True, weight_transfer=True)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, PauseRequest(PauseMode.ABORT, None)),
        ({"mode": "keep", "clear_cache": True}, PauseRequest(PauseMode.KEEP, True)),
        ({"mode": "wait", "clear_cache": False}, PauseRequest(PauseMode.WAIT, False)),
        ({"mode": None}, PauseRequest(PauseMode.ABORT, None)),
    ],
)
def test_pause_bodies(body, expected):
    assert parse_pause(body) == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"mode": "bogus"}, "pause_generation mode must be abort, wait, or keep; got `bogus`"),
        ({"mode": "ABORT"}, "pause_generation mode must be abort, wait, or keep; got `ABORT`"),
        ({"mode": 5}, "`mode` must be a string"),
        ({"mode": "abort", "clear_cache": "x"}, "`clear_cache` must be a boolean"),
    ],
)
def test_pause_refusals(body, message):
    with pytest.raises(InvalidArgument) as caught:
        parse_pause(body)
    assert str(caught.value) == message
    assert native_error_text(caught.value) == f"InvalidRequest: {message}"


def test_sleep_bodies():
    assert parse_sleep({}) == SleepRequest(None, PauseMode.ABORT)
    assert parse_sleep({"level": 0, "mode": "keep"}) == SleepRequest(0, PauseMode.KEEP)
    assert parse_sleep({"level": 2}) == SleepRequest(2, PauseMode.ABORT)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"level": 3}, "`level` must be one of 0, 1, or 2"),
        ({"level": 2**32}, "`level` must be a uint32"),
        ({"level": "1"}, "`level` must be a uint32"),
        ({"level": -1}, "`level` must be a uint32"),
        ({"level": 1.0}, "`level` must be a uint32"),
        ({"level": True}, "`level` must be a uint32"),
        ({"mode": "bogus"}, "sleep mode must be abort, wait, or keep; got `bogus`"),
    ],
)
def test_sleep_refusals(body, message):
    with pytest.raises(InvalidArgument, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        parse_sleep(body)


def test_wake_up_bodies_and_refusals():
    assert parse_wake_up({}) == ()
    assert parse_wake_up({"tags": ["kv_cache", "scheduling"]}) == ("kv_cache", "scheduling")
    for body, message in (
        ({"tags": "weights"}, "`tags` must be an array of strings"),
        ({"tags": [1]}, "`tags` must contain only strings"),
        ({"tags": ["bogus"]}, "wake_up tag must be weights, kv_cache, or scheduling; got `bogus`"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            parse_wake_up(body)
        assert str(caught.value) == message


def test_weight_bodies_become_compact_json_in_key_order():
    assert parse_init_weight_transfer({"init_info": {"b": 1, "a": [1, 2.5, "é"]}}) == '{"b":1,"a":[1,2.5,"é"]}'.encode()
    assert json.loads(parse_update_weights({"update_info": {}})) == {}
    for body in ({}, {"init_info": [1]}, {"init_info": "x"}):
        with pytest.raises(InvalidArgument, match="^missing `init_info` JSON object$"):
            parse_init_weight_transfer(body)
    with pytest.raises(InvalidArgument, match="^missing `update_info` JSON object$"):
        parse_update_weights({"update_info": None})


def test_weight_versions():
    assert parse_finish_weight_update({}) is None
    assert parse_finish_weight_update({"weight_version": ""}) == ""  # passed on: vLLM refuses it
    with pytest.raises(InvalidArgument, match="^`weight_version` must be a string$"):
        parse_finish_weight_update({"weight_version": 5})
    assert parse_update_weight_version({"new_version": "step-2"}) == "step-2"
    for body in ({}, {"new_version": ""}, {"new_version": None}):
        with pytest.raises(InvalidArgument, match="^missing non-empty `new_version` string$"):
            parse_update_weight_version(body)
    with pytest.raises(InvalidArgument, match="^`new_version` must be a string$"):
        parse_update_weight_version({"new_version": 5})


def test_model_taints():
    assert parse_model_taints({"taints": ["b", "a", "a"]}) == ("a", "b")
    assert parse_model_taints({"taints": []}) == ()
    with pytest.raises(ValueError, match="^'taints' must be a JSON array of strings$"):
        parse_model_taints({})
    with pytest.raises(ValueError, match="^taint 'dynamo.topology/x' uses reserved prefix 'dynamo.topology/'$"):
        parse_model_taints({"taints": ["ok", "dynamo.topology/x"]})


def test_engine_errors_are_printed_with_natives_kind_names():
    busy = status_to_error(
        "StartWeightUpdate", StatusCode.FAILED_PRECONDITION, "a weight update is already in progress"
    )
    assert native_error_text(busy) == (
        "InvalidRequest: StartWeightUpdate: a weight update is already in progress (FailedPrecondition)"
    )
    assert (
        native_error_text(CannotConnect("IsPaused: down (Unavailable)")) == "Unavailable: IsPaused: down (Unavailable)"
    )
    assert native_error_text(ProtocolError("x")).startswith("Internal: invalid vLLM gRPC response")


def test_answers():
    assert wake_state_answer("resumed", None) == {"status": "resumed"}
    assert wake_state_answer("resumed", False) == {"status": "resumed"}
    assert wake_state_answer("partially_awake", True) == {"status": "partially_awake", "is_sleeping": True}
    assert routes_answer(["a"], "http://h:1", 1, "http://x/") == {
        "status": "ok",
        "routes": ["a"],
        "system_url": "http://h:1",
        "world_size": 1,
        "admin_base_url": "http://x/",
    }
    assert routes_answer(["a"], None, None, None) == {"status": "ok", "routes": ["a"]}


@pytest.mark.parametrize(
    ("request_", "answer"),
    [
        ({"method": "routes"}, {"status": "ok"}),
        ({"method": "routes", "kwargs": 5}, {"status": "ok"}),
        (
            {"method": "is_paused"},
            {
                "status": "error",
                "method": "is_paused",
                "message": "rl request-plane endpoint only supports method='routes'",
            },
        ),
        (
            {"method": ""},
            {"status": "error", "method": "", "message": "rl request-plane endpoint only supports method='routes'"},
        ),
        ({"method": 5}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        ({}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        ([1], {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        ("x", {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
    ],
)
def test_rl_dispatch(request_, answer):
    assert rl_dispatch(request_, lambda: {"status": "ok"}) == answer


def test_world_size_is_the_engine_world_size_times_dp_and_the_flag_only_fills_in():
    info = control_pb2.ServerInfo()
    with pytest.raises(ProtocolError, match="RL discovery requires vLLM parallelism metadata"):
        rl_world_size(info, 3)
    info.parallelism.tensor_parallel_size = info.parallelism.pipeline_parallel_size = 1
    info.parallelism.data_parallel_size = 2
    with pytest.raises(InvalidArgument, match="^--vllm-rl-world-size is required when vLLM omits"):
        rl_world_size(info, None)
    assert rl_world_size(info, 4) == 4
    with pytest.raises(InvalidArgument, match="^--vllm-rl-world-size must be divisible by TP \\* PP \\* DP$"):
        rl_world_size(info, 3)
    info.parallelism.world_size = 1
    assert rl_world_size(info, 3) == 2  # vLLM's engine world size wins, times the DP size
    info.parallelism.tensor_parallel_size = 2
    with pytest.raises(ProtocolError, match="not divisible by TP \\* PP"):
        rl_world_size(info, None)


def test_rl_endpoint_name():
    assert rl_endpoint_name({}) == "rl"
    assert rl_endpoint_name({"DYN_RL_ENDPOINT": "my-rl_2"}) == "my-rl_2"
    with pytest.raises(InvalidArgument, match="^RL endpoint configuration: DYN_RL_ENDPOINT must not be empty$"):
        rl_endpoint_name({"DYN_RL_ENDPOINT": " "})
    with pytest.raises(InvalidArgument, match="only letters, digits, '-' or '_'$"):
        rl_endpoint_name({"DYN_RL_ENDPOINT": "a.b"})
    assert str(system_port_required()) == (
        "RL endpoint configuration: RL discovery requires the Dynamo system server; "
        "set DYN_SYSTEM_PORT to 0 or a positive port"
    )


@pytest.mark.parametrize(
    ("raw", "published"),
    [
        ("http://127.0.0.1:42141", "http://127.0.0.1:42141/"),
        ("HTTP://LocalHost:80", "http://localhost/"),
        ("https://x:443/a/b", "https://x/a/b"),
        (" http://x ", "http://x/"),
        ("http://[::1]:8000", "http://[::1]:8000/"),
    ],
)
def test_admin_base_url_is_normalized(raw, published):
    assert parse_admin_base_url(raw) == published


F = "`--vllm-http-endpoint`"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("", f"{F} is required and must specify an HTTP server address"),
        ("  ", f"{F} is required and must specify an HTTP server address"),
        ("ftp://x", f"{F} must use HTTP or HTTPS and include a host"),
        ("x:8000", f"{F} must use HTTP or HTTPS and include a host"),
        ("127.0.0.1:8000", f"invalid HTTP endpoint for {F}: relative URL without a base"),
        ("http://", f"invalid HTTP endpoint for {F}: empty host"),
        ("http://u@x", f"{F} must not include user information"),
        ("http://u:p@x", f"{F} must not include user information"),
        ("http://x?a=1", f"{F} must not include a query or fragment"),
        ("http://x#f", f"{F} must not include a query or fragment"),
        ("http://[::1", f"invalid HTTP endpoint for {F}: invalid IPv6 address"),
        ("http://x:99999", f"invalid HTTP endpoint for {F}: invalid port number"),
    ],
)
def test_admin_base_url_refusals_have_natives_texts(raw, message):
    with pytest.raises(InvalidArgument) as caught:
        parse_admin_base_url(raw)
    assert str(caught.value) == message
