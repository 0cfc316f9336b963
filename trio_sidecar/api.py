"""The embeddable Trio API (docs/reference/sidecar.md#embedded-api).

```python
async with open_sidecar(SidecarConfig(grpc_endpoint="127.0.0.1:50051")) as sidecar:
    ctx = GenerateContext(request_id="req-1")
    async with sidecar.generate({"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 8}}, ctx) as chunks:
        async for chunk in chunks:
            print(chunk.to_dict())
```

Everything the sidecar runs (connections, the abort sender, the health prober, one task per in-flight
request) lives in the nursery of :func:`open_sidecar`; nothing outlives its ``async with`` block.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import trio
import trio_util

from .config import SidecarConfig, validate_sidecar_config
from .context import ChunkSink, GenerateContext
from .discovery import discover
from .engine import SidecarEngine
from .model import DiscoveredModel, EngineConfig
from .prober import HealthState, run_health_prober
from .protocol import LLMEngineOutput, PreprocessedRequest
from .routing import KvEventSource
from .stats import StatsSnapshot
from .transport import collapse_single_exception

__all__ = ["open_sidecar", "discover", "Sidecar", "ChunkSink", "GenerateContext"]


@attrs.define(eq=False)
class Sidecar:
    """A started sidecar (yielded by :func:`open_sidecar`).

    Attributes:
        model: the discovered model (identity, ``ServerInfo``, DP size); refreshed after a recovery.
        engine_config: registration data (docs/reference/sidecar.md#registration-data).
        kv_event_sources: validated ``KvEventSource`` tuple (docs/reference/sidecar.md#kv-event-sources); refreshed after a recovery
            (docs/reference/sidecar.md#recovery).
        health: ``AsyncValue[HealthState]`` (docs/reference/sidecar.md#health-prober), the engine's: admission
            is open only while it is ``SERVING``.
        engine: the underlying :class:`SidecarEngine`, the owner of admission and drain (``in_flight``,
            ``stop_admission()``, ``wait_idle()``, ``cancel_in_flight()``, ``drain(timeout)``).
    """

    engine: SidecarEngine
    model: DiscoveredModel
    engine_config: EngineConfig
    kv_event_sources: tuple[KvEventSource, ...]
    health: trio_util.AsyncValue[HealthState]

    def __repr__(self) -> str:
        return (
            f"<Sidecar {self.model.served_model_name!r} {self.health.value.kind.name} "
            f"[{self.engine.in_flight} in flight]>"
        )

    def generate(
        self, request: dict[str, Any] | PreprocessedRequest, ctx: GenerateContext | None = None
    ) -> AbstractAsyncContextManager[AsyncIterator[LLMEngineOutput]]:
        """Stream one request (docs/reference/sidecar.md#embedded-api); see :meth:`SidecarEngine.generate` for the full contract.

        Raises (from ``__aenter__``):
            InvalidArgument: conversion failed; nothing was sent.
            CannotConnect: ``vLLM is not serving: {reason}`` (admission closed, docs/reference/sidecar.md#admission), or a mapped open error.
            EngineShutdown: ``vLLM sidecar is not started`` (after the ``open_sidecar`` block).
        """
        return self.engine.generate(request, ctx)

    def submit(self, request: dict[str, Any] | PreprocessedRequest, ctx: GenerateContext, sink: ChunkSink) -> None:
        """Start one request whose chunks go to ``sink`` (what the Dynamo worker uses); see
        :meth:`SidecarEngine.submit`.

        Raises (synchronously; the sink is not called): ``InvalidArgument`` (conversion), ``CannotConnect``
        (admission closed), ``EngineShutdown`` (not started). Open and stream errors reach ``sink.end``.
        """
        self.engine.submit(request, ctx, sink)

    def stats(self) -> StatsSnapshot:
        """The sidecar's counters, gauges and histograms now, as a frozen snapshot (docs/observability.md):
        requests started, finished by outcome, rejected and in flight; tokens; time to first token and
        inter-token latency; ``Control.Abort`` outcomes; decode deferrals; the prober's state and
        transitions; the connection pool. No Prometheus needed; safe to call from any thread."""
        return self.engine.snapshot_stats()

    def _on_recovered(self, model: DiscoveredModel, kv_sources: tuple[KvEventSource, ...]) -> None:
        # The prober already logged a changed source list (docs/reference/sidecar.md#recovery); this only swaps the state.
        self.model = model
        self.engine.model = model
        self.kv_event_sources = kv_sources
        self.engine.kv_event_sources = kv_sources


@asynccontextmanager
async def open_sidecar(config: SidecarConfig, *, expected: DiscoveredModel | None = None) -> AsyncIterator[Sidecar]:
    """Start a sidecar against ``config.grpc_endpoint`` (docs/reference/sidecar.md#embedded-api).

    Runs the ``SidecarConfig`` pre-network checks (docs/reference/sidecar.md#pre-network-checks), then the start phase (docs/reference/sidecar.md#start-phase); with ``expected``
    (the bootstrap model from :func:`discover`) the compatibility check (docs/reference/sidecar.md#identity-check) too. Starts the health prober
    when ``config.health_prober`` is on.

    Raises:
        InvalidArgument: pre-network checks (no socket opened).
        CannotConnect, ConnectionTimeout, ProtocolError, EngineShutdown, SidecarError: startup failures.
        ProtocolError: a fatal prober finding (identity or DP size changed after a recovery) ends the block.
        A single failure is raised as itself, never as an ``ExceptionGroup``.

    Cancellation: leaving the block cancels everything the sidecar owns (in-flight requests end with a
    cancelled chunk, queued Aborts are flushed with a 5 s shielded grace) and returns only when all its
    tasks have ended.
    """
    endpoint = validate_sidecar_config(config)
    engine = SidecarEngine(config, endpoint=endpoint)
    with collapse_single_exception():
        async with trio.open_nursery() as nursery:
            try:
                engine_config = await engine.start(nursery, expected=expected)
                assert engine.model is not None
                sidecar = Sidecar(
                    engine=engine,
                    model=engine.model,
                    engine_config=engine_config,
                    kv_event_sources=engine.kv_event_sources,
                    health=engine.health,
                )
                if config.health_prober:
                    await nursery.start(
                        functools.partial(
                            run_health_prober,
                            endpoint=endpoint,
                            config=config,
                            model=sidecar.model,
                            kv_sources=sidecar.kv_event_sources,
                            health=sidecar.health,
                            on_recovered=sidecar._on_recovered,
                            stats=engine.stats,
                        )
                    )
                yield sidecar
            finally:
                await engine.cleanup()
                nursery.cancel_scope.cancel()
