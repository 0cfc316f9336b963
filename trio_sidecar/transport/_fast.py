"""The transport's fast paths, all of them (pure: no I/O, no Trio).

Each is a second version of an h2, hpack or purerpc hot path behind a plain function or class: it does the
job exactly as the library would (the same checks, state changes, events, window accounting and bytes) for
the common case, and otherwise declines (returns ``False``/``None``, having changed nothing) so that the
caller takes the library's path. ``_h2.H2Connection`` and ``_protocol.GrpcProtocol`` call them. What each
buys, and the differential test that compares it with the library's path, is in docs/performance.md#fast-paths:

* ``CachingEncoder``/``CachingDecoder``: HPACK blocks encoded/decoded once per dynamic-table state;
* ``open_request_stream``: a client's new-stream HEADERS framed without hyperframe objects;
* ``try_send_data``: one DATA frame framed without a hyperframe ``DataFrame``;
* ``count_acknowledged``: consumed bytes counted without h2 while no WINDOW_UPDATE is due;
* ``accept_plain_data``: a plain DATA frame's flow-control bookkeeping without h2's frame objects;
* ``plain_headers_frame``: a plain HEADERS frame built without parsing it through h2's frame buffer;
* ``whole_messages``: whole uncompressed gRPC messages cut from a DATA payload without purerpc's buffer.
"""

from __future__ import annotations

import struct
from typing import Any

import h2.connection
import h2.exceptions
import h2.stream
import h2.utilities
import hpack
import hpack.table
from hyperframe.frame import HeadersFrame

__all__ = [
    "CachingDecoder",
    "CachingEncoder",
    "accept_plain_data",
    "count_acknowledged",
    "frame_header",
    "open_request_stream",
    "plain_headers_frame",
    "try_send_data",
    "whole_messages",
]

frame_header = struct.Struct(">BHBBL").pack  # length (24 bits), type, flags, stream id
_unpack_message_prefix = struct.Struct(">BL").unpack_from  # gRPC's message prefix: compressed flag, length
_new_object = object.__new__
_SEND_HEADERS = h2.connection.ConnectionInputs.SEND_HEADERS
_STREAM_SEND_HEADERS = h2.stream.StreamInputs.SEND_HEADERS
_SEND_DATA = h2.connection.ConnectionInputs.SEND_DATA
_STREAM_SEND_DATA = h2.stream.StreamInputs.SEND_DATA
_STREAM_SEND_END_STREAM = h2.stream.StreamInputs.SEND_END_STREAM
_CLIENT_STREAM_IDS = h2.connection.AllowedStreamIDs(True)
_STREAM_OPEN = h2.stream.STREAM_OPEN
_DATA_STREAM_STATES = frozenset({h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL})

# HEADERS flags ``plain_headers_frame`` takes: END_HEADERS (0x4), with or without END_STREAM (0x1); the
# frozen sets stand in for hyperframe's ``Flags`` (h2 only tests membership on a received frame).
_HEADERS_FLAG_SETS = {0x4: frozenset({"END_HEADERS"}), 0x5: frozenset({"END_HEADERS", "END_STREAM"})}
PLAIN_HEADERS_FLAGS = frozenset(_HEADERS_FLAG_SETS)


# -- HPACK (replaces hpack's Encoder.encode / Decoder.decode) --------------------------------------------
#
# Steady-state gRPC header blocks (the request line, ``:status 200``, ``grpc-status 0``) repeat, and while
# the dynamic table is unchanged the same header list always encodes to the same bytes (and the same bytes
# decode to the same list). ``tests/transport/test_transport_protocol.py`` compares them with plain hpack.


