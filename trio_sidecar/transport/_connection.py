"""One HTTP/2 connection on a Trio socket stream: the reader, the writer, and per-stream calls.

Shared by the client (``_client``) and the server (``_server``); see the theory of operation in
``trio_sidecar/transport/__init__.py``.
"""

from __future__ import annotations

import base64
import logging
import math
import os
from collections import deque
from collections.abc import Iterable
from typing import Any

import trio
from google.protobuf.message import DecodeError
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from trio_sidecar.core.config import KeepaliveConfig
from trio_sidecar.core.status import StatusCode

from ._errors import ConnectionLostError, RpcError
from ._events import StreamClosed
from ._keepalive import run_keepalive
from ._protocol import CONNECTION_ERRORS, ErrorCodes, GrpcProtocol

LOGGER = logging.getLogger("trio_sidecar.transport.connection")

# Below glibc's 128 KiB mmap threshold: CPython allocates the whole buffer for every recv(), and a
# 256 KiB buffer made each read ~17 µs slower (an mmap/munmap pair), several times per unary call.
RECEIVE_SIZE = 64 * 1024
# A sender parks until the writer has flushed once this much is queued, so a fast producer batches its
# writes without ever holding more than this much outbound data per connection.
WRITE_HIGH_WATER = 64 * 1024
# ... and yields to the scheduler at least every this many messages (cancellation and fairness).
YIELD_EVERY = 32
# Output that reading the peer's frames queued (PING and SETTINGS acks, RST_STREAM, rejections) and that
# is still unsent. A peer that floods control frames without reading the answers trips it: GOAWAY
# ENHANCE_YOUR_CALM and close, so its unread acks cannot grow our memory (about 15,000 PING acks).
CONTROL_BACKLOG_LIMIT = 256 * 1024


def parse_message(message_type: Any, data: bytes, what: str) -> Any:
    """``message_type.FromString(data)``; bytes that do not parse raise ``RpcError`` INTERNAL
    ``failed to parse {what}`` (the one place the transport parses a protobuf message)."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise RpcError(StatusCode.INTERNAL, f"failed to parse {what}") from None


def encode_metadata(metadata: Iterable[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Lower-case keys; base64 for ``-bin`` keys; reserved keys are a programming error (ValueError)."""
    encoded = []
    for key, value in metadata:
        key = key.lower()
        if key.startswith((":", "grpc-")) or key in ("te", "content-type", "user-agent"):
            raise ValueError(f"reserved metadata key {key!r}")
        if key.endswith("-bin"):
            value = base64.b64encode(value).rstrip(b"=").decode("ascii")
        encoded.append((key, value))
    return encoded


def deadline_after(timeout: float | None) -> float:
    """Absolute Trio deadline for a call timeout (``inf`` for none)."""
    if timeout is None:
        return math.inf
    return trio.current_time() + timeout


