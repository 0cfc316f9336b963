"""Egress threads: push a request's frames past its inline window to Dynamo without ever blocking the loop
(see "Egress" in :mod:`.bridge`).

Dynamo 1.6.1's ``ResponseSender.send`` blocks its caller while the request's 128-frame response channel is
full (its consumer stopped reading), so frames past a request's inline window are sent from these daemon
threads.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["EGRESS_IDLE_EXIT", "EGRESS_MAX_THREADS", "Egress"]

# Egress threads: started on demand, so a stalled consumer parks one and never makes another request's late
# frames wait; at most this many at once (then frames queue for the next free one) ...
EGRESS_MAX_THREADS = 256
# ... and a thread idle for this long exits (seconds).
EGRESS_IDLE_EXIT = 30.0


class Egress:
    """Daemon threads that push a request's frames past its inline window (see "Egress" above).

    ``send`` may block while the request's response channel is full (a consumer that stopped reading):
    only an egress thread ever waits there, never the loop, until the consumer reads again or goes away
    (then ``send`` raises ``RuntimeError``). Each request has at most one frame in here at a time (its
    handler awaits the future), so its frames stay in order. Created on the first frame past a request's
    window.

    The pool is elastic: a frame queued while no thread is idle starts one more (up to ``max_threads``), so
    consumers that stalled at once each park their own thread and the other requests' frames still go out;
    a thread idle for ``idle_exit`` seconds exits. Daemon threads: one parked on a stalled consumer never
    holds up the process's exit.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        max_threads: int = EGRESS_MAX_THREADS,
        idle_exit: float = EGRESS_IDLE_EXIT,
    ) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], None], Any, asyncio.Future]] = queue.SimpleQueue()
        self._max_threads = max_threads
        self._idle_exit = idle_exit
        self._lock = threading.Lock()
        self._threads = 0  # running
        self._free = 0  # threads waiting for a job that no queued job is counted against
        self._backlog = 0  # jobs queued at the cap with no thread counted for them
        self._started = 0  # ever (thread names)

    @property
    def threads(self) -> int:
        return self._threads

    def send(self, send: Callable[[Any], None], out: Any) -> asyncio.Future:  # the loop's thread
        future = self._loop.create_future()
        self._jobs.put((send, out, future))
        with self._lock:
            if self._free:
                self._free -= 1  # a waiting thread takes it
                return future
            if self._threads >= self._max_threads:
                self._backlog += 1  # the next thread that is done takes it
                return future
            self._threads += 1
            self._started += 1
            name = f"dynamo-egress-{self._started}"
        threading.Thread(target=self._run, name=name, daemon=True).start()
        return future

    def _run(self) -> None:
        jobs = self._jobs
        while True:
            try:
                send, out, future = jobs.get(timeout=self._idle_exit)
            except queue.Empty:
                with self._lock:
                    if self._free and jobs.empty():  # (else a job came just now: take it)
                        self._free -= 1
                        self._threads -= 1
                        return
                continue
            try:
                send(out)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting handler
                self._resolve(future, exc)
            else:
                self._resolve(future, None)
            with self._lock:
                if self._backlog:
                    self._backlog -= 1  # this thread takes a job queued at the cap
                else:
                    self._free += 1

    def _resolve(self, future: asyncio.Future, exc: BaseException | None) -> None:
        try:
            self._loop.call_soon_threadsafe(_settle, future, exc)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
