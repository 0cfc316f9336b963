"""``GrpcProtocol._receive_plain_headers`` (HEADERS frames without h2's frame buffer) against h2's path.

Two client connections in the same state receive the same bytes, one with the fast path and one without
(``fast_headers = False``): the events, the frames queued in reply, the streams' states and the errors must
be the same, frame sequence by frame sequence.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.exceptions
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from purerpc.grpclib.config import GRPCConfiguration

from trio_sidecar.transport._protocol import GrpcProtocol

HEAD = [
    (":method", "POST"),
    (":scheme", "http"),
    (":authority", "a"),
    (":path", "/s/M"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]
RESPONSE = [(":status", "200"), ("content-type", "application/grpc")]
TRAILERS = [("grpc-status", "0")]
MESSAGE = b"\x00\x00\x00\x00\x02hi"


def event_view(event: object) -> tuple:
    fields = getattr(event, "__dict__", None) or {
        name: getattr(event, name) for name in getattr(type(event), "__slots__", ()) if hasattr(event, name)
    }
    return type(event).__name__, sorted((k, repr(v)) for k, v in fields.items())


def connected(fast: bool) -> tuple[GrpcProtocol, h2.connection.H2Connection]:
    client = GrpcProtocol(GRPCConfiguration(client_side=True))
    client.fast_headers = fast
    client.initiate_connection()
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding="utf-8", validate_inbound_headers=False)
    )
    server.initiate_connection()
    server.receive_data(client.h2_connection.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.h2_connection.data_to_send())
    for stream_id in (1, 3, 5, 7):
        client.h2_connection.send_headers(stream_id, HEAD)
        client.h2_connection.send_data(stream_id, MESSAGE, end_stream=True)
    server.receive_data(client.h2_connection.data_to_send())
    return client, server


# Server-side actions; each returns the bytes the server queued.
def headers(stream_id: int, end_stream: bool = False, block: list | None = None):
    def act(server: h2.connection.H2Connection) -> bytes:
        server.send_headers(stream_id, block or RESPONSE, end_stream=end_stream)
        return server.data_to_send()

    return act


def data(stream_id: int):
    def act(server: h2.connection.H2Connection) -> bytes:
        server.send_data(stream_id, MESSAGE)
        return server.data_to_send()

    return act


def raw(frame: bytes):
    return lambda server: frame


def run(client: GrpcProtocol, server: h2.connection.H2Connection, script: list) -> list:
    seen = []
    for act in script:
        try:
            payload = act(server)
        except h2.exceptions.H2Error as exc:  # the scripted server refused: skip the step
            seen.append(("server refused", type(exc).__name__))
            continue
        try:
            events = client.receive_data(payload)
        except h2.exceptions.H2Error as exc:
            seen.append(("error", type(exc).__name__, str(exc), client.h2_connection.data_to_send()))
            break
        seen.append(([event_view(e) for e in events], client.h2_connection.data_to_send()))
        seen.append(sorted((i, s.state_machine.state) for i, s in client.h2_connection.streams.items()))
    return seen


def both(script_factory) -> None:
    results = []
    for fast in (True, False):
        client, server = connected(fast)
        results.append(run(client, server, script_factory()))
    assert results[0] == results[1]


SCRIPTS = {
    "response, data, trailers": lambda: [headers(1), data(1), headers(1, True, TRAILERS)],
    "trailers-only": lambda: [headers(3, True, [*RESPONSE, ("grpc-status", "5"), ("grpc-message", "no")])],
    "interleaved streams": lambda: [
        headers(1),
        headers(3),
        data(3),
        data(1),
        headers(3, True, TRAILERS),
        headers(1, True, TRAILERS),
    ],
    "http status 503": lambda: [headers(5, True, [(":status", "503")])],
    "missing status": lambda: [headers(5, False, [("content-type", "application/grpc")])],
    "several frames in one read": lambda: [
        lambda server: b"".join(act(server) for act in (headers(1), data(1), headers(1, True, TRAILERS)))
    ],
    # HEADERS on a stream the client never opened: h2's connection error, GOAWAY queued.
    "unknown stream": lambda: [raw(b"\x00\x00\x01\x01\x05\x00\x00\x00\x09\x88")],
    # HEADERS after the stream ended: STREAM_CLOSED connection error.
    "after the end": lambda: [
        headers(7, True, [*RESPONSE, ("grpc-status", "0")]),
        raw(b"\x00\x00\x01\x01\x05\x00\x00\x00\x07\x88"),
    ],
    # PRIORITY / PADDED flags: h2's path in both.
    "priority flag": lambda: [raw(b"\x00\x00\x06\x01\x24\x00\x00\x00\x01\x00\x00\x00\x00\x0f\x88")],
    "padded": lambda: [raw(b"\x00\x00\x03\x01\x0c\x00\x00\x00\x01\x01\x88\x00")],
    # no END_HEADERS: CONTINUATION follows (h2's path).
    "continuation": lambda: [raw(b"\x00\x00\x01\x01\x00\x00\x00\x00\x01\x88\x00\x00\x00\x09\x04\x00\x00\x00\x01")],
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_plain_headers_same_as_h2(name: str) -> None:
    both(SCRIPTS[name])


def test_plain_headers_after_a_reset_by_the_client() -> None:
    results = []
    for fast in (True, False):
        client, server = connected(fast)
        client.reset_stream(1)
        results.append(run(client, server, [headers(1), headers(3)]))
    assert results[0] == results[1]


_steps = st.lists(
    st.one_of(
        st.builds(lambda i: headers(i), st.sampled_from([1, 3, 5, 7])),
        st.builds(lambda i: headers(i, True, TRAILERS), st.sampled_from([1, 3, 5, 7])),
        st.builds(data, st.sampled_from([1, 3, 5, 7])),
    ),
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(_steps)
def test_plain_headers_property_same_as_h2(steps: list) -> None:
    both(lambda: steps)


def test_plain_headers_fast_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = GrpcProtocol._receive_plain_headers

    def spy(self, stream_id, flags, block):  # type: ignore[no-untyped-def]
        calls.append((stream_id, flags))
        return original(self, stream_id, flags, block)

    monkeypatch.setattr(GrpcProtocol, "_receive_plain_headers", spy)
    client, server = connected(True)
    run(client, server, SCRIPTS["response, data, trailers"]())
    assert calls == [(1, 0x4), (1, 0x5)]
