"""The abort sender (docs/reference/sidecar.md#abort-after-abandoning-a-stream).

Whenever a request task abandons an opened ``GenerateStream`` before the server ended it, it queues the
request id here (:meth:`AbortSender.queue`, never blocks). One task in the sidecar's nursery reads the ids
from an unbounded memory channel and sends ``Control.Abort`` with every id available at that moment, each
call bounded by ``abort_timeout``; failures are warnings, never reported to the client. On cleanup the
pending ids are flushed for at most :data:`ABORT_FLUSH_GRACE` seconds (shielded).
"""

from __future__ import annotations

import logging
import math

import trio

from .._proto.vllm import control_pb2
from ..core.errors import SidecarError
from ..core.stats import SidecarStats
from .pool import ChannelPool

__all__ = ["ABORT", "ABORT_FLUSH_GRACE", "AbortSender"]

LOGGER = logging.getLogger("trio_sidecar.engine")

ABORT = "/vllm.Control/Abort"

#: On cleanup, pending Abort ids are flushed for at most this long (shielded).
ABORT_FLUSH_GRACE = 5.0


class AbortSender:
    """Batches request ids into best-effort ``Control.Abort`` calls on ``pool``.

    Attributes:
        queued: ids queued so far; ``sent``: ids whose Abort call succeeded (for tests and ``repr``).
        stats: where the ids queued, sent, failed and timed out are counted (docs/observability.md); the
            engine's, else a fresh one.
    """

    def __init__(self, pool: ChannelPool, timeout: float, *, stats: SidecarStats | None = None) -> None:
        self._pool = pool
        self._timeout = timeout
        self.stats = stats if stats is not None else SidecarStats()
        self._send, self._receive = trio.open_memory_channel[str](math.inf)
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self.queued = 0
        self.sent = 0

    def __repr__(self) -> str:
        return f"<AbortSender {self.queued} queued, {self.sent} sent>"

    def queue(self, request_id: str) -> None:
        """Queue ``request_id`` for the next Abort call (ignored once :meth:`aclose` began)."""
        try:
            self._send.send_nowait(request_id)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        self.queued += 1
        self.stats.aborts_queued += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The sender task (``nursery.start``); ends when :meth:`aclose` flushed or gave up."""
        receive = self._receive
        try:
            with self._scope:
                task_status.started()
                async with receive:
                    async for first in receive:
                        ids = [first]
                        while True:
                            try:
                                ids.append(receive.receive_nowait())
                            except (trio.WouldBlock, trio.EndOfChannel):
                                break
                        await self._send_abort(ids)
        finally:
            self._done.set()

    async def aclose(self) -> None:
        """Stop queueing; send what is pending for at most :data:`ABORT_FLUSH_GRACE` s (shielded), then end
        the sender task."""
        self._send.close()
        with trio.CancelScope(shield=True), trio.move_on_after(ABORT_FLUSH_GRACE):
            await self._done.wait()
        self._scope.cancel()

    async def _send_abort(self, ids: list[str]) -> None:
        timeout = self._timeout
        try:
            with trio.move_on_after(timeout) as scope:
                await self._pool.unary(
                    "Abort", ABORT, control_pb2.AbortRequest(request_ids=ids), control_pb2.AbortResponse
                )
        except SidecarError as exc:
            LOGGER.warning("Control.Abort failed for %s: %s", ids, exc)
            self.stats.aborts_failed += len(ids)
            return
        if scope.cancelled_caught:
            LOGGER.warning("Abort did not respond within %ss", f"{timeout:g}")
            self.stats.aborts_timed_out += len(ids)
            return
        self.sent += len(ids)
        self.stats.aborts_sent += len(ids)
