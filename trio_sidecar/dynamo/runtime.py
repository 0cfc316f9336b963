"""The runtime side: the Dynamo objects of one worker (docs/reference/worker.md#startup-sequence).

Every method runs on the asyncio thread's loop, the one Dynamo's runtime was given (:mod:`.thread`); the
worker awaits the coroutines with ``AsyncioThread.run``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core import mm_routing
from ..core.config import WorkerOptions
from .metrics import Lifecycle
from .prefill_completion import PrefillCompletion

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from dynamo.llm import KvEventPublisher
    from dynamo.runtime import DistributedRuntime, Endpoint

    from ..core.routing import KvEventSource
    from ..core.stats import StatsSnapshot
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
        # The image placeholder the publishers key image blocks on (resolve_image_token_id); None = raw ids.
        self.image_token_id: int | None = None
        # The lifecycle gauges on /metrics (written by the worker, read at each scrape).
        self.lifecycle = Lifecycle()
        # Worker-side prefill completion for the KV router (created with the registration).
        self.prefill_completion = PrefillCompletion()

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
        # serve_endpoint returns a Future, not a coroutine (docs/reference/worker.md#pitfalls).
        self.serve = asyncio.ensure_future(
            self._endpoint().serve_endpoint(handler, health_check_payload=plan.health_check_payload)
        )
        # Before the model card: the router may route here as soon as it sees the card.
        self.prefill_completion = await PrefillCompletion.create(self._endpoint(), plan.worker_type)
        await self._register_model(plan, plan.served_model_name, model_aliases=list(plan.aliases) or None)
        if self.serve.done():  # serving failed at once (e.g. the request plane could not bind)
            self.serve.result()

    async def _register_model(self, plan: WorkerPlan, name: str, **extra: Any) -> None:
        from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

        rc = ModelRuntimeConfig()
        for key, value in plan.runtime_config.items():
            if key == "runtime_data":
                for data_key, data_value in value.items():
                    rc.set_engine_specific(data_key, json.dumps(data_value))  # takes JSON text
            else:
                setattr(rc, key, value)
        if plan.encoder_result_handoff:
            rc.set_engine_specific("encoder_result_handoff", "true")
        if plan.max_gpu_lora_count is not None:
            extra.setdefault("max_gpu_lora_count", plan.max_gpu_lora_count)
        model_type = getattr(ModelType, plan.model_types[0])
        for type_name in plan.model_types[1:]:
            model_type = model_type | getattr(ModelType, type_name)
        await register_model(
            ModelInput.Tokens,
            model_type,
            self._endpoint(),
            plan.model_path,
            name,
            worker_type=getattr(WorkerType, plan.worker_type),
            needs=[[getattr(WorkerType, n) for n in group] for group in plan.needs] or None,
            kv_cache_block_size=plan.kv_cache_block_size,
            runtime_config=rc,
            custom_template_path=plan.custom_template_path,
            **extra,
        )

    async def register_lora(self, plan: WorkerPlan, lora_name: str, lora_id: int, max_loras: int) -> None:
        """A model record for one loaded adapter (``model=<adapter>`` routes here; docs/lora.md#discovery)."""
        await self._register_model(
            plan,
            lora_name,
            lora_name=lora_name,
            base_model_path=plan.model_path,
            max_gpu_lora_count=max_loras,
            user_data={"lora_adapter": True, "lora_id": lora_id},
        )

    async def unregister_lora(self, lora_name: str) -> None:
        from dynamo.llm import unregister_model

        await unregister_model(self._endpoint(), lora_name=lora_name)

    async def resolve_image_token_id(self, model: str, supports_multimodal: bool) -> int | None:
        """The image placeholder of a multimodal model, as the native sidecar resolves it (docs/reference/worker.md#multimodal-kv-routing).

        Kept in :attr:`image_token_id` for every later :meth:`replace_publishers`. A text-only model is not
        looked at; any failure only leaves exact multimodal routing off (logged), never the worker.
        """
        self.image_token_id = None
        if not supports_multimodal:
            return None
        model_dir = _local_model_dir(model)
        if model_dir is None:
            from dynamo.llm import fetch_model

            try:
                model_dir = await asyncio.wait_for(
                    fetch_model(model, ignore_weights=True), mm_routing.FETCH_TIMEOUT_SECONDS
                )
            except TimeoutError:
                return self._settle(mm_routing.fetch_failed(model, mm_routing.FETCH_TIMED_OUT))
            except Exception as exc:  # noqa: BLE001 - any fetch failure only disables exact routing
                return self._settle(mm_routing.fetch_failed(model, str(exc)))
        return self._settle(mm_routing.resolve_image_token(model, str(model_dir), _resolver()))

    def _settle(self, outcome: mm_routing.ImageTokenOutcome) -> int | None:
        LOGGER.log(outcome.level, "%s", outcome.message)
        self.image_token_id = outcome.image_token_id
        return outcome.image_token_id

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
        # The lifecycle gauges carry native's model labels: the model path, and the served name.
        lifecycle_labels = common_labels(
            namespace=namespace,
            component=component,
            endpoint=name,
            model=plan.model_path,
            model_name=plan.served_model_name,
            worker_id=worker_id,
        )
        lifecycle = self.lifecycle

        def text() -> str:
            return render_text(snapshot(), labels, lifecycle, lifecycle_labels)

        def typed() -> list[Any]:
            return list(render_typed(snapshot(), labels, lifecycle, lifecycle_labels))

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
                    image_token_id=self.image_token_id,
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

    # --- RL controls (docs/rl.md) -------------------------------------------------------------------------------

    #: Whether a pause or sleep of the RL controls took the instance out of discovery (until resumed).
    rl_withdrawn: bool = False
    rl_serve: asyncio.Future[None] | None = None

    def system_url(self) -> str | None:
        """The system status server's URL (``DYN_SYSTEM_PORT``), None when it is off."""
        # In the 1.6.1 binding, not in its type stub.
        url: str | None = getattr(self._runtime(), "system_status_server_url")()  # noqa: B009
        return url

    def register_engine_routes(self, routes: Mapping[str, Callable[[Any], Any]]) -> None:
        """``/engine/{route}`` on the system status server, one callback each (called on this loop)."""
        for route, callback in routes.items():
            self._runtime().register_engine_route(route, callback)

    async def serve_rl_endpoint(self, path: str, handler: Handler) -> None:
        """Serve the ``rl`` request-plane endpoint (``ns.component.rl``) next to the generate endpoint."""
        self.rl_serve = asyncio.ensure_future(self._runtime().endpoint(path).serve_endpoint(handler))
        await asyncio.sleep(0)
        if self.rl_serve.done():
            self.rl_serve.result()

    async def withdraw_for_rl(self) -> None:
        """Before a pause or a sleep: ``unregister_endpoint_instance`` (raises Dynamo's error as it is)."""
        await self._endpoint().unregister_endpoint_instance()
        self.rl_withdrawn = True

    async def restore_after_rl(self) -> None:
        """After a resume or wake-up that left vLLM awake: back into discovery if the RL controls took it out."""
        if self.rl_withdrawn:
            await self._endpoint().register_endpoint_instance()
            self.rl_withdrawn = False

    async def update_model_taints(self, taints: set[str]) -> None:
        from dynamo.llm import update_model_taints

        await update_model_taints(self._endpoint(), taints)


def _local_model_dir(model: str) -> str | None:
    """``model`` when it names a local directory (used as is, like native), else None (fetched).

    One ``stat`` at startup, on the asyncio thread: nothing is serving yet."""
    return model if os.path.isdir(model) else None


def _resolver() -> mm_routing.Resolver:
    """Dynamo's resolver; bindings built without the ``mm-routing`` feature lack it, and then the frontend
    skips exact multimodal routing too, so resolving nothing is consistent."""
    try:
        from dynamo._core import resolve_routing_image_token_id
    except ImportError:
        return lambda _model, _model_dir: None
    return resolve_routing_image_token_id
