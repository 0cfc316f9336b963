"""``trio-sidecar run`` on Dynamo 1.6.1's push egress, and the stalled-consumer guard it needs.

The bridge's handler declares ``response_sender``, so the runtime hands each request a ``ResponseSender``
instead of pulling items from the generator (trio_sidecar/dynamo/bridge.py, "Egress"). ``send`` blocks its
caller while the request's 128-frame response channel is full; the bridge sends a request's first frames on
the asyncio loop (they cannot block) and later ones from egress threads, so a client that stops reading a
long stream never stalls the other requests.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

# The stalled stream: 16,384 tokens with 20 top logprobs each (~40 MB of SSE) outgrow what the sockets and the
# frontend buffer, so the rest backs up into the worker's response channel (8,192 did not, on the 2-core
# machine). Paced (speedup 10) so that each token is its own frame, as in real decoding; the KV cache holds it.
LONG = 16384
ENGINE_ARGS = {**FAST_ENGINE_ARGS, "max_model_len": 2 * LONG, "num_gpu_blocks": 65536, "speedup_ratio": 10.0}


@pytest.fixture(scope="module")
def push(deployment_factory):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS)
    dep.frontend()
    sidecar = dep.trio_sidecar(mock, env={"DYN_LOG": "info"})
    dep.wait_ready("tiny")
    return dep, mock, sidecar


def test_the_worker_is_served_on_the_push_egress(push):
    _, _, sidecar = push
    deadline = time.monotonic() + 10
    while "serving endpoint with push egress" not in sidecar.log():
        assert time.monotonic() < deadline, sidecar.log()[-3000:]
        time.sleep(0.1)
    assert "serving endpoint with pull egress" not in sidecar.log()


def _stalled_client(port: int) -> socket.socket:
    """A streaming chat completion whose client never reads (a tiny receive buffer fills at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((local.LOOPBACK, port))
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "stall"}],
            "max_tokens": LONG,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return sock


async def _streams(port: int, n: int) -> list[int]:
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "other",
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()

    async def one() -> int:
        reader, writer = await asyncio.open_connection(local.LOOPBACK, port)
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            tokens = 0
            while line := await reader.readline():
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return tokens
        finally:
            writer.close()

    return await asyncio.gather(*(one() for _ in range(n)))


@pytest.mark.timeout(180)  # the mock paces a long stalled stream (~30 s on 2 cores)
def test_a_client_that_stops_reading_does_not_stall_other_requests(push):
    dep, mock, _ = push
    sock = _stalled_client(dep.http_port)
    try:
        # The worker drains vLLM whatever its consumer does, so the mock finishes the stalled request: by then
        # its whole output has left vLLM and what the sockets and the frontend could not hold fills the
        # worker's response channel. Sending into that channel from the asyncio loop would now block it (and
        # with it every request: checked by making every frame inline, which fails this test).
        deadline = time.monotonic() + 120
        while not mock.active():
            assert time.monotonic() < deadline, "the stalled request never reached the mock"
            time.sleep(0.05)
        while mock.active():
            assert time.monotonic() < deadline, "the mock did not finish the stalled request"
            time.sleep(0.1)
        time.sleep(0.5)
        assert asyncio.run(asyncio.wait_for(_streams(dep.http_port, 16), 30)) == [16] * 16
    finally:
        sock.close()
