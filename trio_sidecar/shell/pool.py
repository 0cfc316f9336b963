"""The pooled gRPC connections to vLLM (docs/reference/sidecar.md#connection-pool).

Theory of operation
-------------------
A :class:`ChannelPool` holds N *slots*, each owning one HTTP/2 connection (a transport ``Channel``).
Every RPC takes the next slot round-robin (a counter modulo N); each RPC is its own HTTP/2 stream, so
cancelling one never closes the connection it ran on.

Construction (docs/reference/sidecar.md#construction-and-retries) is a startup *phase* step bounded by the phase deadline: slot 1 connects first (so a
wrong endpoint fails once, not N times), then slots 2..N connect concurrently. Each slot retries on a fixed
interval, every attempt bounded by ``min(connect_attempt_timeout, remaining)``. Slot tasks never raise into
the nursery: they record the first failure and cancel their siblings, so a single failure surfaces as a
single exception, never an ``ExceptionGroup``.

After startup (docs/reference/sidecar.md#reconnection-after-startup) purerpc-style connections never reconnect by themselves. A slot whose connection saw a
connection-level failure is *broken*; the next RPC that selects it reconnects once (bounded by the attempt
timeout) under the slot's lock, so concurrent users share a single attempt.

GOAWAY (docs/reference/transport.md#goaway): a connection that got GOAWAY is *draining*: the server still
completes the calls it accepted, so the replaced connection is not closed but left to finish them and
closed once it has no call open (a task in the pool's nursery). A call the server did not process (its
stream above the GOAWAY's last stream id, or started after the GOAWAY: ``StreamNotProcessedError``) is sent
again on the next connection, up to ``NOT_PROCESSED_RETRIES`` times, as a refused stream is.

Resource handling: the connections' I/O tasks run in the nursery passed to :meth:`ChannelPool.connect`
(or owned by :func:`open_channel_pool`). :meth:`ChannelPool.aclose` closes every connection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..core.config import SidecarConfig, keepalive_config
from ..core.endpoint import GrpcEndpoint
from ..core.errors import CannotConnect, ConnectionTimeout, SidecarError, format_duration, status_to_error
from ..core.status import StatusCode
from .diagnostics import describe_exception, round_duration
from .progress import note_failure

if TYPE_CHECKING:
    from ..transport import Channel

__all__ = [
    "ChannelPool",
    "open_channel_pool",
    "connect_with_retry",
    "cause_chain",
    "channel_options",
]

LOGGER = logging.getLogger("trio_sidecar.pool")

#: docs/reference/sidecar.md#construction-and-retries: a repeated failure text is logged at most this often.
LOG_INTERVAL = 30.0

#: How long after the phase deadline the whole-construction safety net fires.
PHASE_GRACE = 0.5

DEFAULT_CAUSE = "the connection attempt exceeded the startup deadline"

#: How many times a call the server did not process (GOAWAY) is sent again on another connection.
NOT_PROCESSED_RETRIES = 3


def _transport() -> Any:
    # Imported lazily: the transport package is the I/O layer; importing it at call time keeps this
    # module importable (and its pure helpers testable) on its own.
    from .. import transport

    return transport


def cause_chain(exc: BaseException) -> str:
    """``exc`` and its causes as one clause without repetitions (see :func:`.diagnostics.describe_exception`)."""
    return describe_exception(exc)


class _RateLimitedLog:
    """docs/reference/sidecar.md#construction-and-retries: log a connection failure when its text changes, or every 30 s with the suppressed count."""

    def __init__(self, name: str, endpoint: str, slot: int) -> None:
        self._prefix = f"{name} gRPC connection attempt to {endpoint} (pool slot {slot}) failed"
        self._last_text: str | None = None
        self._last_time = -math.inf
        self._suppressed = 0

    def failure(self, text: str) -> None:
        now = trio.current_time()
        if text != self._last_text or now - self._last_time >= LOG_INTERVAL:
            if self._suppressed:
                LOGGER.debug("%s: %s (%d similar attempts suppressed)", self._prefix, text, self._suppressed)
            else:
                LOGGER.debug("%s: %s", self._prefix, text)
            self._last_text = text
            self._last_time = now
            self._suppressed = 0
        else:
            self._suppressed += 1


