"""A connection reset during the HTTP/2 handshake surfaces as the transport's documented errors.

The pool's retry loop (docs/reference/sidecar.md#construction-and-retries) catches OSError, SidecarError and RpcError; a raw
trio.BrokenResourceError from a handshake send would escape it and abort startup instead of retrying.
"""

from __future__ import annotations

import socket
import struct

import trio

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar.transport import ConnectionLostError, RpcError, connect_channel

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def _settings_then_reset(listener: trio.SocketListener) -> None:
    stream = await listener.accept()
    received = b""
    while len(received) < len(PREFACE):
        received += await stream.receive_some(65536)
    await stream.send_all(EMPTY_SETTINGS)
    # SO_LINGER 0: close() sends RST, so the client's next send (its SETTINGS ACK) or receive fails.
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


async def test_reset_during_the_handshake_is_a_documented_error() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    outcomes: set[str] = set()
    try:
        for _ in range(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_settings_then_reset, listener)
                with trio.fail_after(5):
                    try:
                        channel = await connect_channel(nursery, "127.0.0.1", port)
                    except ConnectionLostError:
                        outcomes.add("lost during handshake")
                        continue
                    # The handshake completed before the reset: the channel must then fail its calls.
                    try:
                        await channel.unary_unary(
                            "/grpc.health.v1.Health/Check",
                            health_pb2.HealthCheckRequest(),
                            health_pb2.HealthCheckResponse,
                        )
                    except RpcError as exc:
                        assert isinstance(exc, ConnectionLostError), exc
                        outcomes.add("lost after handshake")
                    else:
                        raise AssertionError("a call on a reset connection succeeded")
                    finally:
                        await channel.aclose()
    finally:
        await listener.aclose()
    assert outcomes  # every round ended in one of the two documented outcomes
