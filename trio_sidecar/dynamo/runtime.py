"""The runtime side: the Dynamo objects of one worker (docs/reference/worker.md#startup-sequence).

Every method runs on the asyncio thread's loop, the one Dynamo's runtime was given (:mod:`.thread`); the
worker awaits the coroutines with ``AsyncioThread.run``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import WorkerOptions

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from dynamo.llm import KvEventPublisher
    from dynamo.runtime import DistributedRuntime, Endpoint

    from ..routing import KvEventSource
    from ..stats import StatsSnapshot
    from .plan import WorkerPlan

    Handler = Callable[..., AsyncIterator[dict[str, Any]]]

__all__ = ["DynamoSide"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.runtime")


class DynamoSide:
    """Owns the Dynamo objects. Every method runs on the asyncio thread (via ``AsyncioThread.run``)."""

    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.runtime: DistributedRuntime | None = None
        self.endpoint: Endpoint | None = None
        self.serve: asyncio.Future[None] | None = None
        self.publishers: list[KvEventPublisher] = []

    async def create_runtime(self, endpoint_path: str) -> None:
        from dynamo.runtime import DistributedRuntime

        kwargs: dict[str, Any] = {"response_plane": self.options.response_plane}
        if self.options.event_plane:
            kwargs["event_plane"] = self.options.event_plane
        self.runtime = DistributedRuntime(
            asyncio.get_running_loop(), self.options.discovery_backend, self.options.request_plane, **kwargs
        )
        self.endpoint = self.runtime.endpoint(endpoint_path)

    def _runtime(self) -> DistributedRuntime:
        assert self.runtime is not None, "create_runtime() comes first"
        return self.runtime

    def _endpoint(self) -> Endpoint:
        assert self.endpoint is not None, "create_runtime() comes first"
        return self.endpoint

    async def serve_and_register(self, plan: WorkerPlan, handler: Handler) -> None:
        from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

        # serve_endpoint returns a Future, not a coroutine (docs/reference/worker.md#pitfalls).
        self.serve = asyncio.ensure_future(
            self._endpoint().serve_endpoint(handler, health_check_payload=plan.health_check_payload)
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
            self._endpoint(),
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

    async def register_metrics(self, plan: WorkerPlan, snapshot: Callable[[], StatsSnapshot]) -> None:
        """Publish the sidecar's stats on the system status server's ``/metrics`` (docs/observability.md).

        Dynamo's own mechanism, as its Python workers use it (``register_engine_metrics_callback``): two
        callbacks on ``endpoint.metrics``, called by the runtime at each scrape (text for ``/metrics``, typed
        families for the OTLP export). Each takes one ``snapshot()`` then and maps it (:mod:`.metrics`);
        nothing is sent per request. The labels are those Dynamo injects into engine metrics.
        """
        from .metrics import common_labels, render_text, render_typed

        endpoint = self._endpoint()
        namespace, component, name = plan.endpoint_path.rsplit(".", 2)
        try:
            worker_id: str | None = format(endpoint.connection_id(), "x")
        except Exception:  # noqa: BLE001 - as Dynamo's helper: the label is left out
            LOGGER.debug("endpoint.connection_id() failed; no worker_id label", exc_info=True)
            worker_id = None
        labels = common_labels(
            namespace=namespace, component=component, endpoint=name, model=plan.served_model_name, worker_id=worker_id
        )

        def text() -> str:
            return render_text(snapshot(), labels)

        def typed() -> list[Any]:
            return list(render_typed(snapshot(), labels))

        endpoint.metrics.register_prometheus_expfmt_callback(text)
        endpoint.metrics.register_prometheus_typed_callback(typed)

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
                    self._endpoint(),
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
        self._runtime().set_health_status(ready)

    async def unregister(self) -> None:
        await self._endpoint().unregister_endpoint_instance()
        self._runtime().set_health_status(False)

    async def register(self) -> None:
        await self._endpoint().register_endpoint_instance()
        self._runtime().set_health_status(True)

    async def wait_serving_ended(self) -> None:
        """Wait for ``serve_endpoint``'s future (shielded: a cancelled waiter never cancels serving)."""
        if self.serve is not None:
            await asyncio.shield(self.serve)

    async def shutdown(self) -> None:
        """``runtime.shutdown()``: unregister at once, then the runtime drains in-flight handlers."""
        if self.runtime is not None:
            self.runtime.shutdown()
