"""``generate()``'s face of the engine: a :class:`~trio_sidecar.shell.request_task.RunSink` that queues each run of
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

Cancellation: once the request is cancelled (``ctx.stop()``, engine shutdown; the request says so with
``cancelled``), the chunks not taken yet are dropped and usage no longer counts them
(``ResponseState.retract``): the cancelled chunk comes next, and counts exactly the chunks the caller got. A
cancellation after the terminal message was read comes too late (as for ``submit()``): the caller gets every
chunk and the terminal. When the caller leaves (:meth:`close`), runs are discarded and the request is never
paused again (decode mode keeps reading until the KV transfer completed).
"""

from __future__ import annotations

from typing import Any

from trio.lowlevel import Abort, RaiseCancelT, Task, current_task, reschedule, wait_task_rescheduled
from trio.lowlevel import checkpoint as _checkpoint
from trio.lowlevel import checkpoint_if_cancelled as _checkpoint_if_cancelled

from ..core.convert.batch import ChunkBatch
from ..core.convert.response import ResponseState
from ..core.protocol import LLMEngineOutput

__all__ = ["ChunkStream"]

_ABORT_SUCCEEDED = Abort.SUCCEEDED


class ChunkStream:
    """The async iterator ``generate()`` yields, and the sink its request task delivers to.

    It does not hold its request (the request holds it, and tells it of its cancellation, ``cancelled``):
    a reference cycle per request would leave its objects to the garbage collector.
    """

    __slots__ = (
        "_batch",
        "_cancelled",
        "_closed",
        "_dropped",
        "_ended",
        "_error",
        "_final",
        "_finished",
        "_paused",
        "_queued",
        "_reader",
        "_state",
        "request_id",
    )

    def __init__(self) -> None:
        self.request_id = ""
        self._state: ResponseState | None = None  # the request's usage (bound by the engine)
        self._batch: ChunkBatch | None = None  # the run being returned (empty once taken)
        self._queued: list[ChunkBatch] = []  # the runs after it (rarely more than one: cheaper than a deque)
        self._final: LLMEngineOutput | None = None
        self._error: BaseException | None = None
        self._cancelled = False  # the request is cancelled (client or shutdown)
        self._ended = False  # end() was called
        self._finished = False  # the iterator is exhausted
        self._closed = False  # the caller left
        self._dropped = False  # chunks were dropped after the cancellation
        self._reader: Task | None = None  # the caller, parked in __anext__
        self._paused: Task | None = None  # the request task, parked in wait_taken

    def __repr__(self) -> str:
        return f"<generate stream {self.request_id!r}{' finished' if self._finished else ''}>"

    def bind(self, request_id: str, state: ResponseState) -> None:
        self.request_id = request_id
        self._state = state

    # ------------------------------------------------------------------------------ the request task's side

    def run(self, items: list[Any]) -> bool:
        batch = ChunkBatch(items)
        if self._closed or self._dropped:  # nobody will take them
            assert self._state is not None
            self._state.retract(batch.drop())
            return False
        current = self._batch
        if current is None or not current and not self._queued:
            self._batch = batch
        else:
            self._queued.append(batch)
            self._advance()
        reader = self._reader
        if reader is not None:
            self._reader = None
            reschedule(reader)
        return bool(self._queued)  # more than one run not taken: pause

    async def wait_taken(self) -> None:
        self._advance()
        if self._closed or not self._queued:
            await _checkpoint()
            return
        self._paused = current_task()

        def abort(_raise_cancel: RaiseCancelT) -> Abort:
            self._paused = None
            return _ABORT_SUCCEEDED

        await wait_task_rescheduled(abort)

    def cancelled(self) -> None:
        self._cancelled = True

    def end(self, final: LLMEngineOutput | None, error: BaseException | None) -> None:
        if self._dropped:
            assert self._state is not None
            final, error = self._state.cancelled_chunk(), None
        self._final = final
        self._error = error
        self._ended = True
        self._wake_reader()

    # ------------------------------------------------------------------------------ the caller's side

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> LLMEngineOutput:
        batch = self._batch
        if batch is not None and not self._cancelled:  # the common case
            await _checkpoint_if_cancelled()
            chunk = batch.take()
            if chunk is not None:
                return chunk
        if self._finished:
            raise StopAsyncIteration
        state = self._state
        assert state is not None
        while True:
            batch = self._batch
            if batch is not None:
                # (A stop after the terminal message was read comes too late: everything is delivered.)
                if self._cancelled and not state.finished:
                    self._drop()
                    continue
                await _checkpoint_if_cancelled()
                chunk = batch.take()
                if chunk is not None:
                    return chunk
                # The caller starts on the next run: a paused request reads on.
                self._batch = self._queued.pop(0) if self._queued else None
                if self._paused is not None:
                    self._wake_paused()
                continue
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
        self._batch = None
        self._queued.clear()
        self._wake_paused()

    def _advance(self) -> None:
        """Drop a run the caller took all of, when another follows."""
        current = self._batch
        if current is not None and not current and self._queued:
            self._batch = self._queued.pop(0)

    def _drop(self) -> None:
        """The request is cancelled: forget the chunks not taken; the cancelled chunk does not count them."""
        state = self._state
        assert state is not None
        untaken = [batch for batch in (self._batch, *self._queued) if batch]
        self._batch = None
        self._queued.clear()
        if untaken:
            state.retract(sum(batch.drop() for batch in untaken))
            self._dropped = True
            if self._ended:
                self._final, self._error = state.cancelled_chunk(), None
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
        if paused is not None and (self._closed or not self._queued):
            self._paused = None
            reschedule(paused)
