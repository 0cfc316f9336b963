"""RST_STREAM(REFUSED_STREAM) means the server did not process the stream (RFC 9113 section 8.7): the client starts
the call again on a new stream, as grpc-core does, within the call's deadline and a bounded number of tries.

A grpc.aio server at its MAX_CONCURRENT_STREAMS refuses streams now and then even when the client respects the
limit (it still counts a stream the client already saw end), so without this a loaded pool saw spurious
UNAVAILABLE errors.
"""

from __future__ import annotations

import struct
from functools import partial

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, request

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import RpcError, open_channel
from trio_sidecar.transport._client import REFUSED_STREAM_RETRIES


class RefusingServer:
    """Refuses the first ``refuse`` streams, then answers each request with one message and OK trailers."""

    def __init__(self, refuse: int) -> None:
        self.refuse = refuse
        self.streams: list[int] = []
        self.port = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        message = pb.GenerateResponse(outputs=pb.SequenceOutput(index=0, text="ok")).SerializeToString()
        while data := await stream.receive_some(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    self.streams.append(event.stream_id)
                    if len(self.streams) <= self.refuse:
                        conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                        continue
                    conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/grpc")])
                    conn.send_data(event.stream_id, struct.pack(">BI", 0, len(message)) + message)
                    conn.send_headers(event.stream_id, [("grpc-status", "0")], end_stream=True)
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            await stream.send_all(conn.data_to_send())


async def _serve(nursery: trio.Nursery, refuse: int) -> RefusingServer:
    server = RefusingServer(refuse)
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    server.port = listeners[0].socket.getsockname()[1]
    return server


async def test_a_refused_unary_call_is_sent_again_on_a_new_stream(nursery):
    server = await _serve(nursery, refuse=2)
    async with open_channel("127.0.0.1", server.port) as channel:
        response = await channel.unary_unary(GENERATE, request("echo"), pb.GenerateResponse, timeout=5)
    assert response.outputs.text == "ok"
    assert server.streams == [1, 3, 5]


async def test_a_refused_stream_is_opened_again_on_a_new_stream(nursery):
    server = await _serve(nursery, refuse=1)
    async with open_channel("127.0.0.1", server.port) as channel:
        async with channel.unary_stream(GENERATE_STREAM, request("stream"), pb.GenerateResponse, timeout=5) as s:
            texts = [m.outputs.text async for m in s]
    assert texts == ["ok"]
    assert server.streams == [1, 3]


@pytest.mark.parametrize("kind", ["unary", "stream"])
async def test_a_server_that_keeps_refusing_fails_the_call_with_unavailable(nursery, kind):
    server = await _serve(nursery, refuse=1000)
    async with open_channel("127.0.0.1", server.port) as channel:
        with pytest.raises(RpcError) as info:
            if kind == "unary":
                await channel.unary_unary(GENERATE, request("echo"), pb.GenerateResponse, timeout=5)
            else:
                async with channel.unary_stream(GENERATE_STREAM, request("stream"), pb.GenerateResponse, timeout=5):
                    pass
        assert (info.value.code, info.value.message) == (StatusCode.UNAVAILABLE, "stream refused by the server")
        assert len(server.streams) == REFUSED_STREAM_RETRIES + 1
        # The channel itself is fine: the connection was never at fault.
        server.refuse = 0
        response = await channel.unary_unary(GENERATE, request("echo"), pb.GenerateResponse, timeout=5)
        assert response.outputs.text == "ok"
