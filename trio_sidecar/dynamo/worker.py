"""``trio-sidecar run``: serve a vLLM gRPC engine as a Dynamo 1.6.1 worker (docs/reference/worker.md#registration, docs/reference/worker.md#trio-as-a-guest-on-dynamos-loop).

Theory of operation
-------------------

One thread, one loop: the process runs the uvloop loop that Dynamo's runtime is given, and Trio runs on it as
a guest (:mod:`.host`). Every Dynamo object is created and touched on that loop (:class:`.runtime.DynamoSide`,
awaited from Trio with :meth:`HostLoop.run`); the handler and the sidecar exchange requests and chunks by
plain calls (:mod:`.bridge`). The worker's lifetime is one Trio nursery tree::

    asyncio.Runner (uvloop)
    └─ Trio guest run                      ends → the loop stops; the loop's task cancelled → the run is cancelled
       └─ signal watcher                   SIGINT/SIGTERM through the loop's signal handlers: cancel startup / drain
          └─ bootstrap discovery           (docs/reference/sidecar.md#bootstrap-phase) — before any Dynamo object exists
             └─ runtime                    DistributedRuntime, endpoint (docs/reference/worker.md#startup-sequence)
                └─ open_sidecar(expected=…)   the start phase, prober, abort sender, the requests' tasks
                   └─ bridge               the requests' egress tasks (:meth:`RequestBridge.run`)
                      registration         serve_endpoint, register_model, KvEventPublisher per source
                      health supervisor    unregister/re-register on NOT_SERVING (docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/sidecar.md#recovery)
                      wait                 for the shutdown request, a fatal prober error or a dead runtime

Shutdown (docs/reference/sidecar.md#lifecycle, docs/reference/worker.md#graceful-shutdown-and-drain):
``runtime.shutdown()`` (unregisters the instance at once, then the runtime drains in-flight handlers), the
engine stops admitting, wait for ``serve_endpoint``'s future and the engine's in-flight requests for up to
``drain_timeout`` — after it, the engine cancels every remaining request (it ends with its cancelled chunk
and an Abort is queued) — then leave the bridge and ``open_sidecar`` (cleanup), shut the runtime down, and
end the Trio run, which stops the loop. A second SIGINT/SIGTERM exits 1 at once.

Exit codes (docs/reference/sidecar.md#exit-codes): 0 after a graceful shutdown (also when the signal arrives during startup,
with the log line ``runtime shut down during sidecar initialization``); 1 for a startup failure (printed
as ``error: {message}``), a fatal identity change after recovery, or a runtime that stopped by itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from ..config import SidecarConfig, WorkerOptions
from ..errors import SidecarError, format_duration
from ..transport import collapse_single_exception
from .bridge import RequestBridge
from .host import HostLoop, run_as_guest
from .plan import WorkerPlan, endpoint_path, plan_registration
from .reporter import Reporter
from .runtime import DynamoSide

if TYPE_CHECKING:
    from ..api import Sidecar
    from ..model import DiscoveredModel
    from ..routing import KvEventSource

__all__ = ["run_worker", "exit_on_late_signals"]

T = TypeVar("T")

LOGGER = logging.getLogger("trio_sidecar.dynamo.worker")

INIT_SHUTDOWN = "runtime shut down during sidecar initialization"
# After the drain bound, stopped requests end promptly; this bounds the wait for the runtime's own drain.
STOP_GRACE = 10.0


# --- the Trio orchestration ---------------------------------------------------------------------------------


class _Shutdown:
    """Signal state shared by the watcher and the main flow.

    While a startup step runs, the first signal cancels it (:meth:`startup`); once serving, it requests
    the graceful shutdown (``requested``). The second signal always exits 1 at once.
    """

    def __init__(self) -> None:
        self.requested = trio.Event()
        self._startup_scope: trio.CancelScope | None = None
        self.signals = 0

    def startup(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self.requested.is_set():
            scope.cancel()
        self._startup_scope = scope
        return scope

    def end_startup(self) -> None:
        self._startup_scope = None

    def on_signal(self, signum: int) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals > 1:
            sys.stderr.write(f"received {name} again; exiting immediately\n")
            sys.stderr.flush()
            os._exit(1)
        LOGGER.info("received %s; shutting down", name)
        self.requested.set()
        if self._startup_scope is not None:
            self._startup_scope.cancel()


async def _watch_signals(state: _Shutdown, host: HostLoop, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """SIGINT/SIGTERM go to ``state.on_signal``: the host loop owns signal handling (Trio is its guest), and
    its callback runs on the thread Trio runs on."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        host.loop.add_signal_handler(signum, state.on_signal, signum)
    task_status.started()
    await trio.sleep_forever()


