"""Startup through the engine: pool (docs/reference/sidecar.md#connection-pool), readiness (docs/reference/sidecar.md#readiness-wait), discovery phases (docs/reference/sidecar.md#discovery, docs/reference/sidecar.md#registration-data), admission (docs/reference/sidecar.md#admission).

The pool deadline, readiness, the services each phase waits for, identity and DP-size changes, and the
deadline texts (docs/reference/sidecar.md#bootstrap-phase).
"""

from __future__ import annotations

import logging
import socket

import pytest
import trio
from sidecar_fakes import NOT_SERVING, SERVING, reference_model_info, reference_server_info, sidecar_config

from trio_sidecar import open_sidecar
from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar.core.endpoint import parse_grpc_endpoint
from trio_sidecar.core.errors import CannotConnect, ConnectionTimeout, InvalidArgument, ProtocolError
from trio_sidecar.core.health_policy import HealthKind
from trio_sidecar.core.status import StatusCode
from trio_sidecar.shell.discovery import discover
from trio_sidecar.shell.pool import ChannelPool, open_channel_pool


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_closed_port_fails_with_cannot_connect_within_the_deadline(autojump_clock):
    config = sidecar_config(
        f"127.0.0.1:{closed_port()}",
        grpc_connections=2,
        connect_attempt_timeout=0.05,
        retry_interval=0.01,
        startup_deadline=0.1,
    )
    start = trio.current_time()
    with pytest.raises(CannotConnect) as info:
        async with open_sidecar(config):
            pytest.fail("must not start")  # pragma: no cover
    elapsed = trio.current_time() - start
    assert elapsed < 0.3
    message = str(info.value)
    assert "within 100ms" in message
    assert message.startswith(
        f"failed to establish the vLLM gRPC connection pool to http://127.0.0.1:{config.grpc_endpoint.split(':')[1]} "
        "for pool slot 1 within 100ms after "
    )
    assert " attempts over " in message


async def test_connection_failures_are_logged_at_debug_and_rate_limited(caplog_sidecar, autojump_clock):
    config = sidecar_config(
        f"127.0.0.1:{closed_port()}", connect_attempt_timeout=0.05, retry_interval=0.01, startup_deadline=0.15
    )
    with pytest.raises(CannotConnect) as info:
        await discover(config)
    failures = [r for r in caplog_sidecar.records if "gRPC connection attempt" in r.getMessage()]
    assert failures and all(r.levelno == logging.DEBUG for r in failures)
    attempts = int(str(info.value).split(" after ")[1].split(" attempts")[0])
    assert attempts >= 5
    assert len(failures) <= 2  # the same error text repeats: logged once per 30 s (a deadline cut may add one)


async def test_pre_network_checks_run_before_any_socket():
    with pytest.raises(InvalidArgument, match="`--grpc-endpoint` must include a host"):
        async with open_sidecar(sidecar_config("http://", disaggregation_mode="encode")):
            pass  # pragma: no cover
    with pytest.raises(InvalidArgument, match="grpc_connections must be at least 1"):
        await discover(sidecar_config("127.0.0.1:1", grpc_connections=0))


async def test_pool_is_round_robin_and_replaces_a_broken_slot(fake):
    config = sidecar_config(fake.endpoint, grpc_connections=2)
    endpoint = parse_grpc_endpoint(fake.endpoint)
    async with open_channel_pool(endpoint, config, deadline=trio.current_time() + 5) as pool:
        assert isinstance(pool, ChannelPool) and len(pool) == 2
        a = await pool.channel("x")
        b = await pool.channel("x")
        assert a is not b
        assert await pool.channel("x") is a
        await a.aclose()  # slot 1 unusable now
        assert await pool.channel("x") is b
        replacement = await pool.channel("x")
        assert replacement is not a and not replacement.closed
        assert pool.reconnects == 1
        assert "2 connections, 0 broken" in repr(pool)
    assert pool.closed


