"""``H2Connection.open_request_stream`` (the client's HEADERS fast path) against h2's ``send_headers``.

Two client connections in the same state open the same stream, one through each path: the bytes queued,
the connection's and the stream's state, and the decoded headers a server sees must be the same.
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
    (":authority", "127.0.0.1:50051"),
    (":path", "/vllm.Inference/GenerateStream"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]


def client_pair() -> tuple:
    """Two client connections whose handshakes with a server (max 4 streams) completed identically."""
    pair = []
    for _ in range(2):
        client = GrpcProtocol(GRPCConfiguration(client_side=True))
        client.initiate_connection()
        server = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8", validate_inbound_headers=False)
        )
        server.initiate_connection()
        server.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 4})
        server.receive_data(client.h2_connection.data_to_send())
        client.receive_data(server.data_to_send())
        server.receive_data(client.h2_connection.data_to_send())
        pair.append((client.h2_connection, server))
    return pair[0], pair[1]


def stream_state(conn, stream_id: int) -> tuple:
    stream = conn.streams[stream_id]
    return (
        conn.state_machine.state,
        conn.highest_outbound_stream_id,
        conn.open_outbound_streams,
        stream.state_machine.state,
        stream.state_machine.client,
        stream.state_machine.headers_sent,
        stream._authority,
        stream.request_method,
        stream.outbound_flow_control_window,
        stream.inbound_flow_control_window,
        stream.max_outbound_frame_size,
    )


def both_open(headers: list, streams: int = 1) -> None:
    (fast, fast_server), (slow, slow_server) = client_pair()
    for _ in range(streams):
        stream_id = fast.get_next_available_stream_id()
        assert stream_id == slow.get_next_available_stream_id()
        fast.open_request_stream(stream_id, headers)
        slow.send_headers(stream_id, headers)
        sent = fast.data_to_send()
        assert sent == slow.data_to_send()
        assert stream_state(fast, stream_id) == stream_state(slow, stream_id)
        events = fast_server.receive_data(sent)
        assert [(type(e), e.stream_id, e.headers) for e in events] == [
            (type(e), e.stream_id, e.headers) for e in slow_server.receive_data(sent)
        ]
        assert events and events[0].headers == headers


@pytest.mark.parametrize(
    "headers",
    [
        HEAD,
        [*HEAD, ("grpc-timeout", "30000m"), ("x-data-parallel-rank", "3")],
        [*HEAD, ("x-big", "v" * 20_000)],  # larger than a frame (16 KiB): HEADERS + CONTINUATION
        [*HEAD, ("x-huge", "w" * 40_000)],  # HEADERS + two CONTINUATION frames
    ],
    ids=["constant", "metadata", "one continuation", "two continuations"],
)
def test_open_request_stream_matches_send_headers(headers: list) -> None:
    both_open(headers, streams=3)  # later streams reuse the cached encoding


def test_open_request_stream_too_many_streams_is_refused_as_send_headers_does() -> None:
    (fast, _), (slow, _) = client_pair()
    for conn, opener in ((fast, fast.open_request_stream), (slow, slow.send_headers)):
        for _ in range(4):
            opener(conn.get_next_available_stream_id(), HEAD)
        with pytest.raises(h2.exceptions.TooManyStreamsError):
            opener(conn.get_next_available_stream_id(), HEAD)
    assert fast.data_to_send() == slow.data_to_send()


def test_open_request_stream_on_an_existing_stream_uses_send_headers() -> None:
    (fast, _), (slow, _) = client_pair()
    errors = []
    for conn, opener in ((fast, fast.open_request_stream), (slow, slow.send_headers)):
        opener(1, HEAD)
        conn.send_data(1, b"x")
        with pytest.raises(h2.exceptions.ProtocolError) as info:
            opener(1, [("x-trailer", "1")])  # trailers without END_STREAM
        errors.append(str(info.value))
    assert errors == ["Trailers must have END_STREAM set."] * 2
    assert fast.data_to_send() == slow.data_to_send()


_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(_token.map(lambda k: "x-" + k), st.text(min_size=0, max_size=60)), max_size=6),
    st.integers(min_value=1, max_value=3),
)
def test_open_request_stream_property_same_bytes_and_state(metadata: list, streams: int) -> None:
    both_open([*HEAD, *metadata], streams=streams)


# ``H2Connection.send_data``'s fast path against h2's (``h2.connection.H2Connection.send_data``).


def both_send(steps: list) -> None:
    """Run ``steps`` ((stream_id, size, end_stream, pad_length) or ("window", stream_id, n)) on a twin pair."""
    (fast, _), (slow, _) = client_pair()
    for conn in (fast, slow):
        for stream_id in (1, 3):
            conn.send_headers(stream_id, HEAD)
    outcomes = []
    for conn, send in (
        (fast, fast.send_data),
        (slow, lambda *a, **k: h2.connection.H2Connection.send_data(slow, *a, **k)),
    ):
        seen = []
        for step in steps:
            if step[0] == "window":  # shrink the peer's window as a WINDOW_UPDATE would have left it
                _, stream_id, n = step
                conn.streams[stream_id].outbound_flow_control_window = n
                continue
            stream_id, size, end_stream, pad_length = step
            try:
                send(stream_id, b"x" * size, end_stream=end_stream, pad_length=pad_length)
            except Exception as exc:  # noqa: BLE001 - the same error both ways
                seen.append((type(exc).__name__, str(exc)))
            seen.append(
                (
                    conn.data_to_send(),
                    conn.outbound_flow_control_window,
                    conn.state_machine.state,
                    sorted((i, s.state_machine.state, s.outbound_flow_control_window) for i, s in conn.streams.items()),
                )
            )
        outcomes.append(seen)
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    "steps",
    [
        [(1, 10, False, None), (1, 0, True, None)],
        [(1, 10, True, None)],
        [(1, 5, True, None), (1, 5, False, None)],  # after END_STREAM: h2's StreamClosedError
        [(1, 3, False, 2)],  # padding: h2's path
        [(9, 3, False, None)],  # no such stream
        [("window", 1, 4), (1, 5, False, None), (1, 4, False, None), (1, 1, False, None)],  # window
        [(1, 16_385, False, None)],  # larger than a frame
        [(1, 0, False, None), (3, 7, True, None), (1, 2, True, None)],
    ],
)
def test_send_data_matches_h2(steps: list) -> None:
    both_send(steps)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.sampled_from([1, 3, 5]), st.integers(0, 20_000), st.booleans(), st.sampled_from([None, None, 0, 3])
            ),
            st.tuples(st.just("window"), st.sampled_from([1, 3]), st.integers(0, 100)),
        ),
        max_size=8,
    )
)
def test_send_data_property_matches_h2(steps: list) -> None:
    both_send(steps)
