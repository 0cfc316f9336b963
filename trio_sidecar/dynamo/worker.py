"""``trio-sidecar run``: serve a vLLM gRPC engine as a Dynamo 1.6.1 worker (docs/reference/worker.md#registration, docs/reference/worker.md#the-asyncio-thread-bridge).

Theory of operation
-------------------

Trio owns the process. Dynamo's runtime lives on one asyncio thread (:mod:`.bridge`); every Dynamo object
is created and touched only there, through :meth:`AsyncioThread.run`. Lifetimes nest like this::

    trio.run
    └─ signal watcher                      first signal: cancel startup / begin the graceful shutdown
       └─ bootstrap discovery              (docs/reference/sidecar.md#bootstrap-phase) — before any Dynamo object exists
          └─ asyncio thread + runtime      DistributedRuntime, endpoint (docs/reference/worker.md#startup-sequence)
             └─ open_sidecar(expected=…)   the start phase (docs/reference/sidecar.md#start-phase, docs/reference/sidecar.md#identity-check), prober, abort sender
                └─ request nursery         the bridge's dispatcher (requests are the engine's tasks)
                   registration            serve_endpoint, register_model, metrics callbacks, KvEventPublisher per source
                   health supervisor       unregister/re-register on NOT_SERVING (docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/sidecar.md#recovery)
                   wait                    for the shutdown request, a fatal prober error or a dead runtime

Shutdown (docs/reference/sidecar.md#lifecycle, docs/reference/worker.md#graceful-shutdown-and-drain):
``runtime.shutdown()`` on the loop (unregisters the instance at once, then the runtime drains in-flight
handlers), the engine stops admitting, wait for ``serve_endpoint``'s future and the engine's in-flight
requests for up to ``drain_timeout`` — after it, the engine cancels every remaining request (it ends with its
cancelled chunk and an Abort is queued) — then leave ``open_sidecar`` (cleanup), stop the loop, join the
thread. A second SIGINT/SIGTERM exits 1 at once.

Exit codes (docs/reference/sidecar.md#exit-codes, docs/deployment.md "Exit codes and signals"): 0 after a
graceful shutdown; 1 for a startup failure (printed as
``error: {message}; hint: ...``), a fatal identity change after recovery, or a runtime that stopped by
itself; 128 + the signal number (130, 143) when SIGINT/SIGTERM arrives before the worker serves — one line
``received SIGTERM during {phase}: runtime shut down during sidecar initialization; ...`` and the process
ends within 1.5 s even if Dynamo's runtime is stuck (e.g. waiting for an etcd that is not running).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from .._logging import emit, notice, print_error
from .._signals import SIGNALS, held, hold_signals, interrupted_code
from ..core.config import SidecarConfig, WorkerOptions
from ..core.errors import SidecarError, format_duration
from ..core.health_policy import ArmTimer, CancelTimer, HealthState, Timer, TimerFired
from ..core.rl_requests import parse_admin_base_url, rl_endpoint_name, rl_world_size, system_port_required
from ..shell.diagnostics import startup_hint
from ..shell.progress import StartupProgress, tracking
from ..transport import collapse_single_exception
from .bridge import RequestBridge
from .lora_routes import publish_held, start_lora
from .plan import WorkerPlan, endpoint_path, plan_registration
from .reporter import Reporter
from .rl_routes import RlSurface
from .rotation import (
    HealthChanged,
    PublishersReplaced,
    ReplacePublishers,
    RestoreToRotation,
    RotationAction,
    RotationDone,
    RotationEvent,
    RotationPolicy,
    TakeOutOfRotation,
)
from .runtime import DynamoSide
from .thread import AsyncioThread, TrioCalls

if TYPE_CHECKING:
    from ..api import Sidecar
    from ..core.model import DiscoveredModel
    from ..core.routing import KvEventSource

__all__ = ["run_worker", "exit_on_late_signals"]

T = TypeVar("T")

LOGGER = logging.getLogger("trio_sidecar.dynamo.worker")

INIT_SHUTDOWN = "runtime shut down during sidecar initialization"
# A signal before serving ends the process within this bound even when Dynamo's runtime does not return
# (e.g. it waits for an etcd that is not running and ignores cancellation).
INTERRUPT_EXIT_BOUND = 1.5
# After the drain bound, stopped requests end promptly; this bounds the wait for the runtime's own drain.
STOP_GRACE = 10.0


# --- the Trio orchestration ---------------------------------------------------------------------------------


class _Shutdown:
    """Signal state shared by the watcher and the main flow.

    Before serving, the first signal cancels the running startup step (:meth:`startup`), prints one line
    and ends the process with 128 + the signal number, within :data:`INTERRUPT_EXIT_BOUND` even if Dynamo's
    runtime does not return; once serving, it requests the graceful shutdown (``requested``). The second
    signal always exits 1 at once.
    """

    def __init__(self) -> None:
        self.requested = trio.Event()
        self._startup_scope: trio.CancelScope | None = None
        self.signals = 0
        self.serving = False
        self.phase = "startup"
        self.interrupted: int | None = None  # the exit code when a signal arrived before serving

    def startup(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self.requested.is_set():
            scope.cancel()
        self._startup_scope = scope
        return scope

    def end_startup(self) -> None:
        self._startup_scope = None
        self.serving = True

    def on_signal(self, signum: int) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals > 1:
            notice(f"received {name} again; exiting immediately")
            os._exit(1)
        self.requested.set()
        if self.serving:
            LOGGER.info("received %s; shutting down", name)
            return
        code = interrupted_code(signum)
        self.interrupted = code
        emit(f"received {name} during {self.phase}: {INIT_SHUTDOWN}; exiting with code {code}", name=LOGGER.name)
        _exit_after(INTERRUPT_EXIT_BOUND, code)
        if self._startup_scope is not None:
            self._startup_scope.cancel()


def _exit_after(delay: float, code: int) -> None:
    """End the process with ``code`` after ``delay`` unless it has exited by then (a daemon timer)."""

    def exit_now() -> None:
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(delay, exit_now)
    timer.daemon = True
    timer.start()


async def _watch_signals(state: _Shutdown, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(*SIGNALS) as receiver:
        task_status.started()
        for signum in held():  # arrived between the CLI's hand-over and this receiver
            state.on_signal(signum)
        async for signum in receiver:
            state.on_signal(signum)


def _print_error(message: str) -> None:
    print_error(message, hint=startup_hint(message))


def run_worker(config: SidecarConfig, options: WorkerOptions) -> int:
    """Run ``trio-sidecar run`` until SIGINT/SIGTERM.

    The caller (``trio_sidecar.cli``) has already run the pre-network checks and printed the discovery
    banner.

    Returns:
        The process exit code: 0 after a graceful shutdown; 1 after a startup or fatal runtime failure (the
        message is printed as ``error: {message}``, with a hint when there is one); 128 + the signal
        number (130 for SIGINT, 143 for SIGTERM) when a signal arrived before the worker served.
    """
    hold_signals()
    try:
        return trio.run(_main, config, options)
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


async def _main(config: SidecarConfig, options: WorkerOptions) -> int:
    state = _Shutdown()
    reporter = Reporter()
    async with trio.open_nursery() as root:
        await root.start(_watch_signals, state)
        try:
            return await _run(config, options, state, reporter)
        finally:
            root.cancel_scope.cancel()


async def _run(config: SidecarConfig, options: WorkerOptions, state: _Shutdown, reporter: Reporter) -> int:
    from ..api import discover
    from ..core.endpoint import parse_grpc_endpoint

    vllm = f"vLLM at {parse_grpc_endpoint(config.grpc_endpoint).canonical}"
    with state.startup() as scope:
        state.phase = "bootstrap discovery"
        reporter.phase(state.phase, config.startup_deadline)
        try:
            with tracking(StartupProgress()) as progress:
                async with reporter.waiting(vllm, config.startup_deadline, progress=progress):
                    bootstrap = await discover(config)
            if options.enable_rl:
                # As native: the RL worker's world size is checked on the bootstrap model, before Dynamo (the
                # start phase's parallelism is the same, so _start_rl derives the same value).
                rl_world_size(bootstrap.server_info, options.vllm_rl_world_size)
        except SidecarError as exc:
            _print_error(str(exc))
            return 1
        reporter.phase_done(state.phase)
    if scope.cancelled_caught:
        return _interrupted(state)

    thread = AsyncioThread(loop_factory=_loop_factory())
    dynamo = DynamoSide(options)
    await thread.start()
    try:
        return await _run_with_runtime(
            config, options, state, reporter, thread, dynamo, bootstrap, endpoint_path(config, options), vllm
        )
    finally:
        with trio.CancelScope(shield=True):
            await _stop_runtime(thread, dynamo)


def _interrupted(state: _Shutdown) -> int:
    """The exit code after a signal cancelled a startup step (the notice was printed when it arrived)."""
    assert state.interrupted is not None
    return state.interrupted


def _runtime_hint(options: WorkerOptions) -> str | None:
    if options.discovery_backend == "etcd":
        return (
            "the etcd discovery backend needs a reachable etcd (ETCD_ENDPOINTS); "
            "for one host use --discovery-backend file"
        )
    if options.discovery_backend == "kubernetes":
        return "the kubernetes discovery backend needs the Kubernetes API"
    return None


async def _run_with_runtime(
    config: SidecarConfig,
    options: WorkerOptions,
    state: _Shutdown,
    reporter: Reporter,
    thread: AsyncioThread,
    dynamo: DynamoSide,
    bootstrap: DiscoveredModel,
    endpoint_path: str,
    vllm: str,
) -> int:
    from ..api import open_sidecar
    from .prerequisites import PrerequisiteUnreachable, prerequisites, wait_reachable

    for needed in prerequisites(options):
        with state.startup() as scope:
            state.phase = f"{needed.name} check"
            reporter.phase(state.phase, needed.timeout)
            try:
                with tracking(StartupProgress()) as progress:
                    async with reporter.waiting(
                        f"{needed.name} at {', '.join(needed.urls)}",
                        needed.timeout,
                        progress=progress,
                        hint=needed.hint,
                    ):
                        await wait_reachable(needed)
            except PrerequisiteUnreachable as exc:
                print_error(str(exc), hint=needed.hint)
                return 1
            reporter.phase_done(state.phase)
        if scope.cancelled_caught:
            return _interrupted(state)

    with state.startup() as scope:
        state.phase = "Dynamo runtime start"
        reporter.phase(state.phase)
        try:
            async with reporter.waiting(
                f"Dynamo's runtime (discovery backend {options.discovery_backend})", hint=_runtime_hint(options)
            ):
                await thread.run(dynamo.create_runtime, endpoint_path)
        except Exception as exc:  # noqa: BLE001 - Dynamo raises plain exceptions
            _print_error(f"failed to start the Dynamo runtime: {exc}")
            return 1
        reporter.phase_done(state.phase)
    if scope.cancelled_caught:
        return _interrupted(state)

    bridge = RequestBridge(
        thread,
        bind_context=lambda context, request: dynamo.prefill_completion.bind(context, request),
        # Dynamo's reasoning parser counts reasoning_tokens per output: one per vLLM message, as native sends
        # them, keeps the count exact (docs/reference/worker.md#parsers).
        merge=options.reasoning_parser is None,
    )
    code = 0
    with state.startup() as scope:
        state.phase = "start phase"
        reporter.phase(state.phase, config.startup_deadline)
        try:
            with collapse_single_exception():
                with tracking(StartupProgress()) as progress:
                    async with reporter.waiting(vllm, config.startup_deadline, progress=progress) as waiting:
                        started = trio.current_time()
                        async with open_sidecar(config, expected=bootstrap) as sidecar:
                            dynamo.lifecycle.model_load_time_seconds = trio.current_time() - started
                            await waiting.stop()
                            reporter.phase_done(state.phase)
                            async with trio.open_nursery() as requests:
                                requests.start_soon(
                                    bridge.run_dispatcher, functools.partial(sidecar.submit, merge=bridge.merge)
                                )
                                code = await _register_and_serve(
                                    config, options, state, reporter, thread, dynamo, bridge, sidecar, requests
                                )
                                requests.cancel_scope.cancel()
                            cleanup_started = trio.current_time()
                        dynamo.lifecycle.cleanup_time_seconds = trio.current_time() - cleanup_started
        except SidecarError as exc:
            _print_error(str(exc))
            return 1
        except Exception as exc:  # noqa: BLE001 - registration errors come from Dynamo as plain exceptions
            _print_error(str(exc) or repr(exc))
            return 1
    if scope.cancelled_caught:
        return _interrupted(state)
    return code


async def _register_and_serve(
    config: SidecarConfig,
    options: WorkerOptions,
    state: _Shutdown,
    reporter: Reporter,
    thread: AsyncioThread,
    dynamo: DynamoSide,
    bridge: RequestBridge,
    sidecar: Sidecar,
    requests: trio.Nursery,
) -> int:
    sources = tuple(sidecar.kv_event_sources)
    plan = plan_registration(
        config, options, sidecar.engine_config, sources, supports_multimodal=sidecar.model.supports_multimodal
    )
    state.phase = "registration with Dynamo"
    reporter.phase(state.phase)
    # Before registering, as native: its outcome is logged even when registration then fails.
    await thread.run(dynamo.resolve_image_token_id, plan.model_path, sidecar.model.supports_multimodal)
    # The LoRA and RL engine routes go in before the model is listed, so a client that saw it can manage
    # adapters and pause it (docs/lora.md, docs/rl.md).
    lora = await start_lora(thread, dynamo, plan, sidecar, requests)
    rl = await _start_rl(options, thread, dynamo, plan, sidecar, requests, lora=lora)
    await thread.run(dynamo.serve_and_register, plan, bridge.handler)
    if lora:
        await publish_held(sidecar.lora)
    if rl is not None:
        await thread.run(dynamo.serve_rl_endpoint, rl.endpoint_path, rl.rl_handler)
        LOGGER.info("serving the RL routes on %s: %s", rl.endpoint_path, ", ".join(rl.routes))
    try:
        await thread.run(dynamo.register_metrics, plan, sidecar.stats)
    except Exception as exc:  # noqa: BLE001 - metrics must not keep the worker from serving
        LOGGER.error("registering the metrics callbacks on endpoint.metrics failed: %s", exc)
    count = await thread.run(dynamo.replace_publishers, plan, sources)
    await thread.run(dynamo.set_ready, True)
    reporter.phase_done(state.phase)
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


async def _start_rl(
    options: WorkerOptions,
    thread: AsyncioThread,
    dynamo: DynamoSide,
    plan: WorkerPlan,
    sidecar: Sidecar,
    nursery: trio.Nursery,
    *,
    lora: bool,
) -> RlSurface | None:
    """Register the engine routes of the RL controls (always, like the native sidecar); with ``--enable-rl``
    return the surface whose ``rl`` endpoint is to be served (``DYN_RL_ENDPOINT`` renames it), else None.

    ``lora``: whether the LoRA surface is on (its three routes are then listed with these).

    Raises:
        InvalidArgument: ``RL endpoint configuration: …`` (a bad ``DYN_RL_ENDPOINT``, or no system server).
    """
    endpoint_path = None
    if options.enable_rl:
        name = rl_endpoint_name(os.environ)
        if not await thread.run(_call_sync, dynamo.system_url):
            raise system_port_required()
        endpoint_path = f"{plan.endpoint_path.rsplit('.', 1)[0]}.{name}"
    surface = RlSurface(
        dynamo,
        sidecar,
        TrioCalls(trio.lowlevel.current_trio_token(), nursery),
        lora=lora,
        world_size=rl_world_size(sidecar.model.server_info, options.vllm_rl_world_size),
        admin_base_url=parse_admin_base_url(options.vllm_http_endpoint) if options.vllm_http_endpoint else None,
        endpoint_path=endpoint_path,
    )
    await thread.run(_call_sync, lambda: dynamo.register_engine_routes(surface.callbacks()))
    return surface if endpoint_path is not None else None


async def _set_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _watch_serving(thread: AsyncioThread, dynamo: DynamoSide, ended: trio.Event) -> None:
    try:
        await thread.run(dynamo.wait_serving_ended)
    except Exception as exc:  # noqa: BLE001
        LOGGER.error("serve_endpoint failed: %s", exc)
    ended.set()


async def _drain(options: WorkerOptions, thread: AsyncioThread, dynamo: DynamoSide, sidecar: Sidecar) -> None:
    """Graceful shutdown: unregister at once, drain up to ``drain_timeout``, then stop the rest (docs/reference/worker.md#graceful-shutdown-and-drain).

    Admission, the in-flight requests and the drain are the engine's (``SidecarEngine.drain``): it refuses
    new requests from here on (``EngineShutdown``, which the frontend migrates), waits for the in-flight ones,
    then stops the rest; the runtime's ``serve_endpoint`` then ends once its handlers sent their last chunk.
    """
    engine = sidecar.engine
    started = trio.current_time()
    LOGGER.info("draining %d in-flight request(s) (up to %s)", engine.in_flight, format_duration(options.drain_timeout))
    await thread.run(dynamo.shutdown)
    await engine.drain(options.drain_timeout, grace=STOP_GRACE)
    with trio.move_on_after(STOP_GRACE):
        await thread.run(dynamo.wait_serving_ended)
    dynamo.lifecycle.drain_time_seconds = trio.current_time() - started


async def _supervise_health(
    options: WorkerOptions,
    thread: AsyncioThread,
    dynamo: DynamoSide,
    sidecar: Sidecar,
    plan: WorkerPlan,
    sources: tuple[KvEventSource, ...],
) -> None:
    """Take the instance out of rotation while vLLM is not serving (docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/sidecar.md#recovery).

    The I/O adapter of :class:`~trio_sidecar.dynamo.rotation.RotationPolicy`: every change of the prober's
    published state goes in, and its actions are carried out on the asyncio thread. After
    ``unserving_grace`` of continuous non-SERVING state, ``unregister_endpoint_instance()``; on recovery (the
    prober only returns to SERVING after re-checking identity and DP size), ``register_endpoint_instance()``.
    Changed KV-event sources re-create the publishers. The model card is kept throughout.
    """
    health = sidecar.health
    policy = RotationPolicy(grace=options.unserving_grace, sources=sources)
    grace_due = math.inf
    last: HealthState | None = None
    fed_sources = sources

    def changed(state: HealthState) -> bool:
        # A change from what was fed last, or new KV-event sources: a replaced vLLM adopted after a prober
        # hiccup passes through RECOVERING at once, which this task may not see if it is busy meanwhile.
        return state != last or tuple(sidecar.kv_event_sources) != fed_sources

    while True:
        event: RotationEvent | None = None
        with trio.move_on_at(grace_due):
            last = await health.wait_value(changed)
            fed_sources = tuple(sidecar.kv_event_sources)
            event = HealthChanged(last, fed_sources, rl_withdrawn=dynamo.rl_withdrawn)
        if event is None:
            grace_due = math.inf
            event = TimerFired(Timer.GRACE)
        for action in policy.handle(event):
            if isinstance(action, ArmTimer):
                grace_due = trio.current_time() + action.delay
            elif isinstance(action, CancelTimer):
                grace_due = math.inf
            else:
                done = await _rotate(action, thread, dynamo, plan)
                if done is not None:
                    policy.handle(done)


async def _rotate(
    action: RotationAction, thread: AsyncioThread, dynamo: DynamoSide, plan: WorkerPlan
) -> RotationEvent | None:
    """Carry out one rotation action on Dynamo's side; its outcome as an event (None: nothing changed)."""
    if isinstance(action, TakeOutOfRotation):
        LOGGER.warning(
            "vLLM has not been serving for %s (%s); taking the instance out of rotation",
            format_duration(action.grace),
            action.reason,
        )
        try:
            await thread.run(dynamo.unregister)
        except Exception as exc:  # noqa: BLE001
            LOGGER.error("unregister_endpoint_instance failed: %s", exc)
            return None
        return RotationDone(in_rotation=False)
    if isinstance(action, ReplacePublishers):
        LOGGER.warning("vLLM KV-event sources changed after recovery; re-creating the KV publishers")
        try:
            await thread.run(dynamo.replace_publishers, plan, action.sources)
        except Exception as exc:  # noqa: BLE001
            LOGGER.error("re-creating the KV publishers failed: %s", exc)
            return None
        return PublishersReplaced(action.sources)
    if isinstance(action, RestoreToRotation):
        try:
            await thread.run(dynamo.register)
        except Exception as exc:  # noqa: BLE001
            LOGGER.error("register_endpoint_instance failed: %s", exc)
            return None
        LOGGER.info("vLLM is serving again; the instance is back in rotation")
        return RotationDone(in_rotation=True)
    return None


async def _stop_runtime(thread: AsyncioThread, dynamo: DynamoSide) -> None:
    """Idempotent final teardown: publishers, ``runtime.shutdown()``, the serve future, the thread."""
    if thread.loop is not None:
        try:
            with trio.move_on_after(STOP_GRACE):
                await thread.run(_call_sync, dynamo.shutdown_publishers)
                await thread.run(dynamo.shutdown)
                await thread.run(dynamo.wait_serving_ended)
        except Exception:  # noqa: BLE001 - the runtime is going away regardless
            LOGGER.debug("Dynamo runtime shutdown failed", exc_info=True)
    await thread.stop()


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