def _print_error(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def run_worker(config: SidecarConfig, options: WorkerOptions) -> int:
    """Run ``trio-sidecar run`` until SIGINT/SIGTERM.

    The caller (``trio_sidecar.cli``) has already run the pre-network checks and printed the discovery
    banner.

    Returns:
        The process exit code: 0 after a graceful shutdown, 1 after a startup or fatal runtime failure
        (the message is printed as ``error: {message}``).
    """
    try:
        return run_as_guest(functools.partial(_main, config, options), loop_factory=_loop_factory())
    finally:
        exit_on_late_signals()


def exit_on_late_signals() -> None:
    """Make any SIGINT/SIGTERM from now on exit 1 at once.

    After the Trio run, the process still tears down Dynamo's runtime at interpreter exit (~250 ms), when
    Trio's signal receiver is gone: a signal then would get the default action (killed by SIGTERM, or a
    KeyboardInterrupt traceback) instead of the "second signal exits 1" of docs/reference/sidecar.md#exit-codes.
    """

    def exit_now(signum: int, _frame: object) -> None:
        os.write(2, f"received {signal.Signals(signum).name} again; exiting immediately\n".encode())
        os._exit(1)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, exit_now)


async def _main(config: SidecarConfig, options: WorkerOptions, host: HostLoop) -> int:
    state = _Shutdown()
    reporter = Reporter()
    async with trio.open_nursery() as root:
        await root.start(_watch_signals, state, host)
        try:
            return await _run(config, options, state, reporter, host)
        finally:
            root.cancel_scope.cancel()


async def _run(config: SidecarConfig, options: WorkerOptions, state: _Shutdown, reporter: Reporter,
               thread: HostLoop) -> int:
    from ..api import discover

    with state.startup() as scope:
        reporter.phase("bootstrap discovery", config.startup_deadline)
        try:
            bootstrap = await discover(config)
        except SidecarError as exc:
            _print_error(str(exc))
            return 1
        reporter.phase_done("bootstrap discovery")
    if scope.cancelled_caught:
        LOGGER.info(INIT_SHUTDOWN)
        return 0

    dynamo = DynamoSide(options)
    try:
        return await _run_with_runtime(config, options, state, reporter, thread, dynamo, bootstrap,
                                       endpoint_path(config, options))
    finally:
        with trio.CancelScope(shield=True):
            await _stop_runtime(thread, dynamo)


async def _run_with_runtime(
    config: SidecarConfig,
    options: WorkerOptions,
    state: _Shutdown,
    reporter: Reporter,
    thread: HostLoop,
    dynamo: DynamoSide,
    bootstrap: DiscoveredModel,
    path: str,
) -> int:
    from ..api import open_sidecar

    with state.startup() as scope:
        reporter.phase("starting the Dynamo runtime")
        try:
            await thread.run(dynamo.create_runtime, path)
        except Exception as exc:  # noqa: BLE001 - Dynamo raises plain exceptions
            _print_error(f"failed to start the Dynamo runtime: {exc}")
            return 1
        reporter.phase_done("starting the Dynamo runtime")
    if scope.cancelled_caught:
        LOGGER.info(INIT_SHUTDOWN)
        return 0

    code = 0
    with state.startup() as scope:
        reporter.phase("start phase", config.startup_deadline)
        try:
            with collapse_single_exception():
                async with open_sidecar(config, expected=bootstrap) as sidecar:
                    reporter.phase_done("start phase")
                    bridge = RequestBridge(sidecar.submit)
                    async with trio.open_nursery() as requests:
                        await requests.start(bridge.run)
                        code = await _register_and_serve(config, options, state, reporter, thread, dynamo,
                                                         bridge, sidecar)
                        requests.cancel_scope.cancel()
        except SidecarError as exc:
            _print_error(str(exc))
            return 1
        except Exception as exc:  # noqa: BLE001 - registration errors come from Dynamo as plain exceptions
            _print_error(str(exc) or repr(exc))
            return 1
    if scope.cancelled_caught:
        LOGGER.info(INIT_SHUTDOWN)
        return 0
    return code


async def _register_and_serve(
    config: SidecarConfig,
    options: WorkerOptions,
    state: _Shutdown,
    reporter: Reporter,
    thread: HostLoop,
    dynamo: DynamoSide,
    bridge: RequestBridge,
    sidecar: Sidecar,
) -> int:
    sources = tuple(sidecar.kv_event_sources)
    plan = plan_registration(config, options, sidecar.engine_config, sources)
    reporter.phase("registering with Dynamo")
    await thread.run(dynamo.serve_and_register, plan, bridge.handler)
    count = await thread.run(dynamo.replace_publishers, plan, sources)
    await thread.run(dynamo.set_ready, True)
    reporter.phase_done("registering with Dynamo")
    if count:
        LOGGER.info("relaying KV events from %d vLLM source(s) to the router", count)
    reporter.model_table(sidecar.model, sidecar.engine_config, plan, sources)

    state.end_startup()  # from here on, the first signal requests the graceful shutdown
    reporter.ready(plan)
    runtime_ended = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_supervise_health, options, thread, dynamo, sidecar, plan, sources)
        nursery.start_soon(_watch_serving, thread, dynamo, runtime_ended)
        async with trio.open_nursery() as wait_any:
            for event in (state.requested, runtime_ended):
                wait_any.start_soon(_set_when, event, wait_any.cancel_scope)
        nursery.cancel_scope.cancel()
    if not state.requested.is_set():
        _print_error("the Dynamo runtime stopped serving the endpoint")
        return 1
    await _drain(options, thread, dynamo, sidecar)
    return 0


