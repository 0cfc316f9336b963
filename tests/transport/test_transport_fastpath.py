"""The DATA-frame fast path of ``GrpcProtocol.receive_data`` against h2's own path (differential).

The same server byte stream (plain, padded, split and multi-message DATA frames, oversize and compressed
messages, trailers, RST_STREAM, PING, END_STREAM on DATA), cut at random read boundaries, is fed to a
protocol using the fast path and to one that hands every read to h2 whole. Events (up to a stream's local
failure, after which the client ignores that stream), errors, connection windows and, without failures,
stream windows, stream states and the bytes to send must match.
"""

from __future__ import annotations

import random
import struct

import h2.config
import h2.connection
import h2.exceptions
import pytest
from purerpc.grpclib.config import GRPCConfiguration

from trio_sidecar.transport._protocol import GrpcProtocol

STREAMS = (1, 3, 5, 7)
REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/x"),
    (":authority", "x"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]
FIELDS = ("stream_id", "data", "flow_controlled_length", "code", "message", "error_code", "last_stream_id")


def grpc_frame(payload: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BI", compressed, len(payload)) + payload


def key(event: object) -> tuple[str, dict[str, str]]:
    return type(event).__name__, {name: repr(getattr(event, name)) for name in FIELDS if hasattr(event, name)}


def until_failure(events: list) -> list:
    """What the client acts on: nothing of a stream after its failure, reset or end."""
    dead: set[str] = set()
    kept = []
    for name, fields in events:
        stream = fields.get("stream_id")
        if stream in dead:
            continue
        kept.append((name, fields))
        if name in ("StreamFailed", "StreamReset", "ResponseEnded"):
            dead.add(stream)
    return kept


def server_bytes(rnd: random.Random, server: h2.connection.H2Connection) -> bytes:
    wire = b""
    for stream_id in STREAMS:
        server.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    wire += server.data_to_send()
    live = set(STREAMS)
    for _ in range(rnd.randint(1, 60)):
        if not live:
            break
        stream_id = rnd.choice(sorted(live))
        r = rnd.random()
        try:
            if r < 0.6:
                payload = b"".join(
                    grpc_frame(bytes([rnd.randrange(256)]) * rnd.randint(0, 40)) for _ in range(rnd.randint(1, 4))
                )
                if rnd.random() < 0.2:  # a message split across frames
                    cut = rnd.randint(0, len(payload))
                    server.send_data(stream_id, payload[:cut])
                    server.send_data(stream_id, payload[cut:])
                else:
                    server.send_data(stream_id, payload, pad_length=rnd.choice([None, None, 3]))
            elif r < 0.65:
                server.send_data(stream_id, grpc_frame(b"z" * 200))  # oversize for the small limit
            elif r < 0.7:
                server.send_data(stream_id, grpc_frame(b"c", compressed=1))
            elif r < 0.8:
                server.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
                live.discard(stream_id)
            elif r < 0.85:
                server.reset_stream(stream_id)
                live.discard(stream_id)
            elif r < 0.9:
                server.ping(b"12345678")
            else:
                server.send_data(stream_id, grpc_frame(b"e"), end_stream=True)
                live.discard(stream_id)
        except h2.exceptions.FlowControlError:
            pass
        wire += server.data_to_send()
    return wire


def run(seed: int) -> int:
    rnd = random.Random(seed)
    config = GRPCConfiguration(client_side=True, max_message_length=rnd.choice([64, 1000, 100000]))
    fast, reference = GrpcProtocol(config), GrpcProtocol(config)
    reference.receive_data = reference._receive_via_h2  # type: ignore[method-assign]
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    server.initiate_connection()
    for client in (fast, reference):
        client.initiate_connection()
        for stream_id in STREAMS:
            client.h2_connection.send_headers(stream_id, REQUEST)
            client.h2_connection.send_data(stream_id, grpc_frame(b"req"), end_stream=True)
    server.receive_data(fast.data_to_send())
    reference.data_to_send()
    wire = server.data_to_send() + server_bytes(rnd, server)

    got: dict[str, list] = {"fast": [], "reference": []}
    position = 0
    while position < len(wire):
        chunk = wire[position : position + rnd.choice([1, 5, 9, 17, 100, 1000, 100000])]
        position += len(chunk)
        errors = {}
        for name, client in (("fast", fast), ("reference", reference)):
            try:
                got[name] += [key(event) for event in client.receive_data(chunk)]
            except h2.exceptions.ProtocolError as exc:
                errors[name] = repr(exc)
        assert errors.get("fast") == errors.get("reference"), seed
        if errors:
            break
    assert until_failure(got["fast"]) == until_failure(got["reference"]), seed

    a, b = fast.h2_connection, reference.h2_connection
    wa, wb = a._inbound_flow_control_window_manager, b._inbound_flow_control_window_manager
    assert wa.current_window_size + wa._bytes_processed == wb.current_window_size + wb._bytes_processed, seed
    if not any(name == "StreamFailed" for name, _ in got["fast"]):
        assert a.streams.keys() == b.streams.keys(), seed
        for stream_id, stream in a.streams.items():
            other = b.streams[stream_id]
            assert (
                stream._inbound_window_manager.current_window_size == other._inbound_window_manager.current_window_size
            )
            assert stream.state_machine.state == other.state_machine.state
        assert fast.data_to_send() == reference.data_to_send(), seed
    return len(got["fast"])


@pytest.mark.parametrize("block", range(4))
def test_data_fast_path_matches_h2(block: int) -> None:
    assert sum(run(seed) for seed in range(block * 250, block * 250 + 250)) > 0


@pytest.mark.parametrize("seed", range(40))
def test_acknowledge_counts_like_h2(seed: int) -> None:
    rnd = random.Random(seed)
    config = GRPCConfiguration(client_side=True, max_message_length=rnd.choice([64, 1000, 100000]))
    fast, reference = GrpcProtocol(config), GrpcProtocol(config)
    reference.receive_data = reference._receive_via_h2  # type: ignore[method-assign]
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    server.initiate_connection()
    for client in (fast, reference):
        client.initiate_connection()
        for stream_id in STREAMS:
            client.h2_connection.send_headers(stream_id, REQUEST)
            client.h2_connection.send_data(stream_id, grpc_frame(b"req"), end_stream=True)
    server.receive_data(fast.data_to_send())
    reference.data_to_send()
    wire = server.data_to_send() + server_bytes(rnd, server)
    failed = False
    position = 0
    while position < len(wire):
        chunk = wire[position : position + rnd.choice([9, 100, 1000])]
        position += len(chunk)
        try:
            events = fast.receive_data(chunk)
            reference.receive_data(chunk)
        except h2.exceptions.ProtocolError:
            break
        if rnd.random() < 0.5:  # h2 forgets closed streams when it counts the open ones
            assert fast.h2_connection.open_outbound_streams == reference.h2_connection.open_outbound_streams
        for event in events:
            length = getattr(event, "flow_controlled_length", 0)
            if length and type(event).__name__ == "MessageReceived":
                assert fast.acknowledge(event.stream_id, length) is (fast.output_size() > 0)
                reference.h2_connection.acknowledge_received_data(length, event.stream_id)
        a, b = fast.h2_connection, reference.h2_connection
        wa, wb = a._inbound_flow_control_window_manager, b._inbound_flow_control_window_manager
        assert (wa.current_window_size, wa._bytes_processed) == (wb.current_window_size, wb._bytes_processed)
        for stream_id, stream in a.streams.items():
            if not stream.open:  # (a closed stream's window is moot; after a local stream failure the two
                continue  # paths may close it before or after crediting its buffered bytes)
            sa, sb = stream._inbound_window_manager, b.streams[stream_id]._inbound_window_manager
            assert (sa.current_window_size, sa._bytes_processed) == (sb.current_window_size, sb._bytes_processed)
        failed = failed or any(type(event).__name__ == "StreamFailed" for event in events)
        if not failed:  # (after a local stream failure the two paths answer late frames differently)
            assert fast.data_to_send() == reference.data_to_send()
