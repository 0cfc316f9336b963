"""Helpers for the prober tests. A small scripted vLLM for the health prober: ``Health`` (the transport's servicer) + a scripted
``vllm.Control`` on the project's ``serve_grpc``, bound to 127.0.0.1 on port 0.

``ScriptedVllm`` can be stopped (its server task is cancelled, every connection drops) and restarted on
the same port, which is how the prober sees vLLM die and come back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import asynccontextmanager

import attrs
import fakes
import trio
import trio_util

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_grpc, control_pb2
from trio_sidecar.core.config import SidecarConfig
from trio_sidecar.core.endpoint import parse_grpc_endpoint
from trio_sidecar.core.health_policy import HealthKind, HealthState
from trio_sidecar.core.model import DiscoveredModel
from trio_sidecar.shell.prober import run_health_prober

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("vllm.Control", "vllm.Inference")

# Generous for a loaded 2-core machine; the tests wait on states, never on elapsed time.
WAIT = 20.0


def model_info(**overrides) -> control_pb2.ModelInfo:
    return fakes.model_info(**{"served_model_aliases": ["alias-a"], "supports_text_input": True, **overrides})


server_info = fakes.server_info


def kv_source(endpoint: str, rank: int = 0) -> control_pb2.KvEventSource:
    return control_pb2.KvEventSource(transport="zmq", endpoint=endpoint, topic="", data_parallel_rank=rank)


class ScriptedControl(control_grpc.ControlServicer):
    """``vllm.Control`` with the answers a test sets, failures it queues and a gate it can close."""

    def __init__(self) -> None:
        self.model_info = model_info()
        self.server_info = server_info()
        self.kv_sources: list[control_pb2.KvEventSource] = []
        self.failures: list[Exception] = []  # raised (in order) by the next GetModelInfo calls
        self.gate: trio.Event | None = None  # GetModelInfo waits for it when set
        self.calls: Counter[str] = Counter()

    async def GetModelInfo(self, request, context):
        self.calls["GetModelInfo"] += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            raise self.failures.pop(0)
        return self.model_info

    async def GetServerInfo(self, request, context):
        self.calls["GetServerInfo"] += 1
        return self.server_info

    async def GetKvEventSources(self, request, context):
        self.calls["GetKvEventSources"] += 1
        return control_pb2.GetKvEventSourcesResponse(sources=self.kv_sources)


def make_health(statuses=None):
    from trio_sidecar.transport import HealthServicer

    return HealthServicer(statuses or {"": SERVING, "vllm.Control": SERVING, "vllm.Inference": SERVING})


class ScriptedVllm:
    """Health + Control on one port; ``stop()``/``start()`` simulate a crash and a restart."""

    def __init__(self, nursery: trio.Nursery, health=None) -> None:
        self.nursery = nursery
        self.health = health if health is not None else make_health()
        self.control = ScriptedControl()
        self.port = 0
        self.server = None
        self._scope: trio.CancelScope | None = None
        self._done: trio.Event | None = None

    async def start(self) -> None:
        from trio_sidecar.transport import serve_grpc

        scope = trio.CancelScope()
        done = trio.Event()

        async def runner(task_status=trio.TASK_STATUS_IGNORED):
            try:
                with scope:
                    await serve_grpc(
                        [self.health, self.control], host="127.0.0.1", port=self.port, task_status=task_status
                    )
            finally:
                done.set()

        self.server = await self.nursery.start(runner)
        self.port = self.server.port
        self._scope, self._done = scope, done

    async def stop(self) -> None:
        assert self._scope is not None and self._done is not None
        self._scope.cancel()
        await self._done.wait()
        self._scope = self._done = None

    def set_all(self, status: int) -> None:
        for service in ("", *SERVICES):
            self.health.set_status(service, status)

    def model(self) -> DiscoveredModel:
        return DiscoveredModel.from_proto(self.control.model_info, self.control.server_info)


class RecordingValue(trio_util.AsyncValue):
    """An ``AsyncValue`` that remembers every distinct value it took (the prober's transitions)."""

    def __init__(self, value) -> None:
        super().__init__(value)
        self.history = [value]

    @property
    def value(self):
        return trio_util.AsyncValue.value.fget(self)

    @value.setter
    def value(self, new) -> None:
        if new != trio_util.AsyncValue.value.fget(self):
            self.history.append(new)
        trio_util.AsyncValue.value.fset(self, new)

    def kinds(self) -> list[HealthKind]:
        return [state.kind for state in self.history]


@attrs.define
class ProberHarness:
    health: RecordingValue
    recovered: list = attrs.Factory(list)
    fatal: Exception | None = None
    finished: trio.Event = attrs.Factory(trio.Event)

    async def wait_for(self, kind: HealthKind, reason: str | None = None, *, timeout: float = WAIT) -> HealthState:
        def matches(state: HealthState) -> bool:
            return state.kind is kind and (reason is None or state.reason == reason)

        with trio.fail_after(timeout):
            return await self.health.wait_value(matches)

    async def wait_for_predicate(self, predicate: Callable[[HealthState], bool], *, timeout: float = WAIT):
        with trio.fail_after(timeout):
            return await self.health.wait_value(predicate)


def prober_config(port: int, **overrides) -> SidecarConfig:
    return fakes.sidecar_config(
        f"127.0.0.1:{port}", **{"grpc_connections": 8, "connect_attempt_timeout": 15.0, **overrides}
    )


@asynccontextmanager
async def running_prober(
    vllm: ScriptedVllm, *, config: SidecarConfig | None = None, model=None, kv_sources=(), on_recovered=None
):
    """Run the prober against ``vllm`` for the block; a fatal error is recorded, not raised."""
    config = config or prober_config(vllm.port)
    endpoint = parse_grpc_endpoint(config.grpc_endpoint)
    harness = ProberHarness(RecordingValue(HealthState(HealthKind.SERVING)))

    def record_recovery(new_model, sources) -> None:
        harness.recovered.append((new_model, sources))
        if on_recovered is not None:
            on_recovered(new_model, sources)

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await run_health_prober(
                endpoint=endpoint,
                config=config,
                model=model if model is not None else vllm.model(),
                kv_sources=tuple(kv_sources),
                health=harness.health,
                on_recovered=record_recovery,
                task_status=task_status,
            )
        except Exception as exc:  # a group here would be a bug: tests check the type
            harness.fatal = exc
        finally:
            harness.finished.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        yield harness
        nursery.cancel_scope.cancel()


class MockRunner:
    """Runs ``open_mock_server`` blocks one after another in ``nursery`` (a "vLLM process" that can die and
    come back on the same port, possibly with another configuration)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.mock = None
        self.port = 0
        self._stop: trio.Event | None = None
        self._done: trio.Event | None = None

    async def start(self, **config) -> object:
        from trio_sidecar.mock import MockConfig, open_mock_server

        fields = dict(
            listen=f"127.0.0.1:{self.port}",
            model="mocker-model",
            engine_args={"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 0.0},
        )
        fields.update(config)
        stop, done = trio.Event(), trio.Event()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            try:
                async with open_mock_server(MockConfig(**fields)) as mock:
                    task_status.started(mock)
                    await stop.wait()
            finally:
                done.set()

        self.mock = await self.nursery.start(run)
        self.port = self.mock.port
        self._stop, self._done = stop, done
        return self.mock

    async def stop(self) -> None:
        """Close the server: every connection drops (no graceful health sequence)."""
        assert self._stop is not None and self._done is not None
        self._stop.set()
        await self._done.wait()
        self.mock = self._stop = self._done = None


@attrs.define
class ProxiedLink:
    client: trio.SocketStream
    scope: trio.CancelScope


class ResettableProxy:
    """A TCP proxy on 127.0.0.1:0 in front of a vLLM stand-in that can reset one client connection (the
    fault injection of a prober hiccup) and refuse new ones (a failed reconnect).

    ``links`` lists the live connections in the order they were accepted. Usage:
    ``proxy = await nursery.start(ResettableProxy(port).serve)``; ``proxy.endpoint``.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.listen_port = 0
        self.accepted = 0
        self.links: list[ProxiedLink] = []
        self.refuse = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    def reset(self, link: ProxiedLink, *, abortive: bool = True) -> None:
        """Drop ``link``: a TCP RST (``abortive``) or a plain close (FIN) towards the client."""
        if abortive:
            import socket
            import struct

            link.client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        link.scope.cancel()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.listen_port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        async with client:
            if self.refuse:
                return
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.port)
            except OSError:
                return
            async with upstream, trio.open_nursery() as nursery:
                link = ProxiedLink(client, nursery.cancel_scope)
                self.links.append(link)

                async def pipe(src: trio.SocketStream, dst: trio.SocketStream) -> None:
                    try:
                        while data := await src.receive_some(65536):
                            await dst.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(pipe, client, upstream)
                nursery.start_soon(pipe, upstream, client)
            self.links.remove(link)
