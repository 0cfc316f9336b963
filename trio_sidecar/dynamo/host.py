"""Dynamo's asyncio loop on Trio, in Trio's own thread (trio-asyncio; prototype measured for issue 21).

Dynamo's Python bindings only work on asyncio, and every Dynamo object must be touched on the loop that
created it. Here that loop is trio-asyncio's (``trio_asyncio.open_loop()``): an asyncio event loop whose
callbacks run in a Trio task of the worker's own nursery tree. Every asyncio callback and task step, the
Dynamo handler included, runs on Trio's thread, so the handler and the sidecar exchange requests and chunks by
plain calls. Dynamo's Rust threads reach the loop with ``loop.call_soon_threadsafe``, which trio-asyncio
turns into ``TrioToken.run_sync_soon`` (thread-safe; it wakes Trio's I/O wait).

:class:`HostLoop` is how Trio code waits for asyncio work (:meth:`HostLoop.run`: an asyncio task on the
loop, the Trio caller parked until it is done; cancelling the caller cancels the task).
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio
import trio_asyncio
from sniffio import thread_local as sniffio_library
from trio_asyncio._async import TrioEventLoop
from trio_asyncio._handles import AsyncHandle

__all__ = ["HostLoop", "open_host_loop"]

T = TypeVar("T")


class HostLoop:
    """The asyncio loop that runs on Trio (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Schedule ``fn(*args)`` as a callback of the loop (never blocks)."""
        self.loop.call_soon(fn, *args)

    async def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await async_fn(*args)`` as an asyncio task on the loop and return its result (or raise its
        exception). ``async_fn`` may return a coroutine or any awaitable (Dynamo's bindings return futures).

        Cancellation: cancelling the Trio caller cancels the asyncio task and returns at once.
        """

        async def invoke() -> T:
            return await async_fn(*args)

        done = trio.Event()
        task = self.loop.create_task(invoke())
        task.add_done_callback(lambda _task: done.set())
        try:
            await done.wait()
        except trio.Cancelled:
            task.cancel()
            raise
        return task.result()


# Variant "batched" (measurement only): trio-asyncio's loop task runs one asyncio callback per Trio
# checkpoint (``await receive()`` on its queue for each handle), so each callback costs a pass through Trio's
# scheduler. This runs, after each one, the callbacks already queued (at most this many) without yielding,
# the way asyncio's own loop runs its ready queue.
BATCH = 256
_stock_main_loop_one = TrioEventLoop._main_loop_one


async def _batched_main_loop_one(self: Any, no_wait: bool = False) -> None:
    await _stock_main_loop_one(self, no_wait)
    receive_nowait = self._q_recv.receive_nowait
    for _ in range(BATCH):
        try:
            obj = receive_nowait()
        except trio.WouldBlock:
            return
        if isinstance(obj, asyncio.TimerHandle):
            heapq.heappush(self._timers, obj)
        elif isinstance(obj, AsyncHandle):
            obj._context.run(self._nursery.start_soon, obj._run, name=obj._callback)
            await obj._started.wait()
        elif not obj._cancelled:
            prev_library, sniffio_library.name = sniffio_library.name, "asyncio"
            try:
                obj._run()
            finally:
                sniffio_library.name = prev_library


TrioEventLoop._main_loop_one = _batched_main_loop_one  # type: ignore[method-assign]


@asynccontextmanager
async def open_host_loop() -> AsyncIterator[HostLoop]:
    """trio-asyncio's loop for the block; leaving it cancels what still runs on the loop and closes it."""
    async with trio_asyncio.open_loop() as loop:
        yield HostLoop(loop)
