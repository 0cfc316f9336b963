"""The LoRA surface of ``trio-sidecar run`` on Dynamo (docs/lora.md).

Dynamo 1.6.1's system status server (``DYN_SYSTEM_PORT``) serves ``GET/POST /v1/loras`` and
``DELETE /v1/loras/{name}`` when ``DYN_LORA_ENABLED`` is set; it forwards each to a handler named
``list_loras``/``load_lora``/``unload_lora``, looked up first among local endpoints, then among the engine
routes as ``update/{name}``. Like the native sidecar, trio-sidecar registers the three engine routes
(``/engine/update/list_loras`` … answer too) and no request-plane endpoint. The system server answers 500
for a ``{"status":"error"}`` answer, 422 for a body without ``lora_name``/``source``, and "LoRA management
not available" when the routes are not registered (LoRA not enabled, or the server reports ``max_loras`` 0).

The route callbacks run on the asyncio thread; they reach the sidecar's :class:`LoraLifecycle` (Trio)
through :class:`.thread.TrioCalls`, and the lifecycle publishes adapters back on the loop through
:meth:`AsyncioThread.run`, like every other Dynamo call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..core.errors import SidecarError, UnknownError
from ..core.lora_requests import (
    LORA_UNAVAILABLE,
    LoadRequest,
    LoraAdapter,
    check_adapter_directory,
    error_answer,
    hot_swap_requested,
    list_answer,
    list_error_answer,
    load_answer,
    lora_serving_requested,
    source_not_resolved,
    unload_answer,
)
from .thread import AsyncioThread, TrioCalls

if TYPE_CHECKING:
    from ..api import Sidecar
    from ..shell.lora_lifecycle import LoraLifecycle
    from .plan import WorkerPlan
    from .runtime import DynamoSide

__all__ = ["DynamoLoraPublisher", "DynamoSources", "lora_routes", "start_lora"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.lora")

Route = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class DynamoLoraPublisher:
    """Publishes an adapter as its own model record (``register_model(lora_name=…)``) on the loop."""

    def __init__(self, thread: AsyncioThread, dynamo: DynamoSide, plan: WorkerPlan) -> None:
        self._thread = thread
        self._dynamo = dynamo
        self._plan = plan

    async def publish(self, adapter: LoraAdapter, max_loras: int) -> None:
        try:
            await self._thread.run(self._dynamo.register_lora, self._plan, adapter.name, adapter.lora_id, max_loras)
        except Exception as exc:  # noqa: BLE001 - Dynamo raises plain exceptions
            raise UnknownError(f"failed to publish the discovery record of LoRA `{adapter.name}`: {exc}") from exc

    async def unpublish(self, name: str) -> None:
        try:
            await self._thread.run(self._dynamo.unregister_lora, name)
        except Exception as exc:  # noqa: BLE001
            raise UnknownError(f"failed to remove the discovery record of LoRA `{name}`: {exc}") from exc


class DynamoSources:
    """Resolves ``file://``, ``hf://`` and ``s3://`` sources with Dynamo's LoRA downloader, as the native sidecar.

    ``dynamo._core.LoRADownloader`` (the same Rust downloader the native sidecar builds) runs on the loop;
    its settings come from the worker's environment (docs/lora.md#sources): ``DYN_LORA_PATH`` (the ``s3://``
    cache), ``HF_ENDPOINT``/``HF_HOME``/``HF_TOKEN``/``HF_HUB_OFFLINE`` (``hf://``, into the Hugging Face
    cache), the AWS configuration (``AWS_ENDPOINT_URL``, credentials, ``AWS_ALLOW_HTTP``, …) for ``s3://``.
    The downloaded directory is then checked in Trio like a local one.
    """

    def __init__(self, thread: AsyncioThread) -> None:
        self._thread = thread
        self._downloader: Any = None  # created on the loop at the first load, like the native sidecar's

    async def resolve(self, request: LoadRequest) -> str:
        path, failure = await self._thread.run(self._download, request.uri)
        if failure is not None:
            raise source_not_resolved(request.uri, failure)
        return check_adapter_directory(path)

    async def _download(self, uri: str) -> tuple[str, str | None]:
        """On the loop: ``(path, None)``, or ``("", the downloader's message)``."""
        from dynamo._core import LoRADownloader

        try:
            if self._downloader is None:
                self._downloader = LoRADownloader()
            return str(await self._downloader.download_if_needed(uri)), None
        except Exception as exc:  # noqa: BLE001 - the binding raises plain RuntimeError
            return "", str(exc)


def lora_routes(lifecycle: LoraLifecycle, calls: TrioCalls) -> dict[str, Route]:
    """The three engine routes (asyncio callbacks), answering like the native sidecar's."""

    async def list_loras(body: dict[str, Any]) -> dict[str, Any]:
        try:
            return list_answer(await calls.call(lifecycle.list_adapters))
        except SidecarError as exc:
            return list_error_answer(exc)

    async def load_lora(body: dict[str, Any]) -> dict[str, Any]:
        try:
            return load_answer(await calls.call(lifecycle.load_body, body))
        except SidecarError as exc:
            return error_answer(exc, body)

    async def unload_lora(body: dict[str, Any]) -> dict[str, Any]:
        try:
            return unload_answer(await calls.call(lifecycle.unload_body, body))
        except SidecarError as exc:
            return error_answer(exc, body)

    return {"update/list_loras": list_loras, "update/load_lora": load_lora, "update/unload_lora": unload_lora}


async def start_lora(
    thread: AsyncioThread,
    dynamo: DynamoSide,
    plan: WorkerPlan,
    sidecar: Sidecar,
    nursery: trio.Nursery,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Turn the LoRA surface on when ``DYN_LORA_ENABLED`` is set and vLLM reports ``max_loras`` > 0.

    Registers the engine routes and the Dynamo publisher; the adapters vLLM already holds are published
    later by :func:`publish_held` (after the base model's registration). Returns whether it is on.
    """
    if not (lora_serving_requested(environ) and sidecar.model.supports_lora):
        if lora_serving_requested(environ):
            LOGGER.warning(LORA_UNAVAILABLE)
        else:
            LOGGER.debug(LORA_UNAVAILABLE)
        return False
    lifecycle = sidecar.lora
    lifecycle.hot_swap = hot_swap_requested(environ)
    lifecycle.publisher = DynamoLoraPublisher(thread, dynamo, plan)
    lifecycle.resolver = DynamoSources(thread)
    calls = TrioCalls(trio.lowlevel.current_trio_token(), nursery)

    routes = lora_routes(lifecycle, calls)

    async def register() -> None:
        dynamo.register_engine_routes(routes)

    await thread.run(register)
    return True


async def publish_held(lifecycle: LoraLifecycle) -> None:
    """The start-up ``ListLoras``: publish the adapters vLLM already holds (loaded before this sidecar)."""
    try:
        await lifecycle.reconcile()
    except SidecarError as exc:
        LOGGER.warning(
            "LoRA start-up reconciliation failed: %s; serving the base model without the adapters vLLM holds", exc
        )