async def test_broken_slot_reconnect_failure_is_cannot_connect_unavailable(fake, autojump_clock):
    config = sidecar_config(fake.endpoint, grpc_connections=1, connect_attempt_timeout=0.2)
    endpoint = parse_grpc_endpoint(fake.endpoint)
    async with open_channel_pool(endpoint, config, deadline=trio.current_time() + 5) as pool:
        channel = await pool.channel("x")
        await channel.aclose()
        pool.endpoint = parse_grpc_endpoint(f"127.0.0.1:{closed_port()}")  # the server "went away"
        assert pool.connections_up == 0
        with pytest.raises(CannotConnect, match=r"^GenerateStream: reconnecting .* \(Unavailable\)$"):
            await pool.channel("GenerateStream")
        assert (pool.reconnects, pool.reconnect_failures) == (0, 1)


async def test_engine_survives_a_lost_connection(fake):
    fake.tokens = 2
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=1)) as sidecar:
        [old] = sidecar.engine.pool.channels
        await old.aclose()
        async with sidecar.generate({"token_ids": [1, 2], "stop_conditions": {"max_tokens": 2}}) as stream:
            chunks = [c async for c in stream]
        [new] = sidecar.engine.pool.channels
    assert new is not old
    assert chunks[-1].finish_reason == "stop"


# ---------------------------------------------------------------------------- readiness (docs/reference/sidecar.md#readiness-wait)


async def test_readiness_not_serving_then_serving_proceeds(fake, autojump_clock):
    fake.health_script = {"vllm.Control": [NOT_SERVING, NOT_SERVING, SERVING]}
    model = await discover(sidecar_config(fake.endpoint))
    assert model.served_model_name == "served-model"
    assert fake.health_checks.count("vllm.Control") == 3


async def test_readiness_stuck_not_serving_fails_with_the_last_status(fake, autojump_clock):
    fake.health_script = {"vllm.Inference": [NOT_SERVING]}
    with pytest.raises(CannotConnect) as info:
        async with open_sidecar(sidecar_config(fake.endpoint, startup_deadline=0.3)):
            pass  # pragma: no cover
    message = str(info.value)
    assert message.startswith("vllm.Inference did not become SERVING before the total vLLM startup deadline after ")
    assert message.endswith(": reported NOT_SERVING")


@pytest.mark.parametrize("code", [StatusCode.NOT_FOUND, StatusCode.UNIMPLEMENTED])
async def test_readiness_not_found_or_unimplemented_fails_at_once(fake, code):
    fake.health_script = {"vllm.Control": [code]}
    start = trio.current_time()
    with pytest.raises(ProtocolError) as info:
        await discover(sidecar_config(fake.endpoint, startup_deadline=30))
    assert trio.current_time() - start < 5
    assert "vllm.Control is unavailable through the standard gRPC health API: scripted" in str(info.value)
    assert f"({code.rust_name})" in str(info.value)
    assert fake.health_checks == ["vllm.Control"]


async def test_readiness_other_errors_are_retried_and_reported(fake, autojump_clock):
    fake.health_script = {"vllm.Control": [StatusCode.INTERNAL]}
    with pytest.raises(CannotConnect, match=r"health check failed: scripted INTERNAL \(Internal\)$"):
        await discover(sidecar_config(fake.endpoint, startup_deadline=0.3))


async def test_readiness_check_that_hangs_reports_the_deadline(fake, autojump_clock):
    fake.health_script = {"vllm.Control": ["hang"]}
    with pytest.raises(CannotConnect, match="health check exceeded the startup deadline$"):
        await discover(sidecar_config(fake.endpoint, startup_deadline=0.3))