class _VersionedTable(hpack.table.HeaderTable):
    """An HPACK header table that counts its mutations (entries added, size changed)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def add(self, name, value):  # type: ignore[no-untyped-def]
        self.version += 1
        super().add(name, value)

    @property
    def maxsize(self):  # type: ignore[no-untyped-def]
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax):  # type: ignore[no-untyped-def]
        self.version += 1
        hpack.table.HeaderTable.maxsize.fset(self, newmax)


_HPACK_CACHE_SIZE = 256


class CachingEncoder(hpack.Encoder):
    """Reuses the encoding of a header list while the dynamic table has not changed since.

    Encoding a list whose every header is already in the table does not touch the table and always gives
    the same bytes, and steady-state gRPC header blocks (request line, ``:status 200``, ``grpc-status 0``)
    are exactly that. About a tenth of a unary call's CPU was spent in pure-Python HPACK encoding.
    """

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _VersionedTable()
        self._cache: dict = {}

    def encode(self, headers, huffman=True):  # type: ignore[no-untyped-def]
        if type(headers) is not list or not huffman:
            return super().encode(headers, huffman)
        key = tuple(headers)
        table = self.header_table
        hit = self._cache.get(key)
        if hit is not None and hit[0] == table.version and not table.resized:
            return hit[1]
        version, resized = table.version, table.resized
        block = super().encode(headers, huffman)
        if table.version == version and not resized:  # (a resize is signalled inside the block)
            if len(self._cache) >= _HPACK_CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = (version, block)
        return block


class CachingDecoder(hpack.Decoder):
    """Reuses the decoding of a header block while the dynamic table has not changed since (see above)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.header_table = _VersionedTable()
        self._cache: dict = {}

    def decode(self, data, raw=False):  # type: ignore[no-untyped-def]
        key = (bytes(data), raw)
        table = self.header_table
        hit = self._cache.get(key)
        if hit is not None and hit[0] == table.version:
            return list(hit[1])
        version = table.version
        headers = super().decode(data, raw)
        if table.version == version:
            if len(self._cache) >= _HPACK_CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = (version, tuple(headers))
        return headers


# -- sending (replaces h2's send_headers / send_data for the common frames) ----------------------------


def open_request_stream(h2conn: Any, stream_id: int, headers: list) -> bool:
    """``h2conn.send_headers(stream_id, headers)`` for a client's new stream (no END_STREAM, no priority).

    The same checks, state transitions and bytes as h2's ``send_headers``, without building hyperframe
    objects and validation flags that ``validate_outbound_headers=False`` then ignores: the header block
    (usually a cached encoding, ``CachingEncoder``) is framed here. False, nothing done, for a server or a
    known stream. ``tests/transport/test_open_request_stream.py`` compares the two.
    """
    if not h2conn.config.client_side or stream_id in h2conn.streams:
        return False
    if h2conn.open_outbound_streams + 1 > h2conn.remote_settings.max_concurrent_streams:
        raise h2.exceptions.TooManyStreamsError(
            f"Max outbound streams is {h2conn.remote_settings.max_concurrent_streams}, "
            f"{h2conn.open_outbound_streams} open"
        )
    h2conn.state_machine.process_input(_SEND_HEADERS)
    stream = h2conn._get_or_create_stream(stream_id, _CLIENT_STREAM_IDS)
    stream.state_machine.process_input(_STREAM_SEND_HEADERS)
    block = h2conn.encoder.encode(headers)
    size = h2conn.max_outbound_frame_size
    if len(block) <= size:
        h2conn._data_to_send += frame_header(len(block) >> 16, len(block) & 0xFFFF, 0x1, 0x4, stream_id) + block
    else:  # HEADERS, then CONTINUATION frames; END_HEADERS on the last
        chunks = [block[i : i + size] for i in range(0, len(block), size)]
        out = [frame_header(len(chunks[0]) >> 16, len(chunks[0]) & 0xFFFF, 0x1, 0, stream_id), chunks[0]]
        for n, chunk in enumerate(chunks[1:], 2):
            flags = 0x4 if n == len(chunks) else 0
            out += [frame_header(len(chunk) >> 16, len(chunk) & 0xFFFF, 0x9, flags, stream_id), chunk]
        h2conn._data_to_send += b"".join(out)
    if stream._authority is None:
        stream._authority = h2.utilities.authority_from_headers(headers)
    stream.request_method = h2.utilities.extract_method_header(headers)
    return True


def try_send_data(h2conn: Any, stream_id: int, data: bytes, end_stream: bool) -> bool:
    """``h2conn.send_data(stream_id, data, end_stream)`` as one DATA frame built here, if the stream is known
    and ``data`` fits both windows and one frame; False (nothing done) otherwise. Raises as h2 for a
    closed stream. ``tests/transport/test_open_request_stream.py`` compares it with h2's ``send_data``."""
    stream = h2conn.streams.get(stream_id)
    size = len(data)
    if (
        stream is None
        or size > h2conn.outbound_flow_control_window
        or size > stream.outbound_flow_control_window
        or size > h2conn.max_outbound_frame_size
    ):
        return False
    h2conn.state_machine.process_input(_SEND_DATA)
    machine = stream.state_machine
    machine.process_input(_STREAM_SEND_DATA)
    if end_stream:
        machine.process_input(_STREAM_SEND_END_STREAM)
    stream.outbound_flow_control_window -= size
    h2conn._data_to_send += frame_header(size >> 16, size & 0xFFFF, 0x0, 0x1 if end_stream else 0, stream_id) + data
    h2conn.outbound_flow_control_window -= size
    return True


