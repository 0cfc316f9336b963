"""Hostile HTTP/2 peers on raw sockets (h2 3.2.0 as the frame builder and parser), and process memory.

Every peer connects to 127.0.0.1 only; every socket is closed by the helper that opened it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import h2.config
import h2.connection
import h2.events
import h2.settings
import psutil
import trio

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and error codes (RFC 9113).
DATA, HEADERS, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x4, 0x6, 0x7
FRAME_SIZE_ERROR = 0x6
ENHANCE_YOUR_CALM = 0xB


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def frame_header(kind: int, length: int, stream_id: int = 0) -> bytes:
    """A frame header declaring ``length`` payload bytes (none follow)."""
    return struct.pack(">I", length)[1:] + bytes([kind, 0]) + struct.pack(">I", stream_id)


EMPTY_SETTINGS = frame(SETTINGS, 0, 0)
SETTINGS_ACK = frame(SETTINGS, 0x1, 0)
PING_FRAME = frame(PING, 0, 0, b"\x00" * 8)


def parse_frames(data: bytes) -> tuple[list[tuple[int, int, int, bytes]], bytes]:
    """Complete frames ``(type, flags, stream_id, payload)`` in ``data``, and the incomplete rest."""
    frames = []
    position = 0
    while len(data) - position >= 9:
        length = int.from_bytes(data[position : position + 3], "big")
        if len(data) - position - 9 < length:
            break
        kind, flags = data[position + 3], data[position + 4]
        stream_id = int.from_bytes(data[position + 5 : position + 9], "big") & 0x7FFFFFFF
        frames.append((kind, flags, stream_id, data[position + 9 : position + 9 + length]))
        position += 9 + length
    return frames, data[position:]


async def raw_connect(port: int, *, receive_buffer: int | None = None) -> trio.SocketStream:
    """A TCP connection to 127.0.0.1:port; ``receive_buffer`` shrinks SO_RCVBUF before connecting."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def read_until_closed(stream: trio.SocketStream) -> list[tuple[int, int, int, bytes]]:
    """Every frame the server sends until it closes the connection (EOF or reset)."""
    data = b""
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except (trio.BrokenResourceError, OSError):
            chunk = b""
        if not chunk:
            frames, _ = parse_frames(data)
            return frames
        data += chunk


def goaway_codes(frames: Sequence[tuple[int, int, int, bytes]]) -> list[int]:
    return [int.from_bytes(payload[4:8], "big") for kind, _, _, payload in frames if kind == GOAWAY]


class H2Peer:
    """An h2 client on a raw socket: sends what the test asks, reads events only when told to."""

    def __init__(self, stream: trio.SocketStream, *, window: int | None = None) -> None:
        self.stream = stream
        settings = {} if window is None else {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        self.window = window
        self.events: list = []
        self.closed = False

    @classmethod
    async def connect(cls, port: int, *, window: int | None = None, receive_buffer: int | None = None) -> H2Peer:
        peer = cls(await raw_connect(port, receive_buffer=receive_buffer), window=window)
        peer.h2.initiate_connection()
        if window is not None and window > 65535:
            peer.h2.increment_flow_control_window(window - 65535)
        await peer.flush()
        return peer

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def handshake(self) -> None:
        """Wait for the server's SETTINGS."""
        await self.wait_for(lambda: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in self.events))

    async def read_once(self) -> bool:
        """Read one chunk and feed it to h2; False at EOF or reset."""
        try:
            data = await self.stream.receive_some(65536)
        except (trio.BrokenResourceError, OSError):
            data = b""
        if not data:
            self.closed = True
            return False
        self.events.extend(self.h2.receive_data(data))
        await self.flush()
        return True

    async def wait_for(self, predicate) -> None:  # type: ignore[no-untyped-def]
        while not predicate():
            if not await self.read_once():
                raise AssertionError(f"connection closed; events so far: {self.events[-5:]}")

    def open_call(self, path: str, message: bytes, *, encoding: str | None = None, end: bool = True) -> int:
        """Send a gRPC request (headers + one framed message, already compressed if ``encoding``)."""
        stream_id = self.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "127.0.0.1"),
            ("te", "trailers"),
            ("content-type", "application/grpc"),
        ]
        if encoding is not None:
            headers.append(("grpc-encoding", encoding))
        self.h2.send_headers(stream_id, headers)
        flag = 0 if encoding is None else 1
        payload = struct.pack(">BI", flag, len(message)) + message
        position = 0
        frame_size = self.h2.max_outbound_frame_size
        while position < len(payload):
            size = min(frame_size, len(payload) - position)
            last = position + size >= len(payload)
            self.h2.send_data(stream_id, payload[position : position + size], end_stream=end and last)
            position += size
        return stream_id

    def status_of(self, stream_id: int) -> str | None:
        """The stream's grpc-status from its trailers (or a trailers-only response), if received."""
        for event in self.events:
            if (
                isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived))
                and event.stream_id == stream_id
            ):
                for name, value in event.headers:
                    if name == "grpc-status":
                        return value
        return None

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        return next((e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)), None)

    async def aclose(self) -> None:
        await self.stream.aclose()


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss
