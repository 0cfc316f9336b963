"""Shared test configuration.

Area fixtures live next to their tests (``tests/<area>/conftest.py``). Every server in a test binds
127.0.0.1 on port 0 and is started with ``nursery.start`` (or a subprocess killed by PID).

Every test has a deadline: 60 s (``TRIO_SIDECAR_TEST_TIMEOUT``), 300 s for a test marked ``slow`` or
``real_vllm`` (``TRIO_SIDECAR_SLOW_TEST_TIMEOUT``), or its own ``@pytest.mark.timeout(seconds)`` for a test
that legitimately takes longer (docs/contributing.md). A test that hangs fails with its name and what it was
waiting for, instead of blocking the suite:

- a Trio test runs beside a watchdog task (pytest-trio takes the runner from the ``trio(run=...)`` marker
  this file puts first), woken by a real-time timer thread, so the ``autojump_clock`` neither fires nor hides
  it; past the deadline it cancels the test and fails it with each Trio task and the line it is suspended at;
- a synchronous test gets ``SIGALRM``, whose handler fails the test with the main thread's stack.

The deadline covers the test body and, for a Trio test, its async fixtures; not the module- or
session-scoped servers (their own start-up waits are bounded where they are written).
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import threading
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import trio

TEST_TIMEOUT_S = float(os.environ.get("TRIO_SIDECAR_TEST_TIMEOUT", "60"))
SLOW_TEST_TIMEOUT_S = float(os.environ.get("TRIO_SIDECAR_SLOW_TEST_TIMEOUT", "300"))
_REPO = str(Path(__file__).resolve().parents[1])
_WATCHDOG = "test deadline watchdog"


class TestTimedOut(AssertionError):
    """A test ran past its deadline."""

    __test__ = False  # not a test class, whatever pytest's name pattern says


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"timeout(seconds): this test's deadline instead of the default {TEST_TIMEOUT_S:g}s "
        f"({SLOW_TEST_TIMEOUT_S:g}s for a slow test)",
    )


def _deadline(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        return float(marker.args[0])
    if item.get_closest_marker("slow") is not None or item.get_closest_marker("real_vllm") is not None:
        return SLOW_TEST_TIMEOUT_S
    return TEST_TIMEOUT_S


def _is_trio_test(item: pytest.Item) -> bool:
    return isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj)


# The long reliability, scale and stress suites: `make test-fast` leaves them out (`-m "not slow"`).
SLOW_MODULES = frozenset(
    {
        "tests/reliability/test_scale.py",
        "tests/reliability/test_health_flaps.py",
        "tests/reliability/test_mock_restart.py",
        "tests/reliability/test_slow_consumer.py",
        "tests/reliability/test_hung_engine.py",
        "tests/reliability/test_hostile_peers.py",
        "tests/reliability/test_mock_process_load.py",
        "tests/transport/test_transport_stress.py",
        "tests/sidecar/test_sidecar_stress.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if os.path.relpath(item.path, _REPO) in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        # pytest-trio takes the runner from the closest `trio(run=...)` marker; this one goes first.
        if _is_trio_test(item):
            item.add_marker(pytest.mark.trio(run=functools.partial(_run_with_deadline, item)), append=False)


def _where(frames: list[tuple[FrameType, int]]) -> str:
    """The innermost frame in this repository (the test's or the package's own code), else the innermost."""
    described = [(frame.f_code.co_filename, lineno, frame.f_code.co_name) for frame, lineno in frames]
    ours = [entry for entry in described if entry[0].startswith(_REPO) and "/.venv/" not in entry[0]]
    if not described:
        return "(not started)"
    path, lineno, name = (ours or described)[-1]
    return f"{os.path.relpath(path, _REPO) if ours else Path(path).name}:{lineno} in {name}"


def describe_trio_tasks(test_task: trio.lowlevel.Task) -> str:
    """The test's task and every task below it, indented by nursery, with where each is suspended."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        if task.name != _WATCHDOG:
            lines.append(f"{'  ' * depth}{task.name}: {_where(list(task.iter_await_frames()))}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    walk(test_task, 1)
    return "\n".join(lines)


def _run_with_deadline(item: pytest.Item, test: Callable[[], Awaitable[object]], **run_options: Any) -> object:
    """``trio.run(test)``, with a watchdog task that fails the test once its real-time deadline passes."""
    limit = _deadline(item)
    timed_out: list[str] = []

    async def guarded() -> object:
        expired = trio.Event()
        token = trio.lowlevel.current_trio_token()
        test_task = trio.lowlevel.current_task()

        def fire() -> None:
            try:
                token.run_sync_soon(expired.set)
            except trio.RunFinishedError:
                pass

        async def watch(scope: trio.CancelScope) -> None:
            await expired.wait()
            timed_out.append(describe_trio_tasks(test_task))
            scope.cancel()

        timer = threading.Timer(limit, fire)
        timer.daemon = True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope, name=_WATCHDOG)
                timer.start()
                result = await test()
                nursery.cancel_scope.cancel()
                return result
        finally:
            timer.cancel()

    result = trio.run(guarded, **run_options)
    if timed_out:
        raise TestTimedOut(
            f"{item.nodeid} did not finish within {limit:g}s; its Trio tasks were waiting at:\n{timed_out[0]}"
        )
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if _is_trio_test(item) or threading.current_thread() is not threading.main_thread():
        yield
        return
    limit = _deadline(item)

    def expire(signum: int, frame: object) -> None:
        stack = "".join(traceback.format_stack(frame)[-2:])  # type: ignore[arg-type]  # a frame from the handler
        raise TestTimedOut(f"{item.nodeid} did not finish within {limit:g}s; it was waiting at:\n{stack}")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