async def _set_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _watch_serving(thread: HostLoop, dynamo: DynamoSide, ended: trio.Event) -> None:
    try:
        await thread.run(dynamo.wait_serving_ended)
    except Exception as exc:  # noqa: BLE001
        LOGGER.error("serve_endpoint failed: %s", exc)
    ended.set()


async def _drain(options: WorkerOptions, thread: HostLoop, dynamo: DynamoSide, sidecar: Sidecar) -> None:
    """Graceful shutdown: unregister at once, drain up to ``drain_timeout``, then stop the rest (docs/reference/worker.md#graceful-shutdown-and-drain).

    Admission and the in-flight requests are the engine's: it refuses new requests from here on
    (``EngineShutdown``, which the frontend migrates), and its in-flight count is what the drain waits for.
    """
    engine = sidecar.engine
    LOGGER.info("draining %d in-flight request(s) (up to %s)", engine.in_flight,
                format_duration(options.drain_timeout))
    await thread.run(dynamo.shutdown)
    engine.stop_admission()
    with trio.move_on_after(options.drain_timeout) as drain:
        await thread.run(dynamo.wait_serving_ended)
        await engine.wait_idle()
    if drain.cancelled_caught:
        stopped = engine.in_flight
        engine.cancel_in_flight()
        LOGGER.warning("drain timeout reached; cancelling %d remaining request(s)", stopped)
        with trio.move_on_after(STOP_GRACE):
            await engine.wait_idle()
            await thread.run(dynamo.wait_serving_ended)


async def _supervise_health(
    options: WorkerOptions,
    thread: HostLoop,
    dynamo: DynamoSide,
    sidecar: Sidecar,
    plan: WorkerPlan,
    sources: tuple[KvEventSource, ...],
) -> None:
    """Take the instance out of rotation while vLLM is not serving (docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/sidecar.md#recovery).

    After ``unserving_grace`` of continuous non-SERVING state, ``unregister_endpoint_instance()``; on
    recovery (the prober only returns to SERVING after re-checking identity and DP size),
    ``register_endpoint_instance()``. Changed KV-event sources re-create the publishers. The model card is
    kept throughout.
    """
    health = sidecar.health
    registered = True
    while True:
        await health.wait_value(lambda s: not s.admits)
        with trio.move_on_after(options.unserving_grace) as grace:
            await health.wait_value(lambda s: s.admits)
        if grace.cancelled_caught:
            reason = health.value.reason
            LOGGER.warning(
                "vLLM has not been serving for %s (%s); taking the instance out of rotation",
                format_duration(options.unserving_grace),
                reason,
            )
            try:
                await thread.run(dynamo.unregister)
                registered = False
            except Exception as exc:  # noqa: BLE001
                LOGGER.error("unregister_endpoint_instance failed: %s", exc)
            await health.wait_value(lambda s: s.admits)
        current = tuple(sidecar.kv_event_sources)
        if current != sources:
            LOGGER.warning("vLLM KV-event sources changed after recovery; re-creating the KV publishers")
            try:
                await thread.run(dynamo.replace_publishers, plan, current)
                sources = current
            except Exception as exc:  # noqa: BLE001
                LOGGER.error("re-creating the KV publishers failed: %s", exc)
        if not registered:
            try:
                await thread.run(dynamo.register)
                registered = True
                LOGGER.info("vLLM is serving again; the instance is back in rotation")
            except Exception as exc:  # noqa: BLE001
                LOGGER.error("register_endpoint_instance failed: %s", exc)


async def _stop_runtime(thread: HostLoop, dynamo: DynamoSide) -> None:
    """Idempotent final teardown: publishers, ``runtime.shutdown()``, the serve future."""
    try:
        with trio.move_on_after(STOP_GRACE):
            await thread.run(_call_sync, dynamo.shutdown_publishers)
            await thread.run(dynamo.shutdown)
            await thread.run(dynamo.wait_serving_ended)
    except Exception:  # noqa: BLE001 - the runtime is going away regardless
        LOGGER.debug("Dynamo runtime shutdown failed", exc_info=True)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop for the asyncio thread, like Dynamo's own Python workers (``uvloop.run``).

    ``ai-dynamo-runtime`` depends on uvloop. Dynamo's bindings call ``call_soon_threadsafe`` and
    ``create_future`` on this loop from tokio threads for every request; uvloop's are C, asyncio's are
    Python frames run under the GIL on those threads. Without uvloop, the default asyncio loop is used.
    """
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _call_sync(fn: Callable[[], T]) -> T:
    return fn()