# -- receiving (replaces h2's frame buffer and acknowledge_received_data, purerpc's read buffer) ---------


def count_acknowledged(h2conn: Any, stream_id: int, length: int) -> bool:
    """``h2conn.acknowledge_received_data(length, stream_id)`` while it would only count: True when the
    bytes were counted here; False (nothing done) when a WINDOW_UPDATE may be due (half a window processed,
    or an empty window): then h2 does it all. ``tests/transport/test_transport_fastpath.py`` compares the two.
    """
    connection_window = h2conn._inbound_flow_control_window_manager
    processed = connection_window._bytes_processed + length
    if not connection_window.current_window_size or processed >= connection_window.max_window_size // 2:
        return False
    stream = h2conn.streams.get(stream_id)
    if stream is None:
        if stream_id <= (
            h2conn.highest_outbound_stream_id
            if h2conn._stream_id_is_outbound(stream_id)
            else h2conn.highest_inbound_stream_id
        ):
            # A closed stream h2 already forgot (its last messages often come with the trailers): h2 would
            # only count the connection window.
            connection_window._bytes_processed = processed
            return True
        return False
    if not _STREAM_OPEN[stream.state_machine.state]:
        connection_window._bytes_processed = processed  # (h2 ignores a closed stream's window)
        return True
    stream_window = stream._inbound_window_manager
    if (
        stream_window.current_window_size
        and stream_window._bytes_processed + length < stream_window.max_window_size // 2
    ):
        connection_window._bytes_processed = processed
        stream_window._bytes_processed += length
        return True
    return False


def accept_plain_data(h2conn: Any, stream_id: int, length: int) -> bool:
    """A complete DATA frame without flags (no padding, no END_STREAM) of ``stream_id``: h2's flow-control
    and content-length bookkeeping for it, done here, if the stream is open for DATA, has no declared
    content length and the frame fits both windows; False (nothing done) otherwise: the frame then goes to
    h2. ``tests/transport/test_transport_fastpath.py`` compares the two."""
    stream = h2conn.streams.get(stream_id)
    if (
        stream is None
        or stream.state_machine.state not in _DATA_STREAM_STATES
        or stream._expected_content_length is not None
    ):
        return False
    connection_window = h2conn._inbound_flow_control_window_manager
    stream_window = stream._inbound_window_manager
    if length > connection_window.current_window_size or length > stream_window.current_window_size:
        return False
    connection_window.current_window_size -= length
    stream_window.current_window_size -= length
    stream._actual_content_length += length
    return True


def plain_headers_frame(stream_id: int, flags: int, block: bytes) -> HeadersFrame:
    """The hyperframe ``HeadersFrame`` h2's frame buffer would parse from one complete HEADERS frame without
    padding or priority (``flags`` in ``PLAIN_HEADERS_FLAGS``): the fields h2 reads, set directly.
    ``tests/transport/test_plain_headers.py`` compares the path through it with h2's."""
    frame = _new_object(HeadersFrame)
    frame.stream_id = stream_id
    frame.flags = _HEADERS_FLAG_SETS[flags]
    frame.body_len = len(block)
    frame.data = block
    frame.pad_length = 0
    frame.depends_on = 0
    frame.stream_weight = 0
    frame.exclusive = False
    return frame


def whole_messages(data: bytes, limit: int) -> list[tuple[bytes, int]] | None:
    """The gRPC messages of a DATA payload that is whole uncompressed messages within ``limit`` (the usual
    case), as ``(message, flow-controlled length)``; None for anything else (a partial message, a
    compressed or oversize one): the payload then goes through purerpc's read buffer, whole.
    ``tests/transport/test_transport_fastpath.py`` compares the two."""
    total = len(data)
    position = 0
    out = []
    while total - position >= 5:
        compressed, length = _unpack_message_prefix(data, position)
        end = position + 5 + length
        if compressed or length > limit or end > total:
            return None
        out.append((data[position + 5 : end], 5 + length))
        position = end
    return out if position == total else None
