"""``generate()``'s face of the engine: a :class:`~trio_sidecar.request_task.RunSink` that queues each run of
chunks for an async iterator (docs/reference/sidecar.md#embedded-api, docs/reference/sidecar.md#cancellation).

Theory of operation
-------------------
The request task delivers the chunks of each run of messages read together (``run``), as it does for
``submit()``; :class:`ChunkStream` keeps them (``convert.batch.ChunkBatch``, one per run) and returns them one
per ``__anext__``, then the final chunk, or raises the error.

Back-pressure: while the caller has not taken a run, the next run pauses the request (``run`` returns True):
its task stops reading until the caller starts on that next run (``wait_taken``), and the stream's further
messages stay in the transport, unacknowledged, so HTTP/2 flow control reaches the server. The request is
never more than one run of already-received messages ahead of the caller.

Cancellation: once the request is cancelled (``ctx.stop()``, engine shutdown), the chunks not taken yet are
dropped and usage no longer counts them (``ResponseState.retract``): the cancelled chunk comes next, and
counts exactly the chunks the caller got. A cancellation after the terminal message was read comes too late
(as for ``submit()``): the caller gets every chunk and the terminal. When the caller leaves (:meth:`close`), runs are discarded and the
request is never paused again (decode mode keeps reading until the KV transfer completed).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from trio.lowlevel import Abort, RaiseCancelT, Task, current_task, reschedule, wait_task_rescheduled
from trio.lowlevel import checkpoint as _checkpoint
from trio.lowlevel import checkpoint_if_cancelled as _checkpoint_if_cancelled

from .convert.batch import ChunkBatch
from .convert.response import ResponseState
from .protocol import LLMEngineOutput
from .request_task import RequestTask

__all__ = ["ChunkStream"]

_ABORT_SUCCEEDED = Abort.SUCCEEDED


class ChunkStream:
    """The async iterator ``generate()`` yields, and the sink its request task delivers to.

    It holds its request only until ``end`` (after it, the request's cancellation state cannot change), so
    that the two do not keep each other alive: a reference cycle per request would leave its objects to
    the garbage collector.
    """

    __slots__ = ("_closed", "_dropped", "_ended", "_error", "_final", "_finished", "_paused", "_pending",
                 "_reader", "_request", "_state", "request_id")

    def __init__(self) -> None:
        self.request_id = ""
        self._request: RequestTask | None = None  # the running request (bound by the engine, until end())
        self._state: ResponseState | None = None  # its usage
        #: Runs not taken yet; the first is being returned (it may be empty until the caller asks for more).
        self._pending: deque[ChunkBatch] = deque()
        self._final: LLMEngineOutput | None = None
        self._error: BaseException | None = None
        self._ended = False  # end() was called
        self._finished = False  # the iterator is exhausted
        self._closed = False  # the caller left
        self._dropped = False  # chunks were dropped after the cancellation
        self._reader: Task | None = None  # the caller, parked in __anext__
        self._paused: Task | None = None  # the request task, parked in wait_taken

    def __repr__(self) -> str:
        return f"<generate stream {self.request_id!r}{' finished' if self._finished else ''}>"

    def bind(self, request: RequestTask) -> None:
        self._request = request
        self._state = request.state
        self.request_id = request.request_id

    # ------------------------------------------------------------------------------ the request task's side

    def run(self, items: list[Any]) -> bool:
        batch = ChunkBatch(items)
        if self._closed or self._dropped:  # nobody will take them
            assert self._state is not None
            self._state.retract(batch.drop())
            return False
        pending = self._pending
        if pending and not pending[0]:  # (the caller took all of it but has not asked for more yet)
            pending.popleft()
        pending.append(batch)
        reader = self._reader
        if reader is not None:
            self._reader = None
            reschedule(reader)
        return len(pending) > 1

    async def wait_taken(self) -> None:
        pending = self._pending
        if pending and not pending[0]:
            pending.popleft()
        if self._closed or len(pending) <= 1:
            await _checkpoint()
            return
        self._paused = current_task()

        def abort(_raise_cancel: RaiseCancelT) -> Abort:
            self._paused = None
            return _ABORT_SUCCEEDED

        await wait_task_rescheduled(abort)

    def end(self, final: LLMEngineOutput | None, error: BaseException | None) -> None:
        request = self._request
        self._request = None
        assert request is not None and self._state is not None
        if request.cancelling and self._pending:
            self._drop()  # (what the caller's next __anext__ would do: the request's state is final now)
        if self._dropped:
            final, error = self._state.cancelled_chunk(), None
        self._final = final
        self._error = error
        self._ended = True
        self._wake_reader()

    # ------------------------------------------------------------------------------ the caller's side

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> LLMEngineOutput:
        if self._finished:
            raise StopAsyncIteration
        pending = self._pending
        while True:
            if pending:
                request = self._request
                if request is None or not request.cancelling or request.state.finished:
                    # (A stop after the terminal message was read comes too late: everything is delivered.)
                    await _checkpoint_if_cancelled()
                    chunk = pending[0].take()
                    if chunk is not None:
                        return chunk
                    pending.popleft()  # the caller starts on the next run: a paused request reads on
                    if self._paused is not None:
                        self._wake_paused()
                    continue
                self._drop()
            if self._ended:
                break
            await self._wait()
        self._finished = True
        final, self._final = self._final, None
        if final is not None:
            return final
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    def close(self) -> None:
        """The caller left: discard what is queued and never pause the request again."""
        self._closed = True
        self._pending.clear()
        self._wake_paused()

    def _drop(self) -> None:
        """The request is cancelled: forget the chunks not taken; the cancelled chunk does not count them
        (unless the terminal message was read: then nothing is dropped)."""
        state = self._state
        assert state is not None
        if state.finished:
            return
        pending = self._pending
        untaken = [batch for batch in pending if batch]
        pending.clear()
        if untaken:
            state.retract(sum(batch.drop() for batch in untaken))
            self._dropped = True
        self._wake_paused()

    async def _wait(self) -> None:
        self._reader = current_task()

        def abort(_raise_cancel: RaiseCancelT) -> Abort:
            self._reader = None
            return _ABORT_SUCCEEDED

        await wait_task_rescheduled(abort)

    def _wake_reader(self) -> None:
        reader = self._reader
        if reader is not None:
            self._reader = None
            reschedule(reader)

    def _wake_paused(self) -> None:
        paused = self._paused
        if paused is not None and (self._closed or len(self._pending) <= 1):
            self._paused = None
            reschedule(paused)