def channel_options(config: SidecarConfig) -> dict[str, Any]:
    """``connect_channel``'s options for every connection to vLLM: message limit and keepalive.

    The message limit each way on Inference and Control calls (docs/reference/sidecar.md#connection-pool) is
    the transport's ``DEFAULT_MAX_MESSAGE_LENGTH`` (64 MiB), the one definition of it. The keepalive is
    :func:`~trio_sidecar.core.config.keepalive_config` (docs/reference/transport.md#keepalive).
    """
    return {
        "max_message_length": _transport().DEFAULT_MAX_MESSAGE_LENGTH,
        "keepalive": keepalive_config(config),
    }


async def _attempt(nursery: trio.Nursery, endpoint: GrpcEndpoint, config: SidecarConfig, timeout: float) -> Channel:
    """One TCP connect + HTTP/2 preface exchange, bounded by ``timeout``; raises on failure."""
    transport = _transport()
    with trio.move_on_after(timeout) as scope:
        return await transport.connect_channel(nursery, endpoint.host, endpoint.port, **channel_options(config))
    assert scope.cancelled_caught
    raise TimeoutError(f"the connection attempt timed out after {format_duration(timeout)}")


async def connect_with_retry(
    nursery: trio.Nursery,
    endpoint: GrpcEndpoint,
    config: SidecarConfig,
    *,
    deadline: float,
    name: str = "vLLM",
    slot: int = 1,
) -> Channel:
    """The per-slot loop (docs/reference/sidecar.md#construction-and-retries): attempt, then retry on the fixed interval until ``deadline``.

    ``deadline`` may be ``math.inf`` (the prober's dedicated connection has no overall deadline).

    Raises:
        CannotConnect: the deadline passed; the exact text (docs/reference/sidecar.md#construction-and-retries).
    """
    start = trio.current_time()
    attempts = 0
    cause = DEFAULT_CAUSE
    log = _RateLimitedLog(name, endpoint.canonical, slot)
    while True:
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            break
        attempts += 1
        cut_by_deadline = remaining < config.connect_attempt_timeout
        try:
            return await _attempt(nursery, endpoint, config, min(config.connect_attempt_timeout, remaining))
        except TimeoutError as exc:
            cause = DEFAULT_CAUSE if cut_by_deadline else cause_chain(exc)
            log.failure(cause)
            note_failure(cause)
        except (OSError, SidecarError, _transport().RpcError) as exc:
            cause = cause_chain(exc)
            log.failure(cause)
            note_failure(cause)
        now = trio.current_time()
        if now >= deadline:
            break
        await trio.sleep_until(min(now + config.retry_interval, deadline))
    elapsed = trio.current_time() - start
    raise CannotConnect(
        f"failed to establish the {name} gRPC connection pool to {endpoint.canonical} for pool slot {slot} "
        f"within {format_duration(config.startup_deadline)} after {attempts} attempts over "
        f"{format_duration(round_duration(elapsed))}: {cause}"
    )


@attrs.define(eq=False)
class _Slot:
    index: int  # 1-based, as in the messages
    channel: Channel
    lock: trio.Lock = attrs.field(factory=trio.Lock)


