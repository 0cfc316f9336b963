"""What our client puts on the wire, seen by a bare h2 server: RST_STREAM(CANCEL), grpc-timeout, metadata."""

from __future__ import annotations

import struct
import time
from functools import partial

import h2.config
import h2.connection
import h2.events
import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, request

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.transport import open_channel


class BareH2Server:
    """Answers every request with response headers and one message, then keeps the stream open.

    Records request headers, RST_STREAM frames (stream id, error code, time) and DATA after a reset.
    """

    def __init__(self) -> None:
        self.requests: dict[int, dict[str, str]] = {}
        self.resets: list[tuple[int, int, float]] = []
        self.port = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        message = pb.GenerateResponse(outputs=pb.SequenceOutput(index=0)).SerializeToString()
        while data := await stream.receive_some(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    self.requests[event.stream_id] = dict(event.headers)
                    conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/grpc")])
                    conn.send_data(event.stream_id, struct.pack(">BI", 0, len(message)) + message)
                elif isinstance(event, h2.events.StreamReset):
                    self.resets.append((event.stream_id, event.error_code, time.monotonic()))
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            await stream.send_all(conn.data_to_send())


@pytest.fixture
async def bare_server(nursery):
    server = BareH2Server()
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    server.port = listeners[0].socket.getsockname()[1]
    return server


async def test_leaving_a_stream_sends_rst_stream_cancel_at_once(bare_server):
    async with open_channel("127.0.0.1", bare_server.port) as channel:
        async with channel.unary_stream(GENERATE_STREAM, request("stream"), pb.GenerateResponse) as stream:
            await stream.__anext__()
        left = time.monotonic()
        with trio.fail_after(2):
            while not bare_server.resets:
                await trio.sleep(0.001)
        stream_id, code, at = bare_server.resets[0]
        assert (stream_id, code) == (1, h2.errors.ErrorCodes.CANCEL)
        assert at - left < 0.1


async def test_cancelled_unary_call_sends_rst_stream_cancel(bare_server):
    async with open_channel("127.0.0.1", bare_server.port) as channel:
        with trio.move_on_after(0.05):
            await channel.unary_unary(GENERATE, request("echo"), pb.GenerateResponse)  # never gets trailers
        with trio.fail_after(2):
            while not bare_server.resets:
                await trio.sleep(0.001)
        assert bare_server.resets[0][:2] == (1, h2.errors.ErrorCodes.CANCEL)


async def test_request_headers_carry_timeout_and_metadata(bare_server):
    async with open_channel("127.0.0.1", bare_server.port) as channel:
        with trio.move_on_after(0.05):
            await channel.unary_unary(
                GENERATE, request("echo"), pb.GenerateResponse, timeout=30, metadata=[("x-data-parallel-rank", "2")]
            )
    headers = bare_server.requests[1]
    assert headers[":path"] == GENERATE
    assert headers["grpc-timeout"] == "30000000u"
    assert headers["x-data-parallel-rank"] == "2"
    assert (headers["te"], headers["content-type"]) == ("trailers", "application/grpc")
