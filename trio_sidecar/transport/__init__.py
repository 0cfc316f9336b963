"""gRPC over HTTP/2 on Trio, on purerpc 0.8.0's sans-IO core.

Theory of operation
===================

purerpc's protocol core (``purerpc.grpclib``: ``GRPCConnection`` over h2, message framing, status and
header parsing) is sound; its anyio I/O layer is not safe for a long-lived process (docs/reference/transport.md#why-not-purerpcs-own-io-layer).
This package keeps the core and replaces the I/O layer with a small Trio one.

Layers:

* ``_protocol`` (pure): ``GrpcProtocol``, a ``GRPCConnection`` subclass that turns every per-stream failure
  (RST_STREAM from the peer, an oversize message, malformed headers) into an event for that stream instead
  of an exception that kills the connection. It is built from: ``_events`` (the events it reports and the
  exceptions of its surface), ``_h2`` (``H2Connection``: h2 3.2.0 with gRPC's GOAWAY semantics, the
  WINDOW_UPDATE-after-close race handled inside h2's own frame handling,
  docs/reference/transport.md#the-h2-320-window_update-race), ``_fast`` (every fast path of the layer: HPACK
  caches, HEADERS/DATA framing and receiving, each with its differential test, docs/performance.md#fast-paths)
  and ``_decompress`` (decompression
  bounded by the message limit). These are the only modules that touch h2, hpack or purerpc internals:
  the layers below use ``GrpcProtocol``'s explicit surface (``open_stream``,
  ``send_message``/``send_data``/``send_trailers``, ``acknowledge``, ``data_to_send``/``output_size``,
  ``ping``, ``close_connection``, ...), so the h2 pin (3.2.0) is their concern alone (checked by
  ``tests/transport/test_protocol_boundary.py``). ``_wire`` (pure) holds gRPC's framing and header values.
* ``_connection``: one socket = one ``Connection`` with exactly two tasks. The **reader** feeds received
  bytes to the protocol and dispatches the events to ``Call`` objects (one per HTTP/2 stream) without
  awaiting. The **writer** is the only task that awaits on the socket: everyone else queues frames in h2
  and ``kick()``s it. A cancelled call therefore can never leave half a frame on the wire, and
  "reset this stream" is a synchronous operation that works even from a cancelled task's ``finally``.
  On the latency-critical path (a unary request, a handler's final status, the reader's replies) the
  caller may ``flush()`` instead: one non-blocking ``os.write`` while the writer is idle, the rest (if any)
  left to the writer, first in line.
* ``_client_connection`` (the reader's dispatch to client calls) / ``_client`` (``Channel``,
  ``ResponseStream``) and ``_server``: calls. A call's owner task (the client caller, or the server's
  handler task) parks on its ``Call`` and re-checks state when woken.

Rules that close the measured defects:

1. *Cancellation.* Leaving a client call before the server's trailers (break, cancel scope, exception,
   deadline) sends RST_STREAM(CANCEL) at once and hands the stream's unread bytes back to the connection
   window, so abandoned streams cost neither memory nor window. On the server, every handler runs in its own
   ``CancelScope``; RST_STREAM or connection loss cancels it immediately, even while it is idle.
2. *Connection loss.* EOF, a socket error, or an HTTP/2 protocol error marks the connection ``lost``:
   every open call fails at once with ``ConnectionLostError`` (UNAVAILABLE), new calls fail the same way,
   and the socket is closed. A channel never reconnects; its owner replaces a ``broken`` channel.
   GOAWAY is not a loss: calls up to its last stream id finish, calls above it and new calls fail with
   ``StreamNotProcessedError`` (UNAVAILABLE, safe to send again elsewhere); the channel is ``draining``
   (docs/reference/transport.md#goaway).
3. *Deadlines.* A client ``timeout`` is sent as ``grpc-timeout`` and enforced locally
   (DEADLINE_EXCEEDED); the server turns a received ``grpc-timeout`` into its handler scope's deadline.
4. *Message size.* The limit (default 64 MiB) applies each way; an over-limit message fails only its own
   call with RESOURCE_EXHAUSTED.
5. *Flow control.* Received messages are acknowledged when consumed, so a slow consumer pushes back on its
   sender; a sender parks while the peer's window is closed and while 64 KiB are queued for the socket.
6. *Errors.* One family (``RpcError`` > ``ConnectionLostError``). A handler's unexpected exception
   answers UNKNOWN ``"unexpected server error"`` and is logged; ordinary cancellation logs nothing. No
   single failure leaves the package as an ExceptionGroup.
7. *Resources.* Closing a channel sends GOAWAY and closes its socket; the server binds exactly the host
   it is given, without SO_REUSEPORT, and closes every connection when cancelled.
8. *Keepalive* (client, opt-in: ``KeepaliveConfig``, gRPC's semantics). A hung peer closes nothing, so
   while calls are open a connection that read nothing for ``time`` sends a PING; when nothing is read
   within ``timeout`` after it, the connection is lost as in rule 2. PINGs stay within gRPC-core's server
   policy: the next one only after the peer sent data following the previous PING's ACK, or
   ``min_ping_interval_without_data`` (5 minutes) after that ACK; GOAWAY ``too_many_pings`` doubles the
   target's keepalive time (``_keepalive``, docs/reference/transport.md#keepalive).
9. *Hostile peers* (docs/reliability.md). The server closes a connection that does not complete its
   handshake in time, sends GOAWAY to one idle too long, and caps the connections it serves
   (``ServerLimits``). Compressed messages (gRPC ``gzip``, ``deflate``) are inflated with the message
   limit as a hard cap on the output. A frame header over SETTINGS_MAX_FRAME_SIZE (16 KiB) ends the
   connection before its payload is buffered, and a peer that provokes control frames (PING, SETTINGS
   acks) without reading them gets GOAWAY ENHANCE_YOUR_CALM once 256 KiB are pending.
"""

from __future__ import annotations

from ._client import Channel, ResponseStream, connect_channel, open_channel
from ._errors import DEFAULT_MAX_MESSAGE_LENGTH, ConnectionLostError, RpcError
from ._server import CallContext, FramedMessages, GrpcServer, ServerLimits, serve_grpc
from ._util import collapse_single_exception
from .health import HealthServicer, check_health, watch_health

__all__ = [
    "collapse_single_exception",
    "DEFAULT_MAX_MESSAGE_LENGTH",
    "CallContext",
    "Channel",
    "ConnectionLostError",
    "FramedMessages",
    "GrpcServer",
    "HealthServicer",
    "ResponseStream",
    "RpcError",
    "ServerLimits",
    "check_health",
    "connect_channel",
    "open_channel",
    "serve_grpc",
    "watch_health",
]