class ChannelPool:
    """N connections used round-robin (docs/reference/sidecar.md#connection-pool), with broken-slot replacement (docs/reference/sidecar.md#reconnection-after-startup)."""

    def __init__(
        self,
        nursery: trio.Nursery,
        endpoint: GrpcEndpoint,
        config: SidecarConfig,
        channels: Sequence[Channel],
        *,
        name: str = "vLLM",
        reconnect: bool = True,
    ) -> None:
        """Wrap connected ``channels`` (``connect`` builds them). ``reconnect=False`` makes a dedicated pool
        (the prober's): a broken connection is handed out as it is (its calls fail UNAVAILABLE) instead of
        being replaced, so the owner decides when to connect again."""
        self._nursery = nursery
        self.endpoint = endpoint
        self._config = config
        self.name = name
        self._reconnect = reconnect
        self._slots = [_Slot(i + 1, ch) for i, ch in enumerate(channels)]
        self._counter = 0
        self.closed = False
        #: Broken slots replaced, and replacement attempts that failed (docs/observability.md).
        self.reconnects = 0
        self.reconnect_failures = 0
        #: Replaced connections that got GOAWAY and still finish their calls (closed when idle).
        self._draining: set[Channel] = set()

    def __repr__(self) -> str:
        broken = sum(1 for s in self._slots if _unusable(s.channel))
        return (
            f"<ChannelPool {self.endpoint.canonical} [{len(self._slots)} connections, {broken} broken"
            f"{', closed' if self.closed else ''}]>"
        )

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def connections_up(self) -> int:
        """Slots whose connection is usable now (neither broken nor closed)."""
        return sum(1 for slot in self._slots if not _unusable(slot.channel))

    @property
    def channels(self) -> tuple[Channel, ...]:
        return tuple(s.channel for s in self._slots)

    @classmethod
    async def connect(
        cls,
        nursery: trio.Nursery,
        endpoint: GrpcEndpoint,
        config: SidecarConfig,
        *,
        deadline: float,
        size: int | None = None,
        name: str = "vLLM",
    ) -> ChannelPool:
        """Build the pool (docs/reference/sidecar.md#construction-and-retries): slot 1 first, then slots 2..N concurrently; all must succeed.

        Args:
            nursery: runs the connections' I/O tasks; must outlive the pool.
            deadline: the phase deadline (``trio.current_time()`` based).
            size: number of connections (default ``config.grpc_connections``; bootstrap uses 1).

        Raises:
            CannotConnect: a slot could not connect before the deadline (the text of docs/reference/sidecar.md#construction-and-retries).
            ConnectionTimeout: the phase deadline fired around the whole construction.

        Cancellation: connections made so far are closed.
        """
        size = config.grpc_connections if size is None else size
        channels: list[Channel | None] = [None] * size
        failure: list[BaseException] = []

        async def connect_slot(i: int, cancel_siblings: trio.CancelScope | None) -> None:
            try:
                channels[i] = await connect_with_retry(
                    nursery, endpoint, config, deadline=deadline, name=name, slot=i + 1
                )
            except SidecarError as exc:
                if not failure:
                    failure.append(exc)
                if cancel_siblings is not None:
                    cancel_siblings.cancel()

        ok = False
        try:
            # The slot loops enforce ``deadline`` themselves (and report CannotConnect); this scope is the
            # safety net of docs/reference/sidecar.md#construction-and-retries. It fires a little later so that, when both expire together, the slot's
            # precise error wins (Trio delivers a simultaneous cancellation to the outermost scope).
            with trio.move_on_at(deadline + PHASE_GRACE) as phase:
                await connect_slot(0, None)
                if not failure and size > 1:
                    async with trio.open_nursery() as rest:
                        for i in range(1, size):
                            rest.start_soon(connect_slot, i, rest.cancel_scope)
            if failure:
                raise failure[0]
            if phase.cancelled_caught or any(ch is None for ch in channels):
                raise ConnectionTimeout(
                    f"{name} gRPC connection pool to {endpoint.canonical} exceeded the total startup deadline"
                )
            ok = True
            return cls(nursery, endpoint, config, [ch for ch in channels if ch is not None], name=name)
        finally:
            if not ok:
                with trio.CancelScope(shield=True):
                    for ch in channels:
                        if ch is not None:
                            await ch.aclose()

    def _next_slot(self) -> _Slot:
        slot = self._slots[self._counter % len(self._slots)]
        self._counter += 1
        return slot

    async def channel(self, rpc: str) -> Channel:
        """The next connection, round-robin, reconnecting a broken slot first (docs/reference/sidecar.md#reconnection-after-startup).

        Args:
            rpc: the RPC name for the error message.

        Raises:
            CannotConnect: ``"{rpc}: {detail} (Unavailable)"`` when the pool is closed or reconnection failed.
        """
        if self.closed:
            raise status_to_error(rpc, StatusCode.UNAVAILABLE, f"the {self.name} connection pool is closed")
        slot = self._next_slot()
        if not self._reconnect or not _unusable(slot.channel):
            return slot.channel
        async with slot.lock:
            if not _unusable(slot.channel):  # another user already reconnected it
                return slot.channel
            if self.closed:
                raise status_to_error(rpc, StatusCode.UNAVAILABLE, f"the {self.name} connection pool is closed")
            old = slot.channel
            if getattr(old, "draining", False):
                # GOAWAY: the server finishes the calls it accepted; closing now would fail them.
                self._draining.add(old)
                self._nursery.start_soon(self._drain, old)
            else:
                with trio.CancelScope(shield=True):
                    await old.aclose()
            try:
                new = await _attempt(self._nursery, self.endpoint, self._config, self._config.connect_attempt_timeout)
            except (OSError, SidecarError, _transport().RpcError) as exc:
                self.reconnect_failures += 1
                detail = f"reconnecting {self.name} pool slot {slot.index} to {self.endpoint.canonical} failed: "
                raise status_to_error(rpc, StatusCode.UNAVAILABLE, detail + cause_chain(exc)) from exc
            if self.closed:
                with trio.CancelScope(shield=True):
                    await new.aclose()
                raise status_to_error(rpc, StatusCode.UNAVAILABLE, f"the {self.name} connection pool is closed")
            slot.channel = new
            self.reconnects += 1
            LOGGER.info("reconnected %s gRPC pool slot %d to %s", self.name, slot.index, self.endpoint.canonical)
            return new

    async def _drain(self, channel: Channel) -> None:
        """Close a replaced connection that got GOAWAY once its open calls have ended."""
        try:
            await channel.wait_idle()
        finally:
            self._draining.discard(channel)
            with trio.CancelScope(shield=True):
                await channel.aclose()

    async def unary(
        self,
        rpc: str,
        method: str,
        request: Any,
        response_type: Any,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
        channel: Any = None,
    ) -> Any:
        """A unary call on ``channel`` (default: the next connection, :meth:`channel`); a call the server did not
        process (GOAWAY) is sent again on the next connection.

        The edge for gRPC errors (with :meth:`stream`): a transport ``RpcError`` (``ConnectionLostError``
        included) is raised as ``status_to_error(rpc, code, message)``, chained from it
        (docs/reference/sidecar.md#grpc-status-mapping); its ``grpc_code``/``grpc_message`` keep the status.

        Raises:
            SidecarError: the translated status, or :meth:`channel`'s ``CannotConnect``.
        """
        transport = _transport()
        if channel is None:
            channel = await self.channel(rpc)
        attempt = 0
        while True:
            try:
                return await channel.unary_unary(method, request, response_type, metadata=metadata, timeout=timeout)
            except transport.RpcError as exc:
                if _not_processed(exc) and attempt < NOT_PROCESSED_RETRIES and not self.closed:
                    attempt += 1
                    channel = await self.channel(rpc)
                    continue
                raise status_to_error(rpc, exc.code, exc.message) from exc

    def stream(
        self,
        rpc: str,
        method: str,
        request: Any,
        response_type: Any,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
        channel: Any = None,
    ) -> _PoolStream:
        """A server-streaming call on ``channel`` (default: the next connection, :meth:`channel`)::

            async with pool.stream("GenerateStream", method, request, None, channel=channel) as responses:
                async for data in responses: ...      # or: await responses.listen(listener, flush)

        ``responses`` is the transport's ``ResponseStream`` (``response_type=None``: serialized messages,
        ``listen`` available). Entering sends the request and waits for the response headers.

        The edge for gRPC errors, as :meth:`unary`: every transport ``RpcError`` (``ConnectionLostError``
        included) that leaves the block, whether raised on entering, while iterating or from ``listen``, is
        raised as ``status_to_error(rpc, code, message)``, chained from it; other exceptions (``SidecarError``, ``trio.Cancelled``, ...) leave unchanged. Inside the block the stream
        raises the transport's ``RpcError``: code there catches ``SidecarError`` only after the block.

        Leaving the block before the server's trailers (break, exception, cancellation) resets the stream
        (RST_STREAM CANCEL) at once; the connection stays usable.

        Raises:
            SidecarError: the translated status, or :meth:`channel`'s ``CannotConnect``.
        """
        return _PoolStream(self, rpc, (method, request, response_type, metadata, timeout), channel)

    async def aclose(self) -> None:
        """Close every connection, draining ones included (idempotent). Shielded: cleanup must not be
        interrupted half-way."""
        self.closed = True
        with trio.CancelScope(shield=True):
            for slot in self._slots:
                await slot.channel.aclose()
            for channel in list(self._draining):
                await channel.aclose()


