"""The wake-up handshake between the Trio thread and the asyncio loop (the "Wake-ups" section of
``bridge.py``): each request's :class:`Outbox`, and a :class:`Waker` that resolves the parked handlers'
futures, and runs the callbacks :meth:`Waker.call_soon` queued, with one ``call_soon_threadsafe`` per batch.
No lock: under the GIL, the handler publishes its waiter *then* re-checks the deque, and ``emit`` appends
*then* reads the waiter, so at least one sees the other.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Outbox", "Waker"]


class Outbox:
    """One request's chunk deque plus the handler's parked waiter (see "Wake-ups" in ``bridge.py``).

    ``drain``, set while a push handler is parked: the loop's flush calls it instead of resuming the handler
    (it sends what is queued inline and returns True when the handler must take over).
    """

    __slots__ = ("drain", "items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future | None = None
        self.drain: Callable[[], bool] | None = None


class Waker:
    """Resolves parked handler futures on the loop, one ``call_soon_threadsafe`` per batch.

    ``poke()`` (Trio thread) is called once per batch, on its first ready waiter; it calls :meth:`wake_loop`
    now or, from the bridge's dispatcher task, once the Trio tasks that are ready now have run (see
    "Wake-ups" in ``bridge.py``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, poke: Callable[[], None]) -> None:
        self._loop = loop
        self._poke = poke
        self._ready: deque[tuple[Outbox, asyncio.Future]] = deque()
        self._calls: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._scheduled = False

    def call_soon(self, callback: Callable[[Any], None], arg: Any) -> None:  # the Trio thread
        """Run ``callback(arg)`` on the loop at the next flush, before the parked handlers resume (it shares
        the batch's one wake-up). It runs whether or not any handler is still there."""
        self._calls.append((callback, arg))
        if not self._scheduled:
            self._scheduled = True
            self._poke()

    def emit(self, outbox: Outbox, item: Any) -> None:  # the Trio thread
        outbox.items.append(item)
        waiter = outbox.waiter
        if waiter is not None:
            outbox.waiter = None
            self._ready.append((outbox, waiter))
            if not self._scheduled:
                self._scheduled = True
                self._poke()

    def wake_loop(self) -> None:  # the Trio thread
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: no handler waits any more
            pass

    def _flush(self) -> None:  # the loop's thread
        self._scheduled = False  # before draining: a waiter appended after this schedules a new flush
        calls = self._calls
        while calls:
            callback, arg = calls.popleft()
            callback(arg)
        ready = self._ready
        while ready:
            outbox, waiter = ready.popleft()
            if waiter.done():
                continue
            drain = outbox.drain
            if drain is None or drain():
                waiter.set_result(None)
                continue
            # Sent inline; the handler stays parked. Re-publish its waiter, then re-check: an emit that came
            # while it was unpublished did not queue it (the same handshake as the bridge's ``_Stream.wait``).
            outbox.waiter = waiter
            if outbox.items:
                outbox.waiter = None
                ready.append((outbox, waiter))
