"""The mock vLLM server on a thread of the calling process (its own Trio run), for plain (non-Trio) tests and
benchmarks that read its hooks (in-flight count, recorded requests) while processes drive it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["MockThread"]


class MockThread:
    """``open_mock_server`` on a background thread with its own Trio run.

    ``call(fn, *args)`` runs a synchronous function on that run's thread (thread-safe access to the hooks).
    """

    def __init__(self, **config: Any) -> None:
        self.config = config
        self.mock: Any = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mock-server", daemon=True)

    def start(self, timeout: float = 30.0) -> MockThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the mock server did not start")
        if self._error is not None:
            raise RuntimeError("the mock server failed to start") from self._error
        return self

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        from trio_sidecar.mock import MockConfig, open_mock_server

        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        async with open_mock_server(MockConfig(**{"listen": "127.0.0.1:0", **self.config})) as mock:
            self.mock = mock
            self._ready.set()
            await self._stop.wait()

    @property
    def address(self) -> str:
        return self.mock.address

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def active(self) -> int:
        return self.call(self.mock.active_request_count)

    def recorded(self) -> list[tuple[str, Any, tuple, Any]]:
        return self.call(lambda: list(self.mock.recorded_requests))

    def stop(self) -> None:
        stop = self._stop
        if self._token is not None and stop is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)
        if self._error is not None:
            raise self._error
