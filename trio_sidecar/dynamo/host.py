"""Trio as a guest on Dynamo's asyncio loop (docs/reference/worker.md#trio-as-a-guest-on-dynamos-loop).

Dynamo's Python bindings only work on asyncio, and every Dynamo object must be touched on the loop that
created it. So the process runs one uvloop loop (the one Dynamo's runtime is given) and Trio runs on it in
*guest mode* (``trio.lowlevel.start_guest_run``): Trio's scheduler ticks are callbacks of that loop, every
Trio task runs on the loop's thread, and the two sides call each other's synchronous APIs directly
(``trio.Event.set``, ``CancelScope.cancel``, ``nursery.start_soon`` from an asyncio callback;
``Future.set_result`` from a Trio task). Only Trio's own I/O wait happens on a helper thread of Trio's (when
no Trio task is runnable, it waits for the sockets there and hands the result back with
``call_soon_threadsafe``).

:func:`run_as_guest` owns the loop and the Trio run: the Trio function is the process's whole lifetime, and
it ends either way:

* Trio ends (returns or raises): the loop stops, and whatever asyncio tasks are left are cancelled by
  ``asyncio.Runner`` as it closes;
* the asyncio side ends the run first (the host task is cancelled, e.g. by ``asyncio.Runner`` on an
  unexpected ``KeyboardInterrupt``): the Trio run is cancelled as a whole and waited for, so its cleanup
  (``finally`` blocks, shielded teardown) still runs on the loop.

:class:`HostLoop` is how Trio code waits for asyncio work: :meth:`HostLoop.run` starts an asyncio task on
the same loop and parks the Trio task until it is done (no thread switch).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import trio

if TYPE_CHECKING:
    import outcome

__all__ = ["HostLoop", "run_as_guest"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.host")

T = TypeVar("T")


def run_as_guest(
    main: Callable[[HostLoop], Awaitable[T]],
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> T:
    """Run ``main(host)`` as a Trio guest on a new asyncio loop and return its result (or raise its error).

    ``loop_factory`` makes the loop (``asyncio.Runner``'s argument; None: asyncio's default loop).
    """
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_host(main))


async def _host(main: Callable[[HostLoop], Awaitable[T]]) -> T:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[outcome.Outcome[T]] = loop.create_future()
    host = HostLoop(loop)

    async def trio_main() -> T:
        with host._scope:
            return await main(host)
        raise RuntimeError("the Trio run was cancelled by its host loop")  # (only after _host cancelled it)

    def finished(result: outcome.Outcome[T]) -> None:
        if not done.done():
            done.set_result(result)

    trio.lowlevel.start_guest_run(
        trio_main,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=loop.call_soon,
        done_callback=finished,
        host_uses_signal_set_wakeup_fd=True,
        strict_exception_groups=True,
    )
    try:
        result = await asyncio.shield(done)
    except asyncio.CancelledError:
        # The host is going away first: end the Trio run as a whole, and let its cleanup run on this loop.
        host._scope.cancel()
        result = await done
        raise
    return result.unwrap()


class HostLoop:
    """The asyncio loop Trio runs on as a guest, seen from Trio (see :func:`run_as_guest`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._scope = trio.CancelScope()

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Schedule ``fn(*args)`` as a callback of the loop (never blocks)."""
        self.loop.call_soon(fn, *args)

    async def run(self, async_fn: Callable[..., Awaitable[T]], *args: object) -> T:
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
