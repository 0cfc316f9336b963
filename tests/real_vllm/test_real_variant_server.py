"""The Rust-managed launch (``vllm-rs serve``) with LoRA and KV events on (docs/reference/real-vllm.md#starting-the-server, docs/reference/real-vllm.md#control, docs/reference/real-vllm.md#shutdown-and-engine-death).

One private server for the module: first the sidecar's readiness wait while it boots (docs/reference/real-vllm.md#readiness), then the LoRA
and KV-event variants of Control, the sidecar's KV-event source discovery against it (docs/reference/sidecar.md#kv-event-sources),
and finally engine death (the EngineCore killed with SIGKILL), which ends the server, so that test is the
last one in this file.

The KV-event PUB endpoint is an ipc socket in a private directory: vLLM 0.32 *binds* its PUB only for
wildcard or ipc endpoints and *connects* it for a concrete tcp address (``vllm/distributed/kv_events.py``),
and a wildcard would listen on every interface. The replay ROUTER binds 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
import trio
from real_vllm_client import open_direct_channel, rpc_error_types
from real_vllm_health import assert_left_serving, observe_shutdown
from real_vllm_helpers import collect, generate_request, unique_id
from real_vllm_lora import ALLOWED_PREFIXES, make_tiny_lora
from real_vllm_server import (
    SERVED_MODEL_NAME,
    TIMINGS,
    RealVllmServer,
    check_env,
    env_from_environ,
    free_ports,
    process_exited,
)
from real_vllm_wire import RawMessage, decode, scalar_fields

from trio_sidecar import HealthKind, KvEventSource, SidecarConfig, WorkerOptions, discover, open_sidecar
from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock import MockConfig, open_mock_server

MAX_LORAS = 2


@pytest.fixture(scope="module")
def variant_process():
    """The ``vllm-rs serve`` process, just started (not yet ready)."""
    env = env_from_environ()
    assert env is not None
    check_env(env)
    (replay_port,) = free_ports(1)
    # ipc: vLLM binds a Unix socket (no TCP listener); a concrete tcp address would make its PUB *connect*.
    ipc_dir = Path(tempfile.mkdtemp(prefix="real-vllm-kv-"))
    kv_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": "kv",
        "endpoint": f"ipc://{ipc_dir}/kv-events.ipc",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    # Local adapters are allowed from one private directory only (vLLM refuses local paths otherwise).
    adapter_dir = Path(tempfile.mkdtemp(prefix="real-vllm-lora-"))
    saved = os.environ.get(ALLOWED_PREFIXES)
    os.environ[ALLOWED_PREFIXES] = str(adapter_dir)
    try:
        server = RealVllmServer(
            env,
            launch="rust",
            extra_args=("--enable-lora", "--max-loras", str(MAX_LORAS), "--kv-events-config", json.dumps(kv_config)),
        )
    finally:
        if saved is None:
            del os.environ[ALLOWED_PREFIXES]
        else:
            os.environ[ALLOWED_PREFIXES] = saved
    server.kv_endpoints = (kv_config["endpoint"], kv_config["replay_endpoint"])
    server.adapter_dir = adapter_dir
    try:
        yield server
    finally:
        try:
            server.stop()
            assert not server.leftovers(), f"vLLM processes still running after stop: {server.leftovers()}"
        finally:
            server.cleanup_files()
            shutil.rmtree(ipc_dir, ignore_errors=True)
            shutil.rmtree(adapter_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def variant_server(variant_process):
    """The same server once both services report SERVING."""
    try:
        variant_process.wait_ready()
    except BaseException:
        sys.stderr.write(f"real vLLM log:\n{variant_process.log_tail(80)}\n")
        raise
    TIMINGS.append(("rust launch (LoRA, KV events): start -> SERVING", variant_process.ready_after_s or 0.0))
    return variant_process


@pytest.fixture
async def direct(variant_server):
    async with open_direct_channel(variant_server.host, variant_server.grpc_port) as channel:
        yield channel


async def observe_startup(server) -> list[str]:
    """Poll ``Check("vllm.Inference")`` on fresh connections until SERVING; distinct outcomes in order."""
    seen: list[str] = []
    while True:
        try:
            with trio.fail_after(10):
                async with open_direct_channel(server.host, server.grpc_port) as channel:
                    status = (
                        await channel.unary_unary(
                            "/grpc.health.v1.Health/Check",
                            health_pb2.HealthCheckRequest(service="vllm.Inference"),
                            health_pb2.HealthCheckResponse,
                            timeout=5,
                        )
                    ).status
                    outcome = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except OSError:
            outcome = "connection refused"
        except rpc_error_types() as e:
            outcome = e.code.name
        except trio.TooSlowError:
            outcome = "timeout"
        if not seen or seen[-1] != outcome:
            seen.append(outcome)
        if outcome == "SERVING":
            break
        await trio.sleep(0.2)
    return seen


# First in this module: it needs the server while it is still starting.
async def test_the_sidecar_waits_for_a_starting_server(variant_process):
    """The sidecar's start phase (docs/reference/sidecar.md#readiness-wait) waits through vLLM's boot; Check never says NOT_SERVING.

    Under ``vllm-rs serve`` the gRPC port is refused until the engine is ready (the Python-supervised launch
    binds it early and answers UNAVAILABLE, docs/reference/real-vllm.md#readiness); either way the sidecar's retries cover it.
    """
    config = SidecarConfig(
        grpc_endpoint=variant_process.endpoint,
        grpc_connections=2,
        startup_deadline=300.0,
        connect_attempt_timeout=5.0,
        retry_interval=0.5,
    )
    if variant_process.ready_after_s is not None:
        pytest.skip("the server is already ready (this test must run first in the module)")
    observed: list[str] = []

    async def observe():
        observed.extend(await observe_startup(variant_process))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(observe)
        with trio.fail_after(330):
            async with open_sidecar(config) as sidecar:
                waited = time.monotonic() - variant_process.started_at
                assert sidecar.health.value.kind is HealthKind.SERVING
                assert sidecar.model.served_model_name == SERVED_MODEL_NAME
    assert observed[-1] == "SERVING", observed
    assert set(observed[:-1]) <= {"connection refused", "UNAVAILABLE", "DEADLINE_EXCEEDED", "timeout"}, observed
    assert len(observed) >= 2, observed  # the test did see the server before it was ready
    TIMINGS.append(("rust launch: start -> sidecar started", waited))
    print(f"\nstartup health outcomes (vllm-rs serve): {observed}")


async def test_lora_and_kv_event_variants_of_control(direct, variant_server):
    server_info = scalar_fields(
        (await direct.unary_unary("/vllm.Control/GetServerInfo", RawMessage(), RawMessage, timeout=30)).data
    )
    assert (
        server_info[10] == MAX_LORAS
    )  # max_loras, field 10 (the fork's bool collided here, docs/reference/real-vllm.md#field-collisions)
    assert (server_info[11], server_info[14]) == (b"", 128)
    model_info = scalar_fields(
        (await direct.unary_unary("/vllm.Control/GetModelInfo", RawMessage(), RawMessage, timeout=30)).data
    )
    assert model_info[22] == 1  # supports_lora
    sources = decode(
        (await direct.unary_unary("/vllm.Control/GetKvEventSources", RawMessage(), RawMessage, timeout=30)).data
    )
    endpoint, replay = variant_server.kv_endpoints
    assert [decode(s) for s in sources[1]] == [
        {
            1: [b"zmq"],
            2: [endpoint.encode()],
            3: [b"kv"],
            4: [replay.encode()],
            5: [0],  # data_parallel_rank is `optional`: rank 0 is on the wire
            6: [b"msgpack"],
            7: [1],
            8: [10000],
            9: [100000],
            10: [100000],
        }
    ]


async def test_unknown_lora_adapter_on_a_lora_engine_is_not_found(direct):
    out = await collect(direct, generate_request(unique_id("lora"), lora_name="adapter"))
    assert (out.phase, out.code, out.message) == ("open", StatusCode.NOT_FOUND, "LoRA adapter `adapter` is not loaded")


async def _control_outcome(channel, rpc: str, request):
    response_type = getattr(control_pb2, f"{rpc}Response")
    try:
        return "OK", await channel.unary_unary(f"/vllm.Control/{rpc}", request, response_type, timeout=60)
    except rpc_error_types() as e:
        return e.code, e.message


async def test_lora_lifecycle_refusals_match_the_mock(direct, variant_server):
    """The LoRA errors the mock copies (docs/reference/mock.md#lora-adapters), on a LoRA engine and on the mock.
    vLLM checks a local path (allowed prefix, existence) before the base-model conflict, so that case uses a
    real adapter directory; the mock does not check paths."""
    adapter = str(make_tiny_lora(variant_server.adapter_dir / "tiny-adapter", force=True))
    cases = [
        ("LoadLora", control_pb2.LoadLoraRequest(source_path=adapter)),
        ("LoadLora", control_pb2.LoadLoraRequest(lora_name="a")),
        ("LoadLora", control_pb2.LoadLoraRequest(lora_name=SERVED_MODEL_NAME, source_path=adapter)),
        ("UnloadLora", control_pb2.UnloadLoraRequest()),
        ("UnloadLora", control_pb2.UnloadLoraRequest(lora_name="zz")),
        ("ListLoras", control_pb2.ListLorasRequest()),
    ]
    config = MockConfig(listen="127.0.0.1:0", served_model_name=SERVED_MODEL_NAME, engine_args={"max_loras": MAX_LORAS})
    async with open_mock_server(config) as mock:
        async with open_direct_channel("127.0.0.1", mock.port) as mocked:
            answers = {
                side: [await _control_outcome(channel, rpc, request) for rpc, request in cases]
                for side, channel in (("real", direct), ("mock", mocked))
            }
    assert answers["real"][2] == (
        StatusCode.ALREADY_EXISTS,
        "LoRA adapter `tiny-llama` conflicts with a served base model",
    )
    assert answers["mock"] == answers["real"]


async def test_the_cpu_build_cannot_load_a_local_adapter(direct, variant_server):
    """Recorded in docs/conformance.md (row 8c): the path checks pass, then the engine cannot decode the
    ``LoRARequest`` its Rust frontend sends (element 4 is the frontend's ``tensorizer_config_dict``, the
    engine's ``load_inplace``). This server runs without the field-order fix ``test_real_lora.py`` uses, so
    this fails the day vLLM realigns the two sides."""
    adapter = make_tiny_lora(variant_server.adapter_dir / "tiny-adapter", force=True)
    missing = await _control_outcome(
        direct,
        "LoadLora",
        control_pb2.LoadLoraRequest(lora_name="m", source_path=str(variant_server.adapter_dir / "missing")),
    )
    assert missing == (StatusCode.INVALID_ARGUMENT, "Local LoRA adapter path must exist and be accessible.")
    outside = await _control_outcome(direct, "LoadLora", control_pb2.LoadLoraRequest(lora_name="o", source_path="/"))
    assert outside == (
        StatusCode.INVALID_ARGUMENT,
        "Local LoRA adapter path is outside the configured allowed prefixes.",
    )
    code, message = await _control_outcome(
        direct, "LoadLora", control_pb2.LoadLoraRequest(lora_name="a", source_path=str(adapter))
    )
    assert code == StatusCode.INTERNAL, message
    assert message.startswith("failed to load LoRA adapter `a`: utility call `add_lora` failed"), message
    assert message.endswith("Call to add_lora method failed: Expected `bool`, got `null` - at `$[4]`"), message
    assert (await _control_outcome(direct, "ListLoras", control_pb2.ListLorasRequest())) == (
        "OK",
        control_pb2.ListLorasResponse(),
    )


async def test_rl_and_lora_rpcs_answer_on_the_real_server(direct):
    assert (await direct.unary_unary("/vllm.Control/ListLoras", RawMessage(), RawMessage, timeout=30)).data == b""
    assert (await direct.unary_unary("/vllm.Control/IsPaused", RawMessage(), RawMessage, timeout=30)).data == b""
    version = await direct.unary_unary("/vllm.Control/GetWeightVersion", RawMessage(), RawMessage, timeout=30)
    assert decode(version.data) == {1: [b"default"]}


async def test_sidecar_discovers_the_kv_event_source_and_registers_kv_publishing(variant_server):
    from trio_sidecar.dynamo.plan import plan_registration

    config = SidecarConfig(
        grpc_endpoint=variant_server.endpoint,
        grpc_connections=1,
        startup_deadline=60.0,
        connect_attempt_timeout=10.0,
        retry_interval=0.5,
    )
    with trio.fail_after(60):
        model = await discover(config)
        async with open_sidecar(config, expected=model) as sidecar:
            assert sidecar.health.value.kind is HealthKind.SERVING
            sources = sidecar.kv_event_sources
            engine_config = sidecar.engine_config
    assert model.model_info.supports_lora and model.server_info.max_loras == MAX_LORAS
    endpoint, _replay = variant_server.kv_endpoints
    assert sources == (KvEventSource(endpoint=endpoint, topic="kv", dp_rank=0),)
    plan = plan_registration(config, WorkerOptions(), engine_config, sources, environ={})
    assert plan.runtime_config["runtime_data"] == {
        "lora_requires_registration": True,
        "vllm_inference_v1_generate": True,
    }
    assert plan.local_indexer is True


async def receive_kv_batches(sub, count: int, timeout: float = 30.0) -> list[list[bytes]]:
    """Up to ``count`` multipart messages from a SUB socket, polled without blocking Trio."""
    import zmq

    frames: list[list[bytes]] = []
    with trio.move_on_after(timeout):
        while len(frames) < count:
            try:
                frames.append(sub.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                await trio.sleep(0.05)
    return frames


def event_summary(frames: list[bytes]) -> dict:
    import msgpack

    payload = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
    return {
        "frames": len(frames),
        "seq_bytes": len(frames[1]),
        "payload": [type(payload[0]).__name__, type(payload[1]).__name__, payload[2]],
        "events": [e for e in payload[1]],
    }


async def test_kv_events_wire_format_matches_the_mock(direct, variant_server):
    """docs/reference/mock.md#kv-event-messages against real vLLM 0.32: frames, payload layout and BlockStored fields."""
    import zmq

    from trio_sidecar.mock import MockConfig, open_mock_server

    prompt = list(range(100, 300))  # 200 tokens: one full 128-token block
    ctx = zmq.Context()
    summaries = {}
    try:
        async with open_mock_server(
            MockConfig(
                listen="127.0.0.1:0",
                engine_args={
                    "block_size": 128,
                    "speedup_ratio": 0.0,
                    "enable_prefix_caching": True,
                },
            )
        ) as mock:
            host, port = mock.address.rsplit(":", 1)
            for side, endpoint, channel_host, channel_port in (
                ("real", variant_server.kv_endpoints[0], variant_server.host, variant_server.grpc_port),
                ("mock", mock.kv_event_endpoints[0], host, int(port)),
            ):
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint)
                try:
                    await trio.sleep(0.5)  # PUB/SUB join: events published before it are lost
                    async with open_direct_channel(channel_host, channel_port) as channel:
                        out = await collect(channel, generate_request(unique_id("kv"), prompt=prompt, max_new_tokens=4))
                        assert out.error is None, (side, out.error)
                    batches = await receive_kv_batches(sub, 1)
                finally:
                    sub.close()
                assert batches, f"{side}: no KV-event message after a 200-token prompt"
                summaries[side] = event_summary(batches[0])
    finally:
        ctx.term()
    real, mock_summary = summaries["real"], summaries["mock"]
    # Same framing: [topic, seq (u64 big-endian), payload]; payload [ts: float, [events], dp_rank 0].
    assert (
        {k: real[k] for k in ("frames", "seq_bytes", "payload")}
        == {k: mock_summary[k] for k in ("frames", "seq_bytes", "payload")}
        == {"frames": 3, "seq_bytes": 8, "payload": ["float", "list", 0]}
    )
    stored = {side: [e for e in summaries[side]["events"] if e["type"] == "BlockStored"] for side in summaries}
    for side, events in stored.items():
        assert events, side
        first = events[0]
        assert (first["block_size"], first["parent_block_hash"], first["group_idx"]) == (128, None, 0), side
        assert first["token_ids"] == prompt[:128], side
        assert len(first["token_ids"]) == len(first["block_hashes"]) * first["block_size"], side
    # The mock sends a subset of vLLM's keys (by design: the fields the Dynamo consumer reads).
    real_keys, mock_keys = set(stored["real"][0]), set(stored["mock"][0])
    assert mock_keys <= real_keys, mock_keys - real_keys
    assert real_keys - mock_keys == {"lora_id", "lora_name", "medium", "extra_keys", "kv_cache_spec_kind"}
    assert stored["real"][0]["medium"] == "GPU"  # even on the CPU engine


# Last in this module: it ends the server.
async def test_engine_death_under_vllm_rs_serve_leaves_serving(variant_server):
    engines = [p for p in variant_server.descendants() if p.name() == "VLLM::EngineCore"]
    assert len(engines) == 1, [(p.pid, p.name()) for p in variant_server.descendants()]

    def kill_engine():
        engines[0].send_signal(signal.SIGKILL)  # psutil checks PID *and* create time: still our descendant

    seen = await observe_shutdown(variant_server, kill_engine)
    assert_left_serving(seen)
    # docs/reference/real-vllm.md#shutdown-and-engine-death (grpcio client): NOT_SERVING on all three about 2-3.5 s after the kill, then the Watch ends OK and
    # the process exits. Through our transport the final OK trailers (and sometimes the NOT_SERVING update)
    # are lost in the connection failure (docs/conformance.md), so either path is accepted.
    assert variant_server.exited() and process_exited(engines[0].pid)
    TIMINGS.append(("EngineCore SIGKILL -> vllm-rs serve exited", seen["process_exited_s"]))
    print(f"\nEngineCore SIGKILL (exit status {variant_server.popen.returncode}): {seen}")
