"""``TrioCalls``: a coroutine on the asyncio thread awaits a Trio task (the system port's engine routes reach
the sidecar this way, docs/lora.md#how-it-is-served)."""

from __future__ import annotations

import asyncio

import pytest
import trio

from trio_sidecar.core.errors import InvalidArgument
from trio_sidecar.dynamo.thread import AsyncioThread, TrioCalls


@pytest.fixture
async def thread():
    t = AsyncioThread()
    await t.start()
    try:
        yield t
    finally:
        await t.stop()


async def test_a_trio_call_from_the_loop_returns_its_result_and_raises_its_error(thread, nursery):
    calls = TrioCalls(trio.lowlevel.current_trio_token(), nursery)
    seen: list[object] = []

    async def on_trio(x: int) -> int:
        trio.lowlevel.current_task()  # raises outside Trio
        await trio.lowlevel.checkpoint()
        seen.append(x)
        return x * 2

    async def fails() -> None:
        raise InvalidArgument("refused")

    async def on_loop() -> tuple[int, str]:
        result = await calls.call(on_trio, 21)
        try:
            await calls.call(fails)
        except InvalidArgument as exc:
            return result, str(exc)
        raise AssertionError("no error")

    with trio.fail_after(10):
        assert await thread.run(on_loop) == (42, "refused")
    assert seen == [21]


async def test_cancelling_the_loop_caller_cancels_the_trio_task(thread, nursery):
    calls = TrioCalls(trio.lowlevel.current_trio_token(), nursery)
    started, cancelled = trio.Event(), trio.Event()

    async def forever() -> None:
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    async def on_loop() -> str:
        task = asyncio.ensure_future(calls.call(forever))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    with trio.fail_after(10):
        assert await thread.run(on_loop) == "cancelled"
        await cancelled.wait()
    assert started.is_set()


async def test_a_closed_nursery_fails_the_call_instead_of_hanging(thread):
    async with trio.open_nursery() as closed:
        calls = TrioCalls(trio.lowlevel.current_trio_token(), closed)

    async def never() -> None:
        raise AssertionError("ran")

    async def on_loop() -> str:
        try:
            await calls.call(never)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    with trio.fail_after(10):
        assert await thread.run(on_loop) == "the sidecar is not running"
