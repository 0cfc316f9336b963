"""The sans-IO layer (``_protocol``): h2 3.2.0's WINDOW_UPDATE race, per-stream failures, header values.

Frames are exchanged in memory between our ``GrpcProtocol`` (server side) and a plain h2 client.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import pytest
from hyperframe.frame import Frame, GoAwayFrame, RstStreamFrame, WindowUpdateFrame
from hypothesis import given, settings
from hypothesis import strategies as st
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection

from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport._events import (
    MessageReceived,
    RequestEnded,
    RequestReceived,
    StreamFailed,
    StreamReset,
)
from trio_sidecar.transport._protocol import GrpcProtocol
from trio_sidecar.transport._wire import decode_grpc_message, encode_grpc_message, encode_timeout

REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/vllm.Inference/Generate"),
    (":authority", "x"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]


def grpc_frame(payload: bytes) -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload


def frames_in(data: bytes) -> list[Frame]:
    frames = []
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        frames.append(frame)
        data = data[9 + length :]
    return frames


def connected_pair(server_class=GrpcProtocol, max_message_length: int = 1024):
    server = server_class(GRPCConfiguration(client_side=False, max_message_length=max_message_length))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    server.data_to_send()
    return server, client


def complete_call(server, client, stream_id: int) -> None:
    client.send_headers(stream_id, REQUEST_HEADERS)
    client.send_data(stream_id, grpc_frame(b"hi"), end_stream=True)
    events = server.receive_data(client.data_to_send())
    assert [type(e) for e in events] == [RequestReceived, MessageReceived, RequestEnded]
    h2server = server.h2_connection
    h2server.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    h2server.send_data(stream_id, grpc_frame(b"ok"))
    h2server.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
    client.receive_data(server.data_to_send())


def late_window_update_then_next_call(server, client) -> bytes:
    """Stream 1 completes and is pruned; then one read carries WINDOW_UPDATE(1) + a whole new call."""
    complete_call(server, client, 1)
    _ = server.h2_connection.open_inbound_streams  # h2 prunes closed streams here
    assert 1 not in server.h2_connection.streams
    late = WindowUpdateFrame(1, window_increment=1000).serialize()
    client.send_headers(3, REQUEST_HEADERS)
    client.send_data(3, grpc_frame(b"next"), end_stream=True)
    return late + client.data_to_send()


def test_late_window_update_for_a_pruned_stream_is_ignored_and_later_frames_are_delivered():
    server, client = connected_pair()
    events = server.receive_data(late_window_update_then_next_call(server, client))
    assert [(type(e), e.stream_id) for e in events] == [(RequestReceived, 3), (MessageReceived, 3), (RequestEnded, 3)]
    assert events[1].data == b"next"
    assert not [f for f in frames_in(server.data_to_send()) if isinstance(f, GoAwayFrame)]
    # The connection is still open: the next call completes normally.
    complete_call(server, client, 5)


def test_stock_core_on_h2_3_2_0_kills_the_connection_on_the_same_bytes():
    # Proves the test above reproduces the race (docs/reference/transport.md#the-h2-320-window_update-race).
    server, client = connected_pair(GRPCConnection)
    with pytest.raises(h2.exceptions.StreamClosedError):
        server.receive_data(late_window_update_then_next_call(server, client))
    assert any(isinstance(f, GoAwayFrame) for f in frames_in(server.data_to_send()))


def test_window_update_on_the_connection_still_counts():
    server, client = connected_pair()
    before = server.h2_connection.outbound_flow_control_window
    server.receive_data(WindowUpdateFrame(0, window_increment=777).serialize())
    assert server.h2_connection.outbound_flow_control_window == before + 777


def test_rst_stream_from_the_peer_becomes_an_event_and_drops_the_buffer():
    server, client = connected_pair()
    client.send_headers(1, REQUEST_HEADERS)
    client.send_data(1, grpc_frame(b"partial")[:4])
    server.receive_data(client.data_to_send())
    assert 1 in server.message_read_buffers
    client.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    events = server.receive_data(client.data_to_send())
    assert [(type(e), e.stream_id, e.error_code) for e in events] == [(StreamReset, 1, h2.errors.ErrorCodes.CANCEL)]
    assert 1 not in server.message_read_buffers


def test_oversize_message_fails_only_its_stream_and_keeps_the_other_events_of_the_read():
    server, client = connected_pair(max_message_length=1024)
    client.send_headers(1, REQUEST_HEADERS)
    client.send_data(1, grpc_frame(b"x" * 2000), end_stream=True)
    client.send_headers(3, REQUEST_HEADERS)
    client.send_data(3, grpc_frame(b"small"), end_stream=True)
    events = server.receive_data(client.data_to_send())
    failed = [e for e in events if isinstance(e, StreamFailed)]
    assert [(e.stream_id, e.code) for e in failed] == [(1, StatusCode.RESOURCE_EXHAUSTED)]
    assert failed[0].message == "received message larger than max (2000 vs. 1024)"
    assert [e.data for e in events if isinstance(e, MessageReceived)] == [b"small"]
    assert (RequestEnded, 3) in [(type(e), e.stream_id) for e in events]
    assert 1 not in server.message_read_buffers


def test_malformed_request_headers_fail_only_their_stream():
    server, client = connected_pair()
    client.send_headers(1, [*REQUEST_HEADERS[:2], (":path", "no-slash"), *REQUEST_HEADERS[3:]])
    client.send_data(1, grpc_frame(b"a"), end_stream=True)
    client.send_headers(3, REQUEST_HEADERS)
    client.send_data(3, grpc_frame(b"b"), end_stream=True)
    events = server.receive_data(client.data_to_send())
    assert isinstance(events[0], StreamFailed) and events[0].stream_id == 1
    assert events[0].code is StatusCode.INTERNAL
    assert [e.data for e in events if isinstance(e, MessageReceived)] == [b"b"]


def test_client_side_discard_returns_buffered_bytes_to_the_connection_window():
    client = GrpcProtocol(GRPCConfiguration(client_side=True, max_message_length=1 << 20))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    client.h2_connection.send_headers(1, REQUEST_HEADERS)
    client.h2_connection.send_data(1, grpc_frame(b"req"), end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc")])
    message = grpc_frame(b"y" * 40_000)  # 30 kB of it arrives: buffered, not yet a message
    for start in range(0, 30_000, 10_000):
        server.send_data(1, message[start : start + 10_000])
    assert client.receive_data(server.data_to_send()) != []
    manager = client.h2_connection._inbound_flow_control_window_manager
    assert manager.current_window_size + manager._bytes_processed < manager.max_window_size
    client.reset_stream(1)
    assert manager.current_window_size + manager._bytes_processed == manager.max_window_size
    assert any(isinstance(f, RstStreamFrame) for f in frames_in(client.data_to_send()))


@pytest.mark.parametrize(
    ("seconds", "header"),
    [
        (0.2, "200000u"),
        (5, "5000000u"),
        (30.5, "30500000u"),
        (1800, "1800000m"),
        (99_999.999, "99999999m"),
        (99_999.9999, "100000S"),
        (10**6, "1000000S"),
        (0.0000001, "1u"),
        (10**12, "99999999H"),
    ],
)
def test_grpc_timeout_encoding_fits_eight_digits_and_rounds_up(seconds, header):
    assert encode_timeout(seconds) == header


@given(st.text())
def test_grpc_message_percent_encoding_round_trips(message):
    encoded = encode_grpc_message(message)
    assert all(0x20 <= ord(c) < 0x7F for c in encoded)
    assert decode_grpc_message(encoded) == message.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def test_grpc_message_keeps_printable_ascii_and_escapes_percent():
    assert encode_grpc_message("a b:c/%\n") == "a b:c/%25%0A"


_HEADER = st.tuples(
    st.sampled_from([":path", "content-type", "x-data-parallel-rank", "grpc-timeout"]),
    st.sampled_from(["0", "1", "application/grpc", "/vllm.Control/Abort", "200000u"]),
)
# Each step: maybe a new SETTINGS_HEADER_TABLE_SIZE from the peer, then one header block. (hpack 3.0 only
# signals the last of several size changes made between two blocks, so sizes change one at a time.)
_STEP = st.tuples(st.one_of(st.none(), st.sampled_from([64, 256, 4096])), st.lists(_HEADER, min_size=1, max_size=4))


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, min_size=1, max_size=40))
def test_hpack_caches_give_the_same_bytes_and_headers_as_plain_hpack(steps):
    import hpack

    from trio_sidecar.transport._fast import CachingDecoder as _CachingDecoder
    from trio_sidecar.transport._fast import CachingEncoder as _CachingEncoder

    cached_encoder, plain_encoder = _CachingEncoder(), hpack.Encoder()
    cached_decoder, plain_decoder = _CachingDecoder(), hpack.Decoder()
    for size, step in steps:
        if size is not None and size != plain_encoder.header_table_size:
            cached_encoder.header_table_size = plain_encoder.header_table_size = size
        block = cached_encoder.encode(list(step))
        assert block == plain_encoder.encode(list(step))
        decoded = cached_decoder.decode(block)
        assert decoded == plain_decoder.decode(block) == list(step)


def _server_bound_bytes(body_size: int) -> tuple[GrpcProtocol, bytes]:
    server, client = connected_pair(max_message_length=1024)
    client.send_headers(1, REQUEST_HEADERS)
    client.send_data(1, grpc_frame(b"x" * body_size), end_stream=True)
    return server, client.data_to_send()


def _client_bound_bytes(body_size: int, http_status: str, grpc_status: str) -> tuple[GrpcProtocol, bytes]:
    client = GrpcProtocol(GRPCConfiguration(client_side=True, max_message_length=1024))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    client.h2_connection.send_headers(1, REQUEST_HEADERS)
    client.h2_connection.send_data(1, grpc_frame(b"q"), end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", http_status), ("content-type", "application/grpc")])
    server.send_data(1, grpc_frame(b"y" * body_size))
    server.send_headers(1, [("grpc-status", grpc_status)], end_stream=True)
    return client, server.data_to_send()


@settings(max_examples=300, deadline=None)
@given(
    side=st.sampled_from(["server", "client"]),
    body_size=st.integers(0, 2000),
    http_status=st.sampled_from(["200", "503", "x"]),
    grpc_status=st.sampled_from(["0", "5", "abc", ""]),
    corruption=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=4),
)
def test_corrupted_input_fails_the_stream_or_the_connection_never_with_another_exception(
    side, body_size, http_status, grpc_status, corruption
):
    from trio_sidecar.transport._protocol import CONNECTION_ERRORS

    if side == "server":
        protocol, data = _server_bound_bytes(body_size)
    else:
        protocol, data = _client_bound_bytes(body_size, http_status, grpc_status)
    data = bytearray(data)
    for where, value in corruption:
        data[int(where * len(data))] = value
    try:
        events = protocol.receive_data(bytes(data))
    except CONNECTION_ERRORS:
        return
    assert isinstance(events, list)


def test_repeated_grpc_status_in_trailers_fails_only_the_stream():
    client = GrpcProtocol(GRPCConfiguration(client_side=True, max_message_length=1024))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    client.h2_connection.send_headers(1, REQUEST_HEADERS)
    client.h2_connection.send_data(1, grpc_frame(b"q"), end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc")])
    server.send_headers(1, [("grpc-status", "0"), ("grpc-status", "5")], end_stream=True)
    events = client.receive_data(server.data_to_send())
    assert [(type(e), e.stream_id) for e in events][-1] == (StreamFailed, 1)
    assert events[-1].code is StatusCode.UNKNOWN


def test_undecodable_header_bytes_are_a_connection_error():
    from trio_sidecar.transport._protocol import CONNECTION_ERRORS

    server = GrpcProtocol(GRPCConfiguration(client_side=False, max_message_length=1024))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    client.send_headers(1, [(k.encode(), v.encode()) for k, v in REQUEST_HEADERS] + [(b"x-bad", b"\xff\xfe")])
    with pytest.raises(CONNECTION_ERRORS):
        server.receive_data(client.data_to_send())
