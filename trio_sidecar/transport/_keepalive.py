"""The client keepalive task of a connection, and gRPC-core's keepalive throttling per target.

Theory of operation
-------------------
gRPC's client keepalive (gRFC A8): while a connection has calls open and read nothing for ``time``, send a
PING; when nothing at all (its ACK or any other frame) is read within ``timeout`` after it, the peer is
presumed hung and the connection is lost (every open call fails UNAVAILABLE). A connection without calls
is never PINGed.

gRPC-core's server polices PINGs (``KeepaliveConfig``): one that arrives within 5 minutes of the previous
one, with no HEADERS, DATA or WINDOW_UPDATE written by the server in between, is a strike, and the third
strike ends the connection with GOAWAY ENHANCE_YOUR_CALM ``too_many_pings``. So the next PING is sent only

* once the server sent such a frame after the ACK of the previous PING (the strike count is then reset, and
  the PING is free however soon), or
* once ``min_ping_interval_without_data`` has passed since that ACK was read (the ACK is read after the
  server received the PING, so the interval the server measures is longer still).

A stream in progress (tokens flowing) therefore keeps the full ``time + timeout`` detection of a hung
peer; a connection whose calls are all silent (an idle ``Health.Watch``) is PINGed at most once per
``min_ping_interval_without_data``. One PING is outstanding at a time.

Throttling: on GOAWAY ENHANCE_YOUR_CALM ``too_many_pings`` (a server stricter than assumed), the keepalive
time of that target is doubled for every later connection in this process, as gRPC-core's subchannel does
(``throttle_keepalive``), and logged at ERROR.
"""

from __future__ import annotations

import logging
import math
import select
import struct
from typing import TYPE_CHECKING

import trio
from trio.lowlevel import Abort, current_task, wait_task_rescheduled

if TYPE_CHECKING:
    from ._connection import Connection

__all__ = ["TOO_MANY_PINGS", "keepalive_time_for", "run_keepalive", "throttle_keepalive"]

LOGGER = logging.getLogger("trio_sidecar.transport.keepalive")

#: gRPC-core's GOAWAY debug data when a client PINGs more often than the server permits.
TOO_MANY_PINGS = b"too_many_pings"
#: gRPC-core caps the throttled keepalive time at INT_MAX milliseconds divided by the multiplier (2).
MAX_KEEPALIVE_TIME = (2**31 - 1) / 1000 / 2

_throttled: dict[str, float] = {}  # target -> keepalive time after too_many_pings (process-wide)


def keepalive_time_for(target: str, configured: float | None) -> float | None:
    """The keepalive time a new connection to ``target`` uses: ``configured``, or more once throttled."""
    if configured is None:
        return None
    return max(configured, _throttled.get(target, 0.0))


def throttle_keepalive(target: str, current: float) -> float:
    """A GOAWAY ``too_many_pings`` from ``target``: double its keepalive time (for new connections); returns it."""
    doubled = min(current * 2, MAX_KEEPALIVE_TIME)
    throttled = max(doubled, _throttled.get(target, 0.0))
    _throttled[target] = throttled
    LOGGER.error(
        'transport: %s sent GOAWAY with error code ENHANCE_YOUR_CALM and debug data "too_many_pings"; '
        "keepalive time %gs (before throttling), %gs for new connections",
        target,
        current,
        throttled,
    )
    return throttled


async def run_keepalive(conn: Connection) -> None:
    """The keepalive task of ``conn`` (``conn.keepalive``, ``conn.keepalive_time``); see the module docstring.

    Returns when the connection closes (GOAWAY sent); loses the connection when a PING goes unanswered.
    ``conn.keepalive_time`` is read at every step, so a throttled connection PINGs less from then on.
    """
    config = conn.keepalive
    assert config is not None
    timeout = config.timeout
    min_gap = config.min_ping_interval_without_data
    protocol = conn.protocol
    count = 0
    active_since = trio.current_time()
    acks = protocol.ping_acks_received
    last_ack = -math.inf  # when the ACK of our last PING was read (at the latest)
    sent = -math.inf  # when our last PING was sent
    while True:
        if not conn.calls:
            conn.keepalive_waiter = current_task()

            def abort(raise_cancel):  # type: ignore[no-untyped-def]
                conn.keepalive_waiter = None
                return Abort.SUCCEEDED

            await wait_task_rescheduled(abort)
            active_since = trio.current_time()
            continue
        now = trio.current_time()
        if protocol.ping_acks_received != acks:
            acks = protocol.ping_acks_received
            last_ack = now
        interval = conn.keepalive_time
        assert interval is not None
        due = max(conn.last_read, active_since) + interval
        if now < due:
            await trio.sleep_until(due)
            continue  # re-check: a read or the end of every call may have come meanwhile
        if acks < count:
            # The previous PING is unanswered, yet bytes came after it (else the connection would be lost):
            # only the time rule can tell whether another is welcome, counted from when that one was sent.
            allowed = now >= sent + min_gap
        else:
            allowed = protocol.peer_sent_data_since_ping_ack() or now >= last_ack + min_gap
        if not allowed:
            # A PING now would be a strike: wait for data from the peer (a read moves ``due``) or the gap.
            await trio.sleep_until(min(max(last_ack, sent) + min_gap, now + interval))
            continue
        count += 1
        if not protocol.ping(struct.pack(">Q", count)):
            return  # the connection is closing (GOAWAY sent): nothing to keep
        conn.flush()  # (or the writer sends it, if it is busy or the kernel did not take it all)
        sent = now
        await trio.sleep_until(sent + timeout)
        # Nothing read since the PING (a read at its very instant counts), and nothing waiting to be read
        # either: bytes that arrived while this process itself was stalled are not the peer's fault.
        if conn.last_read < sent and not _readable(conn.stream.socket.fileno()):
            conn.lose(f"connection to {conn.description} lost: keepalive PING not acknowledged within {timeout:g}s")
            return


def _readable(fd: int) -> bool:
    """Whether bytes (or EOF) are waiting on the socket ``fd``, without blocking."""
    poller = select.poll()  # (not select.select: no limit on the descriptor's number)
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))  # POLLIN, POLLHUP, POLLERR or POLLNVAL: the reader has something to report
