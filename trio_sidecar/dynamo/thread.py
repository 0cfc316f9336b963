"""The asyncio thread: Dynamo's runtime lives on an asyncio loop in a dedicated thread, driven from Trio
(docs/reference/worker.md#the-asyncio-thread-bridge).

Dynamo's Python bindings only work on asyncio, and every Dynamo object must be touched on the loop that
created it. Trio owns the process; the two sides talk only through non-blocking, thread-safe scheduling
calls, so neither loop ever blocks on the other:

* asyncio → Trio: ``trio_token.run_sync_soon(fn, *args)``. It raises ``trio.RunFinishedError`` once the
  Trio run is over, which the asyncio side catches.
* Trio → asyncio: ``loop.call_soon_threadsafe(fn, *args)``, or for a coroutine
  ``asyncio.run_coroutine_threadsafe``; Trio waits for the resulting future through a done-callback that
  sets a ``trio.Event`` via ``run_sync_soon`` (:meth:`AsyncioThread.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["AsyncioThread", "LOOP_ENDED", "TrioCalls"]

LOOP_ENDED = "the asyncio thread's loop ended"

LOGGER = logging.getLogger("trio_sidecar.dynamo.bridge")


class AsyncioThread:
    """A dedicated thread running an asyncio loop, driven from Trio.

    Use :meth:`open` (an async context manager); :meth:`run` executes a coroutine function on the loop and
    waits for it without blocking Trio; :meth:`call_soon` schedules a plain callable there.
    ``loop_factory`` makes the loop (``asyncio.Runner``'s argument; None: asyncio's default loop).
    """

    def __init__(self, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_factory = loop_factory
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: asyncio.Event | None = None
        self._finished = trio.Event()
        self._waiting: set[trio.Event] = set()  # run() callers, woken when the loop ends under them
        self._started = trio.Event()
        self._error: BaseException | None = None

    # -- lifetime --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the thread and wait until its loop runs."""
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._thread_main, name="dynamo-asyncio", daemon=False)
        self._thread.start()
        await self._started.wait()
        if self.loop is None:
            raise RuntimeError("the asyncio thread failed to start") from self._error

    async def stop(self) -> None:
        """Stop the loop (cancelling whatever still runs on it) and join the thread."""
        if self._thread is None:
            return
        if self.loop is not None and self._stop is not None and not self._finished.is_set():
            try:
                self.loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # loop already closed
                pass
        with trio.CancelScope(shield=True):
            await self._finished.wait()
            await trio.to_thread.run_sync(self._thread.join)
        self._thread = None

    def _thread_main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                runner.run(self._aio_main())
        except BaseException as exc:  # noqa: BLE001 - reported to Trio, never lost
            self._error = exc
            LOGGER.debug("asyncio thread ended with %r", exc)
        finally:
            self._notify_trio(self._started.set)
            self._notify_trio(self._ended)

    async def _aio_main(self) -> None:
        self._stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self._notify_trio(self._started.set)
        await self._stop.wait()

    def _notify_trio(self, fn: Callable[..., Any], *args: Any) -> bool:
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            return False
        return True

    # -- calls -----------------------------------------------------------------------------------------

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop (thread-safe, never blocks)."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn, *args)

    def _ended(self) -> None:
        """The loop's thread is over (Trio thread): wake every ``run()`` that still waits on it."""
        self._finished.set()
        for waiting in list(self._waiting):
            waiting.set()

    async def run(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``await async_fn(*args)`` on the loop and return its result (or raise its exception).

        ``async_fn`` may return a coroutine or any awaitable (Dynamo's bindings return futures).

        Cancellation: cancelling the Trio caller cancels the asyncio task (best effort) and returns at once.

        Raises:
            RuntimeError: ``the asyncio thread's loop ended`` (chained to what ended it) when the loop is gone
                before the call finished: a failure on the asyncio side fails its Trio callers instead of
                leaving them waiting forever.
        """
        assert self.loop is not None
        if self._finished.is_set():
            raise RuntimeError(LOOP_ENDED) from self._error

        async def invoke() -> Any:
            return await async_fn(*args)

        done = trio.Event()
        self._waiting.add(done)
        coro = invoke()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            future.add_done_callback(lambda _f: self._notify_trio(done.set))
            try:
                await done.wait()
            except trio.Cancelled:
                future.cancel()
                raise
        finally:
            self._waiting.discard(done)
        if not future.done() or future.cancelled():  # (only the loop going away cancels it on that side)
            future.cancel()
            # The loop is gone, so nothing will ever run or close the coroutine: close it here, or the garbage
            # collector warns that it was never awaited (or runs its cleanup at some later, arbitrary point).
            with contextlib.suppress(RuntimeError):  # (a coroutine that refuses to close is left as it is)
                coro.close()
            raise RuntimeError(LOOP_ENDED) from self._error
        return future.result()


class TrioCalls:
    """asyncio → Trio for whole coroutines: ``await calls.call(async_fn, *args)`` on the loop runs
    ``async_fn(*args)`` as a task in a Trio nursery and gives back its result (or raises its exception).

    Used by callbacks Dynamo runs on the loop (the system port's engine routes) to reach the sidecar, which
    is Trio's. Nothing blocks: the task is started with ``run_sync_soon`` and the result comes back with
    ``call_soon_threadsafe``. Cancelling the asyncio caller cancels the Trio task (best effort); a task
    cancelled by Trio (the nursery closing), or a Trio run that is over, raises ``RuntimeError`` on the loop.
    """

    def __init__(self, token: trio.lowlevel.TrioToken, nursery: trio.Nursery) -> None:
        self._token = token
        self._nursery = nursery

    async def call(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        scope = trio.CancelScope()

        def deliver(fn: Callable[[asyncio.Future[Any]], None]) -> None:  # the loop's thread
            if not future.done():
                fn(future)

        def post(fn: Callable[[asyncio.Future[Any]], None]) -> None:  # the Trio thread
            try:
                loop.call_soon_threadsafe(deliver, fn)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        async def task() -> None:
            result: Any = None
            error: BaseException | None = None
            with scope:
                try:
                    result = await async_fn(*args)
                except trio.Cancelled:
                    post(lambda f: f.set_exception(RuntimeError("the sidecar stopped before the call finished")))
                    raise
                except Exception as exc:  # noqa: BLE001 - handed to the asyncio caller
                    error = exc
            if scope.cancelled_caught:
                post(lambda f: f.set_exception(RuntimeError("the call was cancelled")))
            elif error is not None:
                post(lambda f, e=error: f.set_exception(e))  # type: ignore[misc]
            else:
                post(lambda f: f.set_result(result))

        def spawn() -> None:  # the Trio thread
            try:
                self._nursery.start_soon(task)
            except RuntimeError:  # the nursery is closed
                post(lambda f: f.set_exception(RuntimeError("the sidecar is not running")))

        try:
            self._token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise RuntimeError("the sidecar is not running") from None
        try:
            return await future
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(scope.cancel)
            raise
