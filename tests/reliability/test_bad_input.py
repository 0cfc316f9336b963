"""Bad input at every boundary gives a clear error, and a serving process keeps serving.

* CLI values (``trio-sidecar run`` / ``trio-sidecar mock`` as subprocesses): usage errors exit 2 with the
  offending flag or key named on stderr, before any socket is opened (docs/reference/sidecar.md#exit-codes).
* Malformed engine JSON for the mock: exit 2.
* Garbage bytes and an HTTP/1.1 request on the mock's gRPC port: that connection is closed, and other clients
  are served meanwhile and afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio
from reliability_fakes import drive, mock_config, mock_idle, mock_request, sidecar_config, wait_until

# Subprocesses share two cores with other test runs: bounded concurrency, generous per-process bound.
_CONCURRENCY = 3
_PROCESS_TIMEOUT = 120.0

ENDPOINT = "127.0.0.1:9"  # never contacted: every case fails before any socket is opened

RUN_CASES = [
    # (argv after "run", extra env, text expected on stderr)
    (["--grpc-endpoint", ENDPOINT, "--grpc-connections", "0"], {}, "`--grpc-connections` must be at least 1"),
    (
        ["--grpc-endpoint", ENDPOINT, "--grpc-connect-attempt-timeout-secs", "0"],
        {},
        "--grpc-connect-attempt-timeout-secs",
    ),
    (["--grpc-endpoint", ENDPOINT, "--grpc-retry-interval-secs", "abc"], {}, "--grpc-retry-interval-secs"),
    (["--grpc-endpoint", ENDPOINT, "--grpc-startup-deadline-secs", "-5"], {}, "--grpc-startup-deadline-secs"),
    (["--grpc-endpoint", "https://127.0.0.1:9"], {}, "TLS endpoints are not supported by `--grpc-endpoint`"),
    (["--grpc-endpoint", "http://user@127.0.0.1:9"], {}, "must not include user information"),
    ([], {}, "--grpc-endpoint"),
    (["--grpc-endpoint", ENDPOINT, "--disaggregation-mode", "sideways"], {}, "--disaggregation-mode"),
    (
        ["--grpc-endpoint", ENDPOINT, "--enable-rl", "--vllm-http-endpoint", "http://user@127.0.0.1:9"],
        {},
        "`--vllm-http-endpoint` must not include user information",
    ),
    (["--grpc-endpoint", ENDPOINT, "--no-such-flag"], {}, "--no-such-flag"),
    (["--grpc-endpoint", ENDPOINT], {"DYN_SIDECAR_GRPC_CONNECTIONS": "many"}, "DYN_SIDECAR_GRPC_CONNECTIONS"),
    (["--grpc-endpoint", ENDPOINT], {"TRIO_SIDECAR_HEALTH_PROBER": "perhaps"}, "TRIO_SIDECAR_HEALTH_PROBER"),
]

MOCK_CASES = [
    (["--listen", "localhost:0"], "invalid listen address 'localhost:0'"),
    (["--listen", "127.0.0.1:notaport"], "invalid listen address '127.0.0.1:notaport'"),
    (["--listen", "127.0.0.1:0", "--seed", "-1"], "--seed"),
    (["--listen", "127.0.0.1:0", "--max-concurrent-requests", "0"], "max_concurrent_requests"),
    (["--listen", "127.0.0.1:0", "--disaggregation-mode", "sideways"], "--disaggregation-mode"),
    (["--listen", "127.0.0.1:0", "--log-level", "loud"], "--log-level"),
]

ENGINE_JSON_CASES = [
    ('{"block_size": 4', "engine"),  # truncated JSON
    ('{"block_size": 4} trailing', "engine"),
    ('{"no_such_arg": 1}', "no_such_arg"),
    ('{"engine_type": "sglang"}', "engine_type"),
    ('{"dp_size": 0}', "dp_size"),
    ('{"block_size": null}', "block_size"),
    ('{"num_gpu_blocks": 0}', "num_gpu_blocks"),
    ('{"worker_type": "prefill"}', "worker_type"),
    ('{"block_size": "four"}', "block_size"),
]


def clean_environ(env: dict[str, str] | None = None) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "TRIO_SIDECAR_", "VLLM_"))}
    # Should a case be accepted by mistake, it fails fast instead of waiting 1800 s for port 9.
    environ["DYN_SIDECAR_GRPC_STARTUP_DEADLINE_SECS"] = "1"
    environ.update(env or {})
    return environ


async def run_cli(
    args: list[str], env: dict[str, str] | None, limiter: trio.CapacityLimiter
) -> subprocess.CompletedProcess:
    async with limiter:
        with trio.fail_after(_PROCESS_TIMEOUT):
            return await trio.run_process(
                [sys.executable, "-m", "trio_sidecar", *args],
                env=clean_environ(env),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                stdin=subprocess.DEVNULL,
            )


async def _expect_usage_errors(cases: list[tuple[list[str], dict[str, str], str]]) -> None:
    results: dict[int, subprocess.CompletedProcess] = {}
    limiter = trio.CapacityLimiter(_CONCURRENCY)

    async def one(index: int, args: list[str], env: dict[str, str]) -> None:
        results[index] = await run_cli(args, env, limiter)

    async with trio.open_nursery() as nursery:
        for index, (args, env, _) in enumerate(cases):
            nursery.start_soon(one, index, args, env)
    failures = []
    for index, (args, env, expected) in enumerate(cases):
        result = results[index]
        stderr = result.stderr.decode(errors="replace")
        if result.returncode != 2 or expected not in stderr:
            failures.append(f"{args} {env}: exit {result.returncode}, stderr {stderr[-400:]!r}")
        # Nothing was served: a usage error never reaches the "listening" line.
        if b"listening on" in result.stdout:
            failures.append(f"{args}: started serving")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("args", "env", "expected"), RUN_CASES, ids=[" ".join(c[0][2:]) or "no-args" for c in RUN_CASES]
)
def test_run_cli_rejects_malformed_values_in_process(args, env, expected, capsys):
    from trio_sidecar.cli import main

    assert main(["run", *args], environ=clean_environ(env)) == 2
    assert expected in capsys.readouterr().err


async def test_run_cli_process_exits_2_on_malformed_values():
    # The same path through a real process (exit status, stderr), for a representative subset.
    picked = [RUN_CASES[0], RUN_CASES[4], RUN_CASES[10], RUN_CASES[11]]
    await _expect_usage_errors([(["run", *args], env, text) for args, env, text in picked])


async def test_mock_cli_rejects_malformed_values_with_exit_2():
    await _expect_usage_errors([(["mock", *args], {}, text) for args, text in MOCK_CASES])


async def test_mock_rejects_malformed_engine_json_with_exit_2(tmp_path):
    missing = tmp_path / "missing.json"
    cases = [
        (["mock", "--listen", "127.0.0.1:0", "--extra-engine-args", value], {}, text)
        for value, text in ENGINE_JSON_CASES
    ]
    cases.append((["mock", "--listen", "127.0.0.1:0", "--extra-engine-args", str(missing)], {}, "missing.json"))
    await _expect_usage_errors(cases)


# --- hostile bytes on the gRPC port ------------------------------------------------------------------------

GARBAGE = bytes(range(256)) * 4
HTTP1 = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8\r\nAccept: */*\r\n\r\n"
# A valid HTTP/2 preface and SETTINGS, then a DATA frame on stream 0 (a connection PROTOCOL_ERROR).
BAD_FRAME = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    + b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x"
)


async def _read_until_closed(stream: trio.SocketStream, *, limit: int = 1 << 20) -> bytes:
    received = b""
    while len(received) < limit:
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset by the peer counts as closed
            break
        if not data:
            break
        received += data
    return received


@pytest.mark.parametrize("payload", [GARBAGE, HTTP1, BAD_FRAME], ids=["garbage", "http1", "bad-frame"])
async def test_hostile_bytes_on_the_mock_port_close_only_that_connection(payload):
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.mock import open_mock_server

    with trio.fail_after(60):
        async with open_mock_server(mock_config()) as mock:
            async with open_sidecar(sidecar_config(mock.address, grpc_connections=1)) as sidecar:
                before = await drive(sidecar, mock_request(4), "before")
                assert before.error is None and len(before.tokens) == 4

                hostile = await trio.open_tcp_stream("127.0.0.1", mock.port)
                async with hostile:
                    await hostile.send_all(payload)
                    # While the hostile connection is being handled, another client is served.
                    during = await drive(sidecar, mock_request(4), "during")
                    assert during.error is None and len(during.tokens) == 4
                    with trio.fail_after(20):
                        answer = await _read_until_closed(hostile)
                # Whatever the server said before closing, it was not an HTTP/1.1 success.
                assert not answer.startswith(b"HTTP/1.1 200")

                after = await drive(sidecar, mock_request(4), "after")
                assert after.error is None and len(after.tokens) == 4
                await wait_until(lambda: mock_idle(mock))


# --- malformed request dicts at the API boundary (what Dynamo hands the sidecar) ----------------------------

MALFORMED_REQUESTS = [
    {},
    {"token_ids": []},
    {"token_ids": "1 2 3"},
    {"token_ids": [1, -2, 3]},
    {"token_ids": [2**40]},
    {"token_ids": [1, 2], "stop_conditions": {"max_tokens": -1}},
    {"token_ids": [1, 2], "stop_conditions": "eight"},
    {"token_ids": [1, 2], "sampling_options": {"n": 2}},
    {"token_ids": [1, 2], "sampling_options": {"top_k": -2}},
    {"token_ids": [1, 2], "output_options": {"logprobs": 2**31}},
    {"token_ids": [1, 2], "extra_args": {"unknown": True}},
    {"token_ids": [1, 2], "multi_modal_data": {"image_url": [{"Url": "file:///etc/passwd"}]}},
    [1, 2, 3],
    None,
]


async def test_malformed_request_dicts_are_rejected_before_any_rpc():
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.core.errors import InvalidArgument
    from trio_sidecar.mock import open_mock_server

    with trio.fail_after(60):
        async with open_mock_server(mock_config()) as mock:
            async with open_sidecar(sidecar_config(mock.address, grpc_connections=1)) as sidecar:
                for index, request in enumerate(MALFORMED_REQUESTS):
                    outcome = await drive(sidecar, request, f"malformed-{index}")
                    outcome.check_invariant()
                    assert not outcome.admitted, request
                    assert isinstance(outcome.error, InvalidArgument), (request, outcome.error)
                    assert str(outcome.error), request
                assert not [r for r in mock.recorded_requests if r[1].request_id.startswith("malformed-")]
                good = await drive(sidecar, mock_request(3), "good-after-malformed")
                assert good.error is None and len(good.tokens) == 3
                await wait_until(lambda: mock_idle(mock))