async def test_bootstrap_waits_for_control_only_and_start_for_both_in_order(fake):
    model = await discover(sidecar_config(fake.endpoint))
    assert fake.health_checks == ["vllm.Control"]
    assert model.identity.served_model_name == "served-model"
    fake.health_checks.clear()
    async with open_sidecar(sidecar_config(fake.endpoint), expected=model):
        assert fake.health_checks == ["vllm.Control", "vllm.Inference"]


async def test_bootstrap_uses_one_connection_and_start_uses_the_pool(fake):
    await discover(sidecar_config(fake.endpoint, grpc_connections=8))
    assert len(fake.control_peers) == 1
    fake.control_peers.clear()
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=2)):
        pass
    assert len(fake.control_peers) == 2  # Check, Check, GetModelInfo+GetServerInfo: round-robin over 2


# ---------------------------------------------------------------------------- discovery (docs/reference/sidecar.md#discovery, docs/reference/sidecar.md#registration-data)


async def test_served_name_change_between_phases_fails_start(fake):
    fake.model_infos = [reference_model_info(), reference_model_info(served_model_name="other")]
    bootstrap = await discover(sidecar_config(fake.endpoint))
    with pytest.raises(ProtocolError, match="model identity changed between bootstrap and startup"):
        async with open_sidecar(sidecar_config(fake.endpoint), expected=bootstrap):
            pass  # pragma: no cover


async def test_parallelism_change_between_phases_fails_start(fake):
    fake.server_infos = [reference_server_info(dp_size=4), reference_server_info(dp_size=2)]
    bootstrap = await discover(sidecar_config(fake.endpoint))
    with pytest.raises(ProtocolError, match="parallelism changed between bootstrap and startup: expected "):
        async with open_sidecar(sidecar_config(fake.endpoint), expected=bootstrap):
            pass  # pragma: no cover


async def test_discovery_validation_errors_abort_startup(fake):
    fake.model_infos = [reference_model_info(supports_token_ids_input=False)]
    with pytest.raises(ProtocolError, match="the discovered model does not support token-ID input"):
        await discover(sidecar_config(fake.endpoint))


@pytest.mark.parametrize("rpc", ["GetModelInfo", "GetServerInfo"])
async def test_discovery_rpc_past_the_deadline_is_a_connection_timeout(fake, rpc, autojump_clock):
    fake.hang_rpcs = {rpc}
    with pytest.raises(ConnectionTimeout, match=f"^{rpc} exceeded the total vLLM startup deadline$"):
        await discover(sidecar_config(fake.endpoint, startup_deadline=0.3))