class Call:
    """State of one HTTP/2 stream carrying a call, shared by the reader task and the call's owner task.

    Only the owner task ever parks on a call (``wait``); the reader and the writer ``wake`` it. Every wait
    sits in a loop that re-checks the call's state, so spurious wake-ups are harmless.
    """

    __slots__ = ("_task", "conn", "done", "error", "messages", "stream_id")

    def __init__(self, conn: Connection, stream_id: int) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.messages: deque = deque()  # purerpc MessageReceived events, not yet acknowledged
        self.error: RpcError | None = None
        self.done = False
        self._task: trio.lowlevel.Task | None = None

    def wake(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            reschedule(task)

    async def wait(self) -> None:
        self._task = current_task()

        def abort(raise_cancel):  # type: ignore[no-untyped-def]
            self._task = None
            return Abort.SUCCEEDED

        await wait_task_rescheduled(abort)

    def peer_ended(self) -> bool:
        """The peer has answered in full: whatever we still meant to send is moot."""
        return False

    def fail(self, error: RpcError) -> None:
        """The stream is gone (connection lost, reset by the peer): remember why and wake the owner."""
        if self.error is None:
            self.error = error
        self.wake()

    def release_messages(self) -> None:
        """Hand unconsumed messages back to the connection's flow-control window."""
        if self.messages:
            total = sum(event.flow_controlled_length for event in self.messages)
            self.messages.clear()
            self.conn.acknowledge(self.stream_id, total)


class Connection:
    """Reader + writer for one socket; subclasses dispatch the protocol events (``handle_events``)."""

    def __init__(self, stream: trio.SocketStream, protocol: GrpcProtocol, description: str) -> None:
        self.stream = stream
        self.protocol = protocol
        self.description = description
        self.calls: dict[int, Call] = {}
        self.lost: str | None = None  # why the connection is unusable; set once
        self.closing = False
        self.window_waiters: set[Call] = set()
        self.nursery: trio.Nursery | None = None
        self._writer: trio.lowlevel.Task | None = None  # the writer task while it is parked
        self._drain_waiters: list = []
        self._burst = 0  # messages queued since the last yield
        self._pending = b""  # bytes a direct write (flush) could not send; the writer sends them first
        self._backlog = 0  # at most this much unsent output was queued by reading (CONTROL_BACKLOG_LIMIT)
        self._writing = False  # the writer is inside send_all
        self._fileno = stream.socket.fileno()
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        #: Client keepalive (``_keepalive.run_keepalive``), or None; ``keepalive_time`` is its current time
        #: (doubled when the server sends GOAWAY ``too_many_pings``).
        self.keepalive: KeepaliveConfig | None = None
        self.keepalive_time: float | None = None
        self.last_read = -math.inf  # trio.current_time() of the last bytes read from the socket
        self.keepalive_waiter: trio.lowlevel.Task | None = None  # the keepalive task, waiting for a call

    # -- writing -------------------------------------------------------------------------------------

    def kick(self) -> None:
        """Wake the writer (it sends whatever h2 has queued)."""
        task = self._writer
        if task is not None:
            self._writer = None
            reschedule(task)

    def flush(self) -> None:
        """Write queued frames now, from the calling task, if the writer is idle; else leave them to it.

        Saves a task switch on the latency-critical path (a unary request, a handler's final status, the
        frames a read produced). Only a non-blocking ``os.write`` is attempted, so a cancelled caller can
        never leave a partial frame; whatever the kernel does not take goes to the writer, first in line.
        """
        if self._writer is None:
            return  # the writer is mid-send or already woken: it sends everything queued
        data = self.protocol.data_to_send()
        if not data:
            return
        try:
            sent = os.write(self._fileno, data)
        except OSError:  # BlockingIOError, or a dead socket the writer will report
            sent = 0
        if sent < len(data):
            self._pending = data[sent:]
            self.kick()

    def acknowledge(self, stream_id: int, length: int) -> None:
        """The application consumed ``length`` flow-controlled bytes of a stream (``GrpcProtocol.acknowledge``);
        wakes the writer if that queued a WINDOW_UPDATE (or anything else is queued)."""
        if length and self.lost is None and self.protocol.acknowledge(stream_id, length):
            self.kick()

    async def _write_loop(self) -> None:
        protocol = self.protocol
        send_all = self.stream.send_all
        try:
            while True:
                data = self._pending
                if data:
                    self._pending = b""
                else:
                    data = protocol.data_to_send()
                if data:
                    self._writing = True
                    await send_all(data)
                    self._writing = False
                    if self._backlog:
                        self._backlog = min(self._backlog, protocol.output_size() + len(self._pending))
                    if self._drain_waiters:
                        self._wake_drain_waiters()
                elif self.closing:
                    self.lose("channel closed")
                    return
                else:
                    self._writer = current_task()

                    def abort(raise_cancel):  # type: ignore[no-untyped-def]
                        self._writer = None
                        return Abort.SUCCEEDED

                    await wait_task_rescheduled(abort)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._lose_io(exc)

    def _wake_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for task in waiters:
            reschedule(task)

    async def wait_drained(self) -> None:
        """Park until the writer has flushed the queued data (or the connection is lost)."""
        if self.lost is not None:
            return
        self.kick()
        task = current_task()
        self._drain_waiters.append(task)

        def abort(raise_cancel):  # type: ignore[no-untyped-def]
            try:
                self._drain_waiters.remove(task)
            except ValueError:
                pass
            return Abort.SUCCEEDED

        await wait_task_rescheduled(abort)

    async def send_message(self, call: Call, payload: bytes, end_stream: bool, flush: bool = False) -> None:
        """Queue one framed message on ``call``'s stream, respecting HTTP/2 flow control.

        Returns once the message is queued for the writer; parks while the peer's window is closed or too
        much is queued. Raises the call's error if the stream or the connection fails meanwhile.
        """
        if self.lost is not None:
            # Also keeps a producer that never awaits from spinning on a dead connection.
            raise ConnectionLostError(self.lost)
        stream_id = call.stream_id
        total = len(payload)
        try:
            await self._send(call, self.protocol, stream_id, payload, total, end_stream, flush)
        except StreamClosed:
            if call.peer_ended():
                return
            raise RpcError(StatusCode.CANCELLED, "stream closed by the peer") from None

    async def _send(
        self,
        call: Call,
        protocol: GrpcProtocol,
        stream_id: int,
        payload: bytes,
        total: int,
        end_stream: bool,
        flush: bool,
    ) -> None:
        if call.error is None and protocol.send_message(stream_id, payload, end_stream):
            # Fast path: the whole message fitted the window and one frame. No checkpoint per message
            # (batching is what makes streaming fast), but at most YIELD_EVERY messages or
            # WRITE_HIGH_WATER bytes before the writer and the reader get to run.
            if flush:
                self.flush()
            else:
                self.kick()
            self._burst += 1
            queued = protocol.output_size()
            if self._burst >= YIELD_EVERY or queued >= WRITE_HIGH_WATER:
                self._burst = 0
                if queued >= WRITE_HIGH_WATER:
                    await self.wait_drained()
                else:
                    await trio.lowlevel.checkpoint()
                self._raise_if_failed(call)
            return
        position = 0
        while True:
            self._raise_if_failed(call)
            if call.peer_ended():
                return
            try:
                window = protocol.send_window(stream_id)
            except StreamClosed:
                # The peer closed the stream; its RST_STREAM event will (or did) fail the call.
                raise RpcError(StatusCode.CANCELLED, "stream closed by the peer") from None
            frame_size = protocol.max_outbound_frame_size
            while window > 0 and position < total:
                size = min(window, frame_size, total - position)
                last = position + size >= total
                protocol.send_data(stream_id, payload[position : position + size], end_stream and last)
                position += size
                window -= size
            if position >= total:
                if total == 0 and end_stream:
                    protocol.send_data(stream_id, b"", True)
                self.kick()
                if protocol.output_size() >= WRITE_HIGH_WATER:
                    await self.wait_drained()
                    self._raise_if_failed(call)
                return
            self.kick()
            self.window_waiters.add(call)
            try:
                await call.wait()
            finally:
                self.window_waiters.discard(call)

    def _raise_if_failed(self, call: Call) -> None:
        if call.error is not None:
            raise _copy_error(call.error)

    def wake_window_waiters(self, stream_id: int) -> None:
        if stream_id == 0:
            waiters = list(self.window_waiters)
            for call in waiters:
                call.wake()
        else:
            waiting = self.calls.get(stream_id)
            if waiting is not None and waiting in self.window_waiters:
                waiting.wake()

    # -- reading -------------------------------------------------------------------------------------

    def handle_events(self, events: list) -> None:
        raise NotImplementedError

    async def _read_loop(self) -> None:
        """Read the socket until it closes or fails, handing the bytes to the protocol.

        Reads with ``os.read`` on the non-blocking descriptor and waits with ``wait_readable`` itself:
        ``SocketStream.receive_some`` costs several Python frames per call and, in a loop, one read that
        fails with EAGAIN per wake-up. A read shorter than the buffer almost always drained the socket, so
        the next step is to wait (readiness is level-triggered: data that came meanwhile is reported at once).
        """
        fd = self._fileno
        read = os.read
        wait_readable = trio.lowlevel.wait_readable
        protocol = self.protocol
        receive_data = protocol.receive_data
        output_size = protocol.output_size
        current_time = trio.current_time
        while True:
            try:
                data = read(fd, RECEIVE_SIZE)
            except BlockingIOError:
                try:
                    await wait_readable(fd)
                except trio.ClosedResourceError as exc:
                    self._lose_io(exc)
                    return
                continue
            except OSError as exc:
                self._lose_io(exc)
                return
            if not data:
                self.lose(f"connection to {self.description} closed by the peer")
                return
            self.last_read = current_time()
            queued = output_size()
            try:
                events = receive_data(data)
            except CONNECTION_ERRORS as exc:
                self._flush_final()  # the GOAWAY h2 queued (e.g. FRAME_SIZE_ERROR)
                self.lose(f"HTTP/2 protocol error on the connection to {self.description}: {exc}")
                return
            if events:
                self.handle_events(events)
            unsent = output_size()
            if unsent:
                if unsent > queued and self._over_backlog(unsent - queued):
                    return
                self.flush()
            try:
                if len(data) < RECEIVE_SIZE:
                    await wait_readable(fd)  # (a checkpoint)
                else:
                    await trio.lowlevel.checkpoint()  # more may be waiting: read it after the others ran
            except trio.ClosedResourceError as exc:
                self._lose_io(exc)
                return

    def _over_backlog(self, added: int) -> bool:
        """Count output a read queued; past CONTROL_BACKLOG_LIMIT unsent, GOAWAY ENHANCE_YOUR_CALM and lose.

        The count never exceeds what is still unsent (the writer's progress shrinks it), so a peer that
        reads its acks, however many it provokes, never trips it.
        """
        unsent = self.protocol.output_size() + len(self._pending)
        backlog = min(self._backlog + added, unsent)
        self._backlog = backlog
        if backlog <= CONTROL_BACKLOG_LIMIT:
            return False
        LOGGER.warning(
            "transport: %s does not read the answers to its control frames (%d bytes unsent); closing the "
            "connection with ENHANCE_YOUR_CALM",
            self.description,
            unsent,
        )
        self.protocol.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
        self._flush_final()
        self.lose(f"connection to {self.description} closed: ENHANCE_YOUR_CALM (unread control frames)")
        return True

    def _flush_final(self) -> None:
        """Before losing the connection: one non-blocking write of what is queued (a GOAWAY), unless the
        writer is mid-send (a frame it started must not be interleaved). Best effort."""
        if self._writing:
            return
        data = self._pending + self.protocol.data_to_send()
        self._pending = b""
        if data:
            try:
                os.write(self._fileno, data)
            except OSError:
                pass

    def _lose_io(self, exc: BaseException) -> None:
        """The socket failed (or was closed under a reader or the writer)."""
        self.lose(f"connection to {self.description} lost: {exc or type(exc).__name__}")

    # -- keepalive (client) --------------------------------------------------------------------------

    def call_started(self) -> None:
        """A call was opened: wakes the keepalive task if it is waiting for one (an idle connection)."""
        task = self.keepalive_waiter
        if task is not None:
            self.keepalive_waiter = None
            reschedule(task)

    # -- lifetime ------------------------------------------------------------------------------------

    def lose(self, reason: str) -> None:
        """Mark the connection dead: fail every open call at once and stop the reader and the writer."""
        if self.lost is not None:
            return
        self.lost = reason
        calls = list(self.calls.values())
        self.calls.clear()
        for call in calls:
            self.connection_lost(call, reason)
        self._wake_drain_waiters()
        self._scope.cancel()

    def connection_lost(self, call: Call, reason: str) -> None:
        call.fail(ConnectionLostError(reason))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the reader and the writer until the connection is lost or closed; closes the socket.

        Never raises except ``Cancelled``: failures become ``lost`` and fail the open calls.
        """
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    nursery.start_soon(self._write_loop)
                    if self.keepalive_time is not None:
                        nursery.start_soon(run_keepalive, self)
                    task_status.started()
                    try:
                        await self._read_loop()
                    except Exception as exc:  # a bug here must not take the owner's nursery down
                        LOGGER.exception("transport: unexpected error on %s", self.description)
                        self.lose(f"internal transport error on the connection to {self.description}: {exc!r}")
        finally:
            self.lose(f"connection to {self.description} closed")
            self.stream.socket.close()
            self._done.set()

    async def aclose(self, *, grace: float = 0.5) -> None:
        """Send GOAWAY, let the writer flush for up to ``grace`` seconds, then close the socket."""
        if self.lost is None and not self.closing:
            self.closing = True
            self.protocol.close_connection()
            self.kick()
            with trio.move_on_after(grace) as scope:
                scope.shield = True
                await self._done.wait()
        self.lose("channel closed")
        with trio.CancelScope(shield=True):
            await self._done.wait()


def _copy_error(error: RpcError) -> RpcError:
    """A fresh exception per raise (a shared instance would accumulate tracebacks across tasks)."""
    if isinstance(error, ConnectionLostError):
        return type(error)(error.message)
    return RpcError(error.code, error.message, error.trailing_metadata)