class _PoolStream:
    """``ChannelPool.stream``'s context manager (a class: one object per call, no generator)."""

    __slots__ = ("_args", "_channel", "_pool", "_rpc", "_stream")

    def __init__(self, pool: ChannelPool, rpc: str, args: tuple, channel: Any) -> None:
        self._pool = pool
        self._rpc = rpc
        self._args = args
        self._channel = channel
        self._stream: Any = None

    async def __aenter__(self) -> Any:
        rpc = self._rpc
        pool = self._pool
        channel = self._channel
        if channel is None:
            channel = await pool.channel(rpc)
        method, request, response_type, metadata, timeout = self._args
        attempt = 0
        while True:
            stream = channel.unary_stream(method, request, response_type, metadata=metadata, timeout=timeout)
            try:
                await stream.__aenter__()
            except _transport().RpcError as exc:  # (the stream closed its call)
                if _not_processed(exc) and attempt < NOT_PROCESSED_RETRIES and not pool.closed:
                    attempt += 1  # GOAWAY before the server took the call: the next connection
                    channel = await pool.channel(rpc)
                    continue
                raise status_to_error(rpc, exc.code, exc.message) from exc
            self._stream = stream
            return stream

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        await self._stream.__aexit__(exc_type, exc, tb)  # resets the stream unless the server ended it
        if exc is not None and isinstance(exc, _transport().RpcError):
            error: Any = exc  # (the transport is imported lazily: its types are Any here)
            raise status_to_error(self._rpc, error.code, error.message) from exc
        return False


def _not_processed(exc: BaseException) -> bool:
    """The server did not process the call (GOAWAY): it may be sent again on another connection."""
    return isinstance(exc, _transport()._errors.StreamNotProcessedError)


def _unusable(channel: Channel) -> bool:
    return bool(getattr(channel, "broken", False) or getattr(channel, "closed", False))


@asynccontextmanager
async def open_channel_pool(
    endpoint: GrpcEndpoint,
    config: SidecarConfig,
    *,
    deadline: float,
    size: int | None = None,
    name: str = "vLLM",
) -> AsyncIterator[ChannelPool]:
    """A :class:`ChannelPool` owning its nursery; closed (and its tasks ended) on exit."""
    with _transport().collapse_single_exception():
        async with trio.open_nursery() as nursery:
            pool = await ChannelPool.connect(nursery, endpoint, config, deadline=deadline, size=size, name=name)
            try:
                yield pool
            finally:
                await pool.aclose()
                nursery.cancel_scope.cancel()
