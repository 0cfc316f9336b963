"""Fixtures for the transport tests (peers live in ``transport_peers.py``).

Rules: every server binds 127.0.0.1 port 0; grpc.aio peers run on an asyncio loop in a background thread
(one per session); subprocess peers are killed by PID.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import pytest
import trio
from transport_peers import AioServer, AioThread, Recorder, TrioEcho

from trio_sidecar.transport import HealthServicer, open_channel, serve_grpc


@pytest.fixture(scope="session")
def aio() -> Iterator[AioThread]:
    thread = AioThread()
    yield thread
    thread.close()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def our_server(nursery: trio.Nursery, recorder: Recorder) -> Any:
    health = HealthServicer()
    server = await nursery.start(serve_grpc, [TrioEcho(recorder), health])
    server.health = health
    return server


@pytest.fixture
async def aio_server(aio: AioThread, recorder: Recorder) -> AsyncIterator[AioServer]:
    server = AioServer(aio, recorder)
    await server.start()
    yield server
    await server.stop()


@attrs.define
class Target:
    """A server for our client: ``kind`` is "ours" or "aio"."""

    kind: str
    port: int
    recorder: Recorder


@pytest.fixture(params=["ours", "aio"])
async def target(
    request: pytest.FixtureRequest, nursery: trio.Nursery, aio: AioThread, recorder: Recorder
) -> AsyncIterator[Target]:
    if request.param == "ours":
        server = await nursery.start(serve_grpc, [TrioEcho(recorder), HealthServicer()])
        yield Target("ours", server.port, recorder)
    else:
        server = AioServer(aio, recorder)
        await server.start()
        try:
            yield Target("aio", server.port, recorder)
        finally:
            await server.stop()


@pytest.fixture
async def channel(target: Target) -> AsyncIterator[Any]:
    async with open_channel("127.0.0.1", target.port) as ch:
        yield ch
