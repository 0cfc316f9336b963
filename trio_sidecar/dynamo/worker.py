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
                └─ request nursery         dispatcher + one task per request (bridge)
                   registration            serve_endpoint, register_model, KvEventPublisher per source
                   health supervisor       unregister/re-register on NOT_SERVING (docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/sidecar.md#recovery)
                   wait                    for the shutdown request, a fatal prober error or a dead runtime

Shutdown (docs/reference/sidecar.md#lifecycle, docs/reference/worker.md#graceful-shutdown-and-drain): stop admitting, ``runtime.shutdown()`` on the loop (unregisters the
instance at once, then the runtime drains in-flight handlers), wait for ``serve_endpoint``'s future for up
to ``drain_timeout`` — after it, every remaining request is stopped (it ends with its cancelled chunk and
an Abort is queued, docs/reference/worker.md#graceful-shutdown-and-drain) — then leave ``open_sidecar`` (cleanup), stop the loop, join the
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
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._logging import emit, print_error
from .._signals import SIGNALS, held, hold_signals, interrupted_code
from ..config import DisaggregationMode, SidecarConfig, WorkerOptions
from ..diagnostics import round_duration, startup_hint
from ..errors import InvalidArgument, SidecarError, format_duration
from ..progress import StartupProgress, tracking
from ..transport import collapse_single_exception
from .bridge import AsyncioThread, RequestBridge

if TYPE_CHECKING:
    from ..api import Sidecar
    from ..model import DiscoveredModel, EngineConfig
    from ..routing import KvEventSource

__all__ = ["run_worker", "WorkerPlan", "plan_registration", "worker_namespace"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.worker")

INIT_SHUTDOWN = "runtime shut down during sidecar initialization"
# Signs of life while a startup step waits (plain log lines; a TTY gets a live status instead).
TICK_INTERVAL = 10.0
# A signal before serving ends the process within this bound even when Dynamo's runtime does not return
# (e.g. it waits for an etcd that is not running and ignores cancellation).
INTERRUPT_EXIT_BOUND = 1.5
# After the drain bound, stopped requests end promptly; this bounds the wait for the runtime's own drain.
STOP_GRACE = 10.0

# --- pure registration planning ---------------------------------------------------------------------------

_ENDPOINT_TYPES = {"chat": "Chat", "completions": "Completions"}
_WORKER_TYPES = {
    DisaggregationMode.AGG: "Aggregated",
    DisaggregationMode.PREFILL: "Prefill",
    DisaggregationMode.DECODE: "Decode",
}
_FIXED_COMPONENT = {DisaggregationMode.PREFILL: "prefill", DisaggregationMode.DECODE: "backend"}
# register_model rejects Prefill/Decode without `needs`; the native sidecar declares the peer role.
_NEEDS = {DisaggregationMode.PREFILL: (("Decode",),), DisaggregationMode.DECODE: (("Prefill",),)}


def worker_namespace(namespace: str, environ: Mapping[str, str] = os.environ) -> str:
    """Apply ``DYN_NAMESPACE_WORKER_SUFFIX`` like the native sidecar: ``-{suffix}`` unless empty or present."""
    suffix = environ.get("DYN_NAMESPACE_WORKER_SUFFIX", "").strip()
    if not suffix or namespace.endswith(f"-{suffix}"):
        return namespace
    return f"{namespace}-{suffix}"


@attrs.frozen(kw_only=True)
class WorkerPlan:
    """Everything ``register_model`` and the publishers need, as plain values (docs/reference/worker.md#registration)."""

    endpoint_path: str  # "ns.component.endpoint"
    model_path: str
    served_model_name: str
    aliases: tuple[str, ...]
    model_types: tuple[str, ...]  # dynamo.llm.ModelType member names, OR-ed together ("Prefill" for prefill)
    worker_type: str  # dynamo.llm.WorkerType member name
    needs: tuple[tuple[str, ...], ...]  # DNF of WorkerType names the role depends on (required for P/D)
    kv_cache_block_size: int | None
    runtime_config: dict[str, Any]  # ModelRuntimeConfig attributes to set (None values already dropped)
    custom_template_path: str | None
    # Dynamo's canary request, only when canaries are enabled (DYN_HEALTH_CHECK_ENABLED): with a payload the
    # runtime derives /health from endpoint health and ignores set_health_status (docs/dynamo.md).
    health_check_payload: dict[str, Any] | None
    local_indexer: bool  # KvEventPublisher(enable_local_indexer=...): off for decode workers


def plan_registration(
    config: SidecarConfig,
    options: WorkerOptions,
    engine: EngineConfig,
    sources: Sequence[KvEventSource],
    *,
    environ: Mapping[str, str] = os.environ,
) -> WorkerPlan:
    """Build the registration from the start-phase ``EngineConfig`` (docs/reference/sidecar.md#registration-data, docs/reference/worker.md#registration).

    Raises:
        InvalidArgument: an endpoint type other than ``chat``/``completions``, or an unsupported mode.
    """
    mode = DisaggregationMode.parse(config.disaggregation_mode)
    if mode not in _WORKER_TYPES:
        raise InvalidArgument("encode mode is not supported by the vLLM sidecar")
    component = _FIXED_COMPONENT.get(mode, options.component)
    path = f"{worker_namespace(options.namespace, environ)}.{component}.{options.endpoint}"
    if mode is DisaggregationMode.PREFILL:
        # Prefill workers have no OpenAI surface whatever --endpoint-types says; like the native sidecar
        # they register the legacy ModelType.Prefill marker (so older frontends still see the role) and
        # WorkerType.Prefill.
        model_types: tuple[str, ...] = ("Prefill",)
    else:
        names = []
        for kind in options.endpoint_types:
            if kind not in _ENDPOINT_TYPES:
                raise InvalidArgument(f"unsupported endpoint type `{kind}`; expected chat or completions")
            names.append(_ENDPOINT_TYPES[kind])
        if not names:
            raise InvalidArgument("--endpoint-types must name at least one of chat, completions")
        model_types = tuple(dict.fromkeys(names))
    runtime = {
        "context_length": engine.context_length,
        "total_kv_blocks": engine.total_kv_blocks,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "data_parallel_size": engine.data_parallel_size,
        "data_parallel_start_rank": engine.data_parallel_start_rank,
    }
    runtime = {k: v for k, v in runtime.items() if v is not None}
    # Publishers need a block size (KvEventPublisher rejects 0); without one no events are relayed.
    runtime["kv_event_publishing_enabled"] = bool(sources) and engine.kv_cache_block_size is not None
    runtime["exclude_tools_when_tool_choice_none"] = bool(options.exclude_tools_when_tool_choice_none)
    # The native 1.6.1 sidecar's model card says enable_local_indexer=true in every mode; decode workers
    # get no KV publishers anyway (vLLM reports no KV-event sources in decode mode).
    runtime["enable_local_indexer"] = True
    local_indexer = mode is not DisaggregationMode.DECODE
    return WorkerPlan(
        endpoint_path=path,
        model_path=engine.model,
        served_model_name=engine.served_model_name,
        aliases=tuple(engine.aliases),
        model_types=model_types,
        worker_type=_WORKER_TYPES[mode],
        needs=_NEEDS.get(mode, ()),
        kv_cache_block_size=engine.kv_cache_block_size,
        runtime_config=runtime,
        custom_template_path=options.custom_jinja_template,
        health_check_payload=(
            health_check_payload(engine.model, environ) if _truthy(environ.get("DYN_HEALTH_CHECK_ENABLED")) else None
        ),
        local_indexer=local_indexer,
    )


HEALTH_CHECK_KEY = "_HEALTH_CHECK"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def health_check_payload(model_path: str, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The canary request Dynamo sends when its health checks are enabled (``DYN_HEALTH_CHECK_ENABLED``).

    Dynamo's token-input backends use one BOS token, ``max_tokens`` 1, ``ignore_eos``, temperature 0, and
    the ``_HEALTH_CHECK`` marker; ``DYN_HEALTH_CHECK_PAYLOAD`` (JSON, or ``@file``) overrides it. The BOS id
    comes from the model directory's ``generation_config.json``/``config.json`` when readable, else 1.
    Canaries are served like any other request (docs/reference/worker.md#health-canaries).
    """
    payload: dict[str, Any] = {
        "token_ids": [_bos_token_id(model_path)],
        "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
    }
    override = environ.get("DYN_HEALTH_CHECK_PAYLOAD", "").strip()
    if override:
        try:
            if override.startswith("@"):
                with open(override[1:], encoding="utf-8") as f:
                    parsed = json.load(f)
            else:
                parsed = json.loads(override)
        except (OSError, ValueError) as exc:
            LOGGER.warning("ignoring DYN_HEALTH_CHECK_PAYLOAD: %s", exc)
        else:
            if isinstance(parsed, dict):
                payload = parsed
            else:
                LOGGER.warning("ignoring DYN_HEALTH_CHECK_PAYLOAD: not a JSON object")
    return {**payload, HEALTH_CHECK_KEY: True}


def _bos_token_id(model_path: str) -> int:
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_path, name), encoding="utf-8") as f:
                value = json.load(f).get("bos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 1


# --- the asyncio side ---------------------------------------------------------------------------------------


class DynamoSide:
    """Owns the Dynamo objects. Every method runs on the asyncio thread (via ``AsyncioThread.run``)."""

    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.runtime: Any = None
        self.endpoint: Any = None
        self.serve: asyncio.Future | None = None
        self.publishers: list[Any] = []

    async def create_runtime(self, endpoint_path: str) -> None:
        from dynamo.runtime import DistributedRuntime

        kwargs = {"response_plane": self.options.response_plane}
        if self.options.event_plane:
            kwargs["event_plane"] = self.options.event_plane
        self.runtime = DistributedRuntime(
            asyncio.get_running_loop(), self.options.discovery_backend, self.options.request_plane, **kwargs
        )
        self.endpoint = self.runtime.endpoint(endpoint_path)

    async def serve_and_register(self, plan: WorkerPlan, handler: Callable[..., Any]) -> None:
        from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

        # serve_endpoint returns a Future, not a coroutine (docs/reference/worker.md#pitfalls).
        self.serve = asyncio.ensure_future(
            self.endpoint.serve_endpoint(handler, health_check_payload=plan.health_check_payload)
        )
        rc = ModelRuntimeConfig()
        for name, value in plan.runtime_config.items():
            setattr(rc, name, value)
        model_type = getattr(ModelType, plan.model_types[0])
        for name in plan.model_types[1:]:
            model_type = model_type | getattr(ModelType, name)
        await register_model(
            ModelInput.Tokens,
            model_type,
            self.endpoint,
            plan.model_path,
            plan.served_model_name,
            worker_type=getattr(WorkerType, plan.worker_type),
            needs=[[getattr(WorkerType, name) for name in group] for group in plan.needs] or None,
            kv_cache_block_size=plan.kv_cache_block_size,
            runtime_config=rc,
            model_aliases=list(plan.aliases) or None,
            custom_template_path=plan.custom_template_path,
        )
        if self.serve.done():  # serving failed at once (e.g. the request plane could not bind)
            self.serve.result()

    async def replace_publishers(self, plan: WorkerPlan, sources: Sequence[KvEventSource]) -> int:
        """Shut down the current KV publishers and create one per source (docs/reference/worker.md#kv-events)."""
        from dynamo.llm import KvEventPublisher

        self.shutdown_publishers()
        if not sources:
            return 0
        if not plan.kv_cache_block_size:
            LOGGER.warning("vLLM reports no KV block size; KV events are not relayed to the router")
            return 0
        for source in sources:
            self.publishers.append(
                KvEventPublisher(
                    self.endpoint,
                    kv_block_size=plan.kv_cache_block_size,
                    dp_rank=source.dp_rank,
                    enable_local_indexer=plan.local_indexer,
                    zmq_endpoint=source.endpoint,
                    zmq_topic=source.topic,
                )
            )
        return len(self.publishers)

    def shutdown_publishers(self) -> None:
        publishers, self.publishers = self.publishers, []
        for publisher in publishers:
            try:
                publisher.shutdown()
            except Exception:  # noqa: BLE001 - best effort on the way out
                LOGGER.debug("KvEventPublisher.shutdown failed", exc_info=True)

    async def set_ready(self, ready: bool) -> None:
        """The runtime's system-level health (``/health`` and ``/live`` when ``DYN_SYSTEM_PORT`` is set).

        The runtime starts ``NotReady``; the native sidecar reports ready once serving, so do we.
        """
        self.runtime.set_health_status(ready)

    async def unregister(self) -> None:
        await self.endpoint.unregister_endpoint_instance()
        self.runtime.set_health_status(False)

    async def register(self) -> None:
        await self.endpoint.register_endpoint_instance()
        self.runtime.set_health_status(True)

    async def wait_serving_ended(self) -> None:
        """Wait for ``serve_endpoint``'s future (shielded: a cancelled waiter never cancels serving)."""
        if self.serve is not None:
            await asyncio.shield(self.serve)

    async def shutdown(self) -> None:
        """``runtime.shutdown()``: unregister at once, then the runtime drains in-flight handlers."""
        if self.runtime is not None:
            self.runtime.shutdown()


# --- output for humans (TTY) or plain logs --------------------------------------------------------------


class _Ticker:
    """The "still waiting" line of one startup step (see :meth:`Reporter.waiting`)."""

    def __init__(self, console: Any, what: str, deadline: float | None, progress: StartupProgress | None,
                 hint: str | None) -> None:
        self._console = console
        self._what = what
        self._deadline = deadline
        self._progress = progress
        self._hint = hint
        self._started = time.monotonic()
        self._scope = trio.CancelScope()
        self._done = trio.Event()

    def text(self) -> str:
        line = f"still waiting for {self._what}: {format_duration(int(time.monotonic() - self._started))}"
        if self._deadline is not None:
            line += f" of {format_duration(self._deadline)}"
        progress = self._progress
        if progress is not None:
            if progress.attempts:
                plural = "s" if progress.attempts != 1 else ""
                line += f", {progress.attempts} failed attempt{plural}, last: {progress.last_cause}"
            else:
                line += ", no failed attempt yet"
        if self._hint:
            line += f" ({self._hint})"
        return line

    async def run(self) -> None:
        try:
            with self._scope:
                if self._console is not None:
                    with self._console.status(f"waiting for {self._what}") as status:
                        while True:
                            await trio.sleep(0.5)
                            status.update(self.text())
                else:
                    while True:
                        await trio.sleep(TICK_INTERVAL)
                        LOGGER.info("%s", self.text())
        finally:
            self._done.set()

    async def stop(self) -> None:
        """Stop the line and wait until it is gone (the live status must not overlap later output)."""
        self._scope.cancel()
        await self._done.wait()


class Reporter:
    """Startup phases, the discovered model and the ready line: rich on a TTY, plain log records otherwise."""

    def __init__(self, *, rich_output: bool | None = None) -> None:
        if rich_output is None:
            rich_output = sys.stderr.isatty()
        self.rich = rich_output
        self._console = None
        if self.rich:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False)
        self._phase_started = 0.0

    def phase(self, name: str, deadline: float | None = None) -> None:
        self._phase_started = time.monotonic()
        bound = f" (deadline {format_duration(deadline)})" if deadline is not None else ""
        if self._console is not None:
            self._console.print(f"[bold cyan]▶[/] {name}{bound}")
        else:
            LOGGER.info("%s%s: started", name, bound)

    def phase_done(self, name: str) -> None:
        elapsed = format_duration(round_duration(time.monotonic() - self._phase_started))
        if self._console is not None:
            self._console.print(f"  [green]✓[/] {name} in {elapsed}")
        else:
            LOGGER.info("%s: done in %s", name, elapsed)

    @asynccontextmanager
    async def waiting(self, what: str, deadline: float | None = None, *, progress: StartupProgress | None = None,
                      hint: str | None = None) -> AsyncIterator[_Ticker]:
        """Signs of life while a startup step waits: a line every :data:`TICK_INTERVAL` (plain logs) or a
        live status line (TTY) with the elapsed time against the deadline, the failed attempts and the last
        cause. Ends with the block, or earlier with ``await ticker.stop()``."""
        ticker = _Ticker(self._console, what, deadline, progress, hint)
        with collapse_single_exception():  # the ticker never fails: the body's error surfaces as itself
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ticker.run)
                try:
                    yield ticker
                finally:
                    with trio.CancelScope(shield=True):
                        await ticker.stop()

    def model_table(self, model: DiscoveredModel, engine: EngineConfig, plan: WorkerPlan,
                    sources: Sequence[KvEventSource]) -> None:
        rows = _model_rows(model, engine, plan, sources)
        if self._console is not None:
            from rich.table import Table

            table = Table(title="Discovered vLLM model", show_header=False, title_justify="left")
            table.add_column(style="bold")
            table.add_column()
            for key, value in rows:
                table.add_row(key, value)
            self._console.print(table)
        else:
            LOGGER.info("discovered vLLM model: %s", "; ".join(f"{k}: {v}" for k, v in rows))

    def ready(self, plan: WorkerPlan) -> None:
        text = f"ready: serving `{plan.served_model_name}` on dyn://{plan.endpoint_path} ({plan.worker_type})"
        if self._console is not None:
            self._console.print(f"[bold green]✔ {text}[/]", markup=True)
        else:
            LOGGER.info(text)


def _model_rows(model: DiscoveredModel, engine: EngineConfig, plan: WorkerPlan,
                sources: Sequence[KvEventSource]) -> list[tuple[str, str]]:
    def show(value: Any) -> str:
        return "-" if value is None else str(value)

    info = model.server_info
    return [
        ("model", engine.model),
        ("served name", engine.served_model_name),
        ("aliases", ", ".join(engine.aliases) or "-"),
        ("engine", f"{info.engine_version or '?'} (instance {info.instance_id or '?'})"),
        ("context length", show(engine.context_length)),
        ("KV block size", show(engine.kv_cache_block_size)),
        ("total KV blocks", show(engine.total_kv_blocks)),
        ("max seqs", show(engine.max_num_seqs)),
        ("max batched tokens", show(engine.max_num_batched_tokens)),
        ("DP size", show(model.data_parallel_size())),
        ("KV events", ", ".join(f"{s.dp_rank}:{s.endpoint}" for s in sources) or "-"),
        ("endpoint", f"dyn://{plan.endpoint_path}"),
        ("worker type", plan.worker_type),
    ]


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
            sys.stderr.write(f"received {name} again; exiting immediately\n")
            sys.stderr.flush()
            os._exit(1)
        self.requested.set()
        if self.serving:
            LOGGER.info("received %s; shutting down", name)
            return
        code = interrupted_code(signum)
        self.interrupted = code
        emit(f"received {name} during {self.phase}: {INIT_SHUTDOWN}; exiting with code {code}",
             name=LOGGER.name)
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


async def _watch_signals(state: _Shutdown, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
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
    from ..endpoint import parse_grpc_endpoint

    vllm = f"vLLM at {parse_grpc_endpoint(config.grpc_endpoint).canonical}"
    with state.startup() as scope:
        state.phase = "bootstrap discovery"
        reporter.phase(state.phase, config.startup_deadline)
        try:
            with tracking(StartupProgress()) as progress:
                async with reporter.waiting(vllm, config.startup_deadline, progress=progress):
                    bootstrap = await discover(config)
        except SidecarError as exc:
            _print_error(str(exc))
            return 1
        reporter.phase_done(state.phase)
    if scope.cancelled_caught:
        return _interrupted(state)

    mode = DisaggregationMode.parse(config.disaggregation_mode)
    component = _FIXED_COMPONENT.get(mode, options.component)
    endpoint_path = f"{worker_namespace(options.namespace)}.{component}.{options.endpoint}"
    thread = AsyncioThread(loop_factory=_loop_factory())
    dynamo = DynamoSide(options)
    await thread.start()
    try:
        return await _run_with_runtime(config, options, state, reporter, thread, dynamo, bootstrap, endpoint_path,
                                       vllm)
    finally:
        with trio.CancelScope(shield=True):
            await _stop_runtime(thread, dynamo)


def _interrupted(state: _Shutdown) -> int:
    """The exit code after a signal cancelled a startup step (the notice was printed when it arrived)."""
    assert state.interrupted is not None
    return state.interrupted


def _runtime_hint(options: WorkerOptions) -> str | None:
    if options.discovery_backend == "etcd":
        return ("the etcd discovery backend needs a reachable etcd (ETCD_ENDPOINTS); "
                "for one host use --discovery-backend file")
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
                    async with reporter.waiting(f"{needed.name} at {', '.join(needed.urls)}", needed.timeout,
                                                progress=progress, hint=needed.hint):
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
            async with reporter.waiting(f"Dynamo's runtime (discovery backend {options.discovery_backend})",
                                        hint=_runtime_hint(options)):
                await thread.run(dynamo.create_runtime, endpoint_path)
        except Exception as exc:  # noqa: BLE001 - Dynamo raises plain exceptions
            _print_error(f"failed to start the Dynamo runtime: {exc}")
            return 1
        reporter.phase_done(state.phase)
    if scope.cancelled_caught:
        return _interrupted(state)

    bridge = RequestBridge(thread)
    code = 0
    with state.startup() as scope:
        state.phase = "start phase"
        reporter.phase(state.phase, config.startup_deadline)
        try:
            with collapse_single_exception():
                with tracking(StartupProgress()) as progress:
                    async with reporter.waiting(vllm, config.startup_deadline, progress=progress) as waiting:
                        async with open_sidecar(config, expected=bootstrap) as sidecar:
                            await waiting.stop()
                            reporter.phase_done(state.phase)
                            async with trio.open_nursery() as requests:
                                requests.start_soon(bridge.run_dispatcher, sidecar.submit)
                                code = await _register_and_serve(config, options, state, reporter, thread,
                                                                 dynamo, bridge, sidecar)
                                requests.cancel_scope.cancel()
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
) -> int:
    sources = tuple(sidecar.kv_event_sources)
    plan = plan_registration(config, options, sidecar.engine_config, sources)
    state.phase = "registration with Dynamo"
    reporter.phase(state.phase)
    await thread.run(dynamo.serve_and_register, plan, bridge.handler)
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
    await _drain(options, thread, dynamo, bridge)
    return 0


async def _set_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _watch_serving(thread: AsyncioThread, dynamo: DynamoSide, ended: trio.Event) -> None:
    try:
        await thread.run(dynamo.wait_serving_ended)
    except Exception as exc:  # noqa: BLE001
        LOGGER.error("serve_endpoint failed: %s", exc)
    ended.set()


async def _drain(options: WorkerOptions, thread: AsyncioThread, dynamo: DynamoSide, bridge: RequestBridge) -> None:
    """Graceful shutdown: unregister at once, drain up to ``drain_timeout``, then stop the rest (docs/reference/worker.md#graceful-shutdown-and-drain)."""
    in_flight = len(bridge.in_flight)
    LOGGER.info("draining %d in-flight request(s) (up to %s)", in_flight, format_duration(options.drain_timeout))
    await thread.run(dynamo.shutdown)
    bridge.stop_admitting()
    with trio.move_on_after(options.drain_timeout) as drain:
        await thread.run(dynamo.wait_serving_ended)
        await bridge.wait_idle()
    if drain.cancelled_caught:
        stopped = bridge.stop_all()
        LOGGER.warning("drain timeout reached; cancelling %d remaining request(s)", stopped)
        with trio.move_on_after(STOP_GRACE):
            await bridge.wait_idle()
            await thread.run(dynamo.wait_serving_ended)


async def _supervise_health(
    options: WorkerOptions,
    thread: AsyncioThread,
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


async def _call_sync(fn: Callable[[], Any]) -> Any:
    return fn()