async def test_registration_data_comes_from_the_start_phase(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        config = sidecar.engine_config
    assert (config.model, config.served_model_name, config.aliases) == (
        "model-source",
        "served-model",
        ("model-alias",),
    )
    # Per DP rank: vLLM reports 4096 blocks summed over its 4 ranks.
    assert (config.context_length, config.kv_cache_block_size, config.total_kv_blocks) == (8192, 16, 1024)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (128, 2048)
    assert (config.data_parallel_size, config.data_parallel_start_rank) == (4, 0)
    assert config.tool_call_parser is None and config.reasoning_parser is None


async def test_start_logs_the_fixed_lines(fake, caplog_sidecar):
    async with open_sidecar(sidecar_config(fake.endpoint)):
        pass
    messages = [r.getMessage() for r in caplog_sidecar.records if r.levelno == logging.INFO]
    assert any(m.startswith("connecting to vLLM gRPC") and fake.endpoint in m for m in messages)
    assert "vLLM gRPC services are ready" in messages


# ---------------------------------------------------------------------------- KV-event sources (docs/reference/sidecar.md#kv-event-sources)


def zmq_source(endpoint: str, rank: int | None) -> control_pb2.KvEventSource:
    source = control_pb2.KvEventSource(transport="zmq", endpoint=endpoint, topic="")
    if rank is not None:
        source.data_parallel_rank = rank
    return source


async def test_kv_event_sources_are_rewritten_after_start(fake):
    fake.server_infos = [reference_server_info(dp_size=2)]
    fake.kv_sources = [zmq_source("tcp://*:20081", 0), zmq_source("tcp://0.0.0.0:20082", 1)]
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sources = sidecar.kv_event_sources
    assert [s.endpoint for s in sources] == ["tcp://127.0.0.1:20081", "tcp://127.0.0.1:20082"]
    assert {s.dp_rank for s in sources} == {0, 1}
    assert all(s.topic == "" for s in sources)


async def test_bad_kv_event_sources_fail_start_and_leave_nothing_running(fake):
    fake.server_infos = [reference_server_info(dp_size=2)]
    fake.kv_sources = [zmq_source("tcp://*:20081", 0)]
    with pytest.raises(ProtocolError, match="ZMQ sources for 1 of 2 local data-parallel ranks"):
        async with open_sidecar(sidecar_config(fake.endpoint)):
            pass  # pragma: no cover
    with trio.fail_after(2):
        while fake.server.open_connections:
            await trio.sleep(0.01)


# ---------------------------------------------------------------------------- admission (docs/reference/sidecar.md#admission)


async def test_admission_closes_while_vllm_is_not_serving(fake):
    fake.tokens = 1
    config = sidecar_config(fake.endpoint, health_prober=True, retry_interval=0.05, connect_attempt_timeout=1)
    async with open_sidecar(config) as sidecar:
        assert sidecar.health.value.kind is HealthKind.SERVING
        fake.health.set_status("vllm.Inference", NOT_SERVING)
        with trio.fail_after(2):
            await sidecar.health.wait_value(lambda s: s.kind is not HealthKind.SERVING)
        with pytest.raises(CannotConnect, match="^vLLM is not serving: "):
            async with sidecar.generate({"token_ids": [1]}):
                pass  # pragma: no cover
        assert fake.requests == []
        fake.health.set_status("vllm.Inference", SERVING)
        with trio.fail_after(5):
            await sidecar.health.wait_value(lambda s: s.kind is HealthKind.SERVING)
        async with sidecar.generate({"token_ids": [1]}) as stream:
            chunks = [c async for c in stream]
    assert chunks[-1].finish_reason == "stop"


async def test_each_attempt_is_bounded_by_the_attempt_timeout(nursery, autojump_clock):
    """A peer that accepts TCP but never speaks HTTP/2: attempts time out and are retried on the interval."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    held = []

    async def hold(stream):
        held.append(stream)
        async with stream:
            await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, hold, listeners)
    config = sidecar_config(
        f"127.0.0.1:{port}", connect_attempt_timeout=0.05, retry_interval=0.01, startup_deadline=0.3
    )
    start = trio.current_time()
    with pytest.raises(CannotConnect) as info:
        await discover(config)
    assert trio.current_time() - start < 1.0
    message = str(info.value)
    assert "for pool slot 1 within 300ms after " in message
    attempts = int(message.split(" after ")[1].split(" attempts")[0])
    assert attempts >= 3
    assert message.endswith(
        ("the connection attempt timed out after 50ms", "the connection attempt exceeded the startup deadline")
    )
    assert attempts - 1 <= len(held) <= attempts  # the last one may be cut before the accept


async def test_pool_construction_safety_net_is_a_connection_timeout(nursery, monkeypatch, autojump_clock):
    from trio_sidecar.shell import pool as pool_module

    monkeypatch.setattr(pool_module, "PHASE_GRACE", -0.2)  # make the whole-construction scope fire first
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def hold(stream):
        async with stream:
            await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, hold, listeners)
    config = sidecar_config(f"127.0.0.1:{port}", connect_attempt_timeout=5, startup_deadline=0.3)
    with pytest.raises(ConnectionTimeout) as info:
        await discover(config)
    assert str(info.value) == (
        f"vLLM gRPC connection pool to http://127.0.0.1:{port} exceeded the total startup deadline"
    )
