"""gRPC message compression as grpcio speaks it, both ways, and the decompressed-size cap.

gRPC's ``gzip`` is RFC 1952 gzip framing and its ``deflate`` is zlib framing (RFC 1950); purerpc 0.8.0
read both as zlib (so a grpcio client using gzip got INTERNAL "incorrect header check") and inflated
without an output limit. The peer is grpcio in every direction: a grpc.aio client compressing its
requests to our server, and a grpc.aio server compressing its responses to our client.
"""

from __future__ import annotations

import gzip
import struct
import zlib

import grpc
import pytest
import trio
from transport_peers import GENERATE, MIB, _aio_handlers, aio_options, aio_stream, aio_unary, request

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import open_channel
from trio_sidecar.transport._decompress import BoundedReadBuffer, MessageDecodeError

COMPRESSIONS = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}
# Compressible: grpcio sends a message uncompressed when compressing would not make it smaller.
TEXT = "compress me " * 20_000


@pytest.fixture
def inflated(monkeypatch) -> list[str]:
    """The encodings of the messages our transport decompressed (proves the peer really compressed)."""
    seen: list[str] = []
    original = BoundedReadBuffer.decompress

    def spy(self, data):  # type: ignore[no-untyped-def]
        seen.append(self._message_encoding)
        return original(self, data)

    monkeypatch.setattr(BoundedReadBuffer, "decompress", spy)
    return seen


@pytest.mark.parametrize("encoding", sorted(COMPRESSIONS))
async def test_grpc_aio_client_compressed_requests_reach_our_server(aio, our_server, encoding, inflated):
    async def call() -> tuple[str, list[str]]:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{our_server.port}", options=aio_options(), compression=COMPRESSIONS[encoding]
        ) as channel:
            unary = await aio_unary(channel, request("echo", text=TEXT), timeout=20)
            streamed = [
                m.outputs.text async for m in aio_stream(channel, request("stream", text=TEXT, n=3), timeout=20)
            ]
            return unary.outputs.text, streamed

    with trio.fail_after(30):
        unary_text, streamed = await aio.call(call)
    assert unary_text == TEXT
    assert streamed == [TEXT] * 3
    assert inflated == [encoding, encoding]


@pytest.mark.parametrize("encoding", sorted(COMPRESSIONS))
async def test_our_client_reads_responses_a_grpc_aio_server_compressed(aio, recorder, encoding, inflated):
    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=aio_options(), compression=COMPRESSIONS[encoding])
        server.add_generic_rpc_handlers(_aio_handlers(recorder))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = await aio.call(start)
    try:
        with trio.fail_after(30):
            async with open_channel("127.0.0.1", port) as channel:
                reply = await channel.unary_unary(GENERATE, request("echo", text=TEXT), pb.GenerateResponse, timeout=20)
                assert reply.outputs.text == TEXT
                texts = []
                async with channel.unary_stream(
                    "/vllm.Inference/GenerateStream", request("stream", text=TEXT, n=3), pb.GenerateResponse, timeout=20
                ) as responses:
                    async for message in responses:
                        texts.append(message.outputs.text)
                assert texts == [TEXT] * 3
                assert inflated == [encoding] * 4
    finally:
        await aio.call(lambda: server.stop(None))


def _raw_request(encoding: str, payload: bytes) -> bytes:
    """One gRPC message with the compressed flag set, compressed as ``encoding`` by the standard library."""
    if encoding == "gzip":
        body = gzip.compress(payload)
    else:
        body = zlib.compress(payload)
    return struct.pack(">BI", 1, len(body)) + body


def _bomb(encoding: str, size: int) -> bytes:
    """``size`` zero bytes compressed in chunks (never holding ``size`` bytes at once)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    chunk = bytes(MIB)
    parts = [compressor.compress(chunk) for _ in range(size // MIB)]
    parts.append(compressor.flush())
    return b"".join(parts)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_decompression_is_capped_at_the_message_limit(encoding):
    limit = 4 * MIB
    buffer = BoundedReadBuffer(encoding, limit)
    body = _bomb(encoding, 64 * MIB)
    assert len(body) < limit  # passes the prefix check: only its output is over the limit
    with pytest.raises(MessageDecodeError) as info:
        buffer.data_received(struct.pack(">BI", 1, len(body)) + body)
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max after decompression" in info.value.message

    exact = BoundedReadBuffer(encoding, limit)
    exact.data_received(_raw_request(encoding, b"z" * limit))
    assert [len(m) for m, _ in exact.read_all_complete_messages_flowcontrol()] == [limit]


@pytest.mark.parametrize(
    ("encoding", "body", "code"),
    [
        ("gzip", zlib.compress(b"zlib framing where gzip is declared"), StatusCode.INTERNAL),
        ("deflate", zlib.compress(b"truncated " * 100)[:-8], StatusCode.INTERNAL),
        ("identity", b"anything", StatusCode.INTERNAL),
        (None, b"anything", StatusCode.INTERNAL),
        ("snappy", b"anything", StatusCode.UNIMPLEMENTED),
    ],
)
def test_undecodable_compressed_messages_fail_with_a_status(encoding, body, code):
    buffer = BoundedReadBuffer(encoding, MIB)
    with pytest.raises(MessageDecodeError) as info:
        buffer.data_received(struct.pack(">BI", 1, len(body)) + body)
    assert info.value.code == code, info.value.message
