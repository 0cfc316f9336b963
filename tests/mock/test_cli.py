"""``trio-sidecar mock`` / ``python -m trio_sidecar.mock``: flags, exit codes, and a real subprocess.

Configuration errors are found before any socket is opened, so they are checked in-process through
``main(argv)``; serving, SIGTERM/SIGINT and the printed address use a real child process (killed by PID
in ``finally`` if it outlives the test).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys

import pytest
import trio
from mock_helpers import FAST_ARGS, gen

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.mock.cli import main
from trio_sidecar.transport import ConnectionLostError, RpcError, check_health, open_channel, watch_health

LISTENING = re.compile(rb"^trio-sidecar mock listening on (127\.0\.0\.1):(\d+)\n$")


def test_help_documents_every_flag(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in (
        "--listen",
        "--model",
        "--served-model-name",
        "--disaggregation-mode",
        "--seed",
        "--max-concurrent-requests",
        "--extra-engine-args",
        "--supports-multimodal",
        "--handshake-timeout",
        "--idle-timeout",
        "--max-connections",
        "--log-level",
    ):
        assert flag in text


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--extra-engine-args", "{not json"], "invalid engine args JSON"),
        (["--extra-engine-args", '{"block_size": 4} x'], "trailing data"),
        (["--extra-engine-args", '{"bogus": 1}'], "unknown engine arg 'bogus'"),
        (["--extra-engine-args", '{"speedup_ration": 0}'], "did you mean 'speedup_ratio'?"),
        (["--extra-engine-args", "[1,2]"], "engine args must be a JSON object"),
        (["--extra-engine-args", '{"dp_size": 0}'], "dp_size"),
        (["--extra-engine-args", '{"engine_type": "sglang"}'], "engine_type"),
        (["--extra-engine-args", '{"worker_type": "decode"}'], "worker_type"),
        (["--extra-engine-args", '{"num_gpu_blocks": 0}'], "num_gpu_blocks"),
        (
            ["--max-concurrent-requests", "0"],
            "max_concurrent_requests (--max-concurrent-requests) must be greater than 0",
        ),
        (["--extra-engine-args", "/nonexistent/engine.json"], "cannot read engine args file"),
        (["--listen", "localhost:50051"], "invalid listen address"),
        (["--listen", "127.0.0.1:70000"], "port"),
        (["--disaggregation-mode", "both"], "invalid choice"),
        (["--seed", "-1"], "unsigned 64-bit"),
        (["--bogus"], "unrecognized arguments"),
        (["--handshake-timeout", "0"], "must be a positive number of seconds"),
        (["--handshake-timeout", "soon"], "invalid number of seconds"),
        (["--idle-timeout", "-1"], "must be a positive number of seconds"),
        (["--max-connections", "0"], "must be at least 1"),
    ],
)
def test_configuration_errors_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, run's convention


def test_limit_flags_reach_the_server_limits():
    from trio_sidecar.mock.cli import build_parser
    from trio_sidecar.mock.config import MockConfig, prepare_config

    ns = build_parser().parse_args(["--handshake-timeout", "2.5", "--idle-timeout", "0", "--max-connections", "7"])
    assert (ns.handshake_timeout, ns.idle_timeout, ns.max_connections) == (2.5, None, 7)
    limits = prepare_config(
        MockConfig(
            handshake_timeout=ns.handshake_timeout, idle_timeout=ns.idle_timeout, max_connections=ns.max_connections
        )
    ).limits
    assert (limits.handshake_timeout, limits.idle_timeout, limits.max_connections) == (2.5, None, 7)
    defaults = build_parser().parse_args([])
    assert (defaults.handshake_timeout, defaults.idle_timeout, defaults.max_connections) == (10.0, 300.0, 1000)


def test_engine_args_from_a_file(tmp_path, capsys):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"dp_size": 0}))
    assert main(["--extra-engine-args", str(path)]) == 2
    assert "dp_size" in capsys.readouterr().err


def test_bad_log_level_env_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("TRIO_SIDECAR_LOG_LEVEL", "loud")
    assert main(["--listen", "127.0.0.1:0"]) == 2
    assert "TRIO_SIDECAR_LOG_LEVEL" in capsys.readouterr().err


def _command(*extra: str, speedup_ratio: float = 0.1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trio_sidecar.mock",
        "--listen",
        "127.0.0.1:0",
        "--extra-engine-args",
        json.dumps({**FAST_ARGS, "speedup_ratio": speedup_ratio}),
        "--log-level",
        "warning",
        *extra,
    ]


async def _read_line(stream: trio.abc.ReceiveStream) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            break
        data += chunk
    return data


async def _wait_exit(process: trio.Process, timeout: float = 10) -> int:
    with trio.fail_after(timeout):
        return await process.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_subprocess_prints_its_address_serves_and_exits_0_on_signal(signum):
    process = await trio.lowlevel.open_process(_command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with trio.fail_after(30):  # interpreter start-up on a loaded 2-core machine
            line = await _read_line(process.stdout)
        match = LISTENING.match(line)
        assert match, line
        port = int(match.group(2))
        async with open_channel("127.0.0.1", port) as channel:
            assert await check_health(channel, "vllm.Inference") == health_pb2.HealthCheckResponse.SERVING
            async with watch_health(channel, "") as updates:
                assert await updates.__anext__() == health_pb2.HealthCheckResponse.SERVING
                async with channel.unary_stream(
                    "/vllm.Inference/GenerateStream", gen("cli", max_new_tokens=10_000), pb.GenerateResponse
                ) as stream:
                    assert (await stream.__anext__()).HasField("prompt_info")
                    process.send_signal(signum)
                    # In-flight generation fails with UNAVAILABLE "server shutting down" (or the
                    # connection is gone if the process exited first).
                    with pytest.raises(RpcError) as info:
                        with trio.fail_after(10):
                            async for _ in stream:
                                pass
                    assert info.value.code.name == "UNAVAILABLE"
                # Watch: NOT_SERVING then OK, or the connection ends (both are vLLM-like, docs/reference/real-vllm.md#shutdown-and-engine-death).
                try:
                    after = [s async for s in updates]
                except ConnectionLostError:
                    after = []
                assert set(after) <= {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert await _wait_exit(process) == 0
    finally:
        if process.returncode is None:
            process.kill()  # by PID: only the child this test started
        with trio.CancelScope(shield=True):
            await process.wait()
            await process.stdout.aclose()
            await process.stderr.aclose()


async def test_subprocess_bad_engine_json_exits_2_without_listening():
    result = await trio.run_process(
        [sys.executable, "-m", "trio_sidecar.mock", "--extra-engine-args", "{oops"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 2
    assert b"invalid engine args JSON" in result.stderr and b"listening" not in result.stdout


async def test_subprocess_port_in_use_exits_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = await trio.run_process(
            [sys.executable, "-m", "trio_sidecar.mock", "--listen", f"127.0.0.1:{port}"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 1
    assert b"listening" not in result.stdout and result.stderr


async def _open_unread_stream(port: int) -> trio.SocketStream:
    """A raw HTTP/2 client that starts a GenerateStream and never grants window: once the server has
    sent the default 64 KiB its handler parks on flow control, so a graceful drain cannot finish.
    Returns when the whole window has been used."""
    import h2.config
    import h2.connection

    request = pb.GenerateRequest(
        request_id="unread",
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        stopping=pb.StoppingCriteria(max_new_tokens=30000),
        response=pb.ResponseOptions(output_logprobs=True, output_candidates=pb.CandidateTokens(all=True)),
    ).SerializeToString()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/vllm.Inference/GenerateStream"),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ],
    )
    conn.send_data(1, b"\x00" + len(request).to_bytes(4, "big") + request, end_stream=True)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(conn.data_to_send())
    import h2.events

    received = 0
    with trio.fail_after(30):
        while received < 65535:  # h2's default initial window, never replenished
            data = await stream.receive_some(65536)
            assert data, "server closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += event.flow_controlled_length
    return stream


async def test_a_second_signal_during_shutdown_exits_1_at_once():
    process = await trio.lowlevel.open_process(
        _command(speedup_ratio=0.0), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        with trio.fail_after(30):
            port = int(LISTENING.match(await _read_line(process.stdout)).group(2))
        async with open_channel("127.0.0.1", port) as channel:
            async with watch_health(channel, "") as updates:
                assert await updates.__anext__() == health_pb2.HealthCheckResponse.SERVING
                raw = await _open_unread_stream(port)
                try:
                    process.send_signal(signal.SIGTERM)
                    with trio.fail_after(10):
                        assert await updates.__anext__() == health_pb2.HealthCheckResponse.NOT_SERVING
                    process.send_signal(signal.SIGTERM)
                    assert await _wait_exit(process, timeout=10) == 1
                finally:
                    await raw.aclose()
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
            await process.stdout.aclose()
            await process.stderr.aclose()
