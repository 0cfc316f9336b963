"""LoRA adapter lifecycle through ``vllm.Control`` (docs/lora.md): load, unload, list, reconcile.

vLLM is authoritative for what is loaded: every operation starts with ``ListLoras``. The checks and texts
are in :mod:`trio_sidecar.core.lora_requests` (pure). What is *published* (a discovery record per adapter, so Dynamo's
frontend routes ``model=<adapter>`` to this worker) goes through a :class:`LoraPublisher`; the embedded API
uses :class:`NoPublisher`, ``trio-sidecar run`` Dynamo's ``register_model``/``unregister_model``.

Operations are serialized by one lock: a load decides capacity from ``ListLoras`` and must not race another
load. After a vLLM restart (the health prober's recovery) :meth:`LoraLifecycle.reconcile` loads again what
was loaded through this sidecar and vLLM no longer holds, then makes the published records match vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import trio

from .._proto.vllm import control_pb2
from ..core.errors import EngineShutdown, ErrorKind, InvalidArgument, ProtocolError, SidecarError
from ..core.lora_requests import (
    LORA_UNSUPPORTED,
    LoadRequest,
    LoadResult,
    LoraAdapter,
    check_adapter_name,
    check_capacity,
    check_hot_swap,
    check_inventory,
    not_loaded,
    parse_load_body,
    parse_lora_name,
    resolve_local_source,
)
from ..core.model import DiscoveredModel
from ..core.status import StatusCode
from .pool import ChannelPool

__all__ = ["LocalSources", "LoraLifecycle", "LoraPublisher", "NoPublisher", "SourceResolver"]

LOGGER = logging.getLogger("trio_sidecar.lora")

# A failed call whose outcome on the server is unknown (the connection went away, or the call timed out).
_AMBIGUOUS = (ErrorKind.CANNOT_CONNECT, ErrorKind.CONNECTION_TIMEOUT)

LIST_LORAS = "/vllm.Control/ListLoras"
LOAD_LORA = "/vllm.Control/LoadLora"
UNLOAD_LORA = "/vllm.Control/UnloadLora"


class LoraPublisher(Protocol):
    """Where loaded adapters are made routable (Dynamo discovery in ``trio-sidecar run``)."""

    async def publish(self, adapter: LoraAdapter, max_loras: int) -> None: ...

    async def unpublish(self, name: str) -> None: ...


class NoPublisher:
    """The embedded API's publisher: nothing to publish."""

    async def publish(self, adapter: LoraAdapter, max_loras: int) -> None:
        return None

    async def unpublish(self, name: str) -> None:
        return None


class SourceResolver(Protocol):
    """Turns a checked load request into the local adapter directory given to ``LoadLora``.

    ``trio-sidecar run`` uses Dynamo's LoRA downloader (``file://``, ``hf://``, ``s3://``; docs/lora.md#sources);
    the embedded API :class:`LocalSources`. Raises the project's errors with the native sidecar's texts.
    """

    async def resolve(self, request: LoadRequest) -> str: ...


class LocalSources:
    """The embedded API's resolver: ``file://`` directories only, nothing is downloaded."""

    async def resolve(self, request: LoadRequest) -> str:
        return resolve_local_source(request)


def _adapter(message: control_pb2.LoraAdapter) -> LoraAdapter:
    return LoraAdapter(name=message.lora_name, lora_id=message.lora_id, source_path=message.source_path)


class LoraLifecycle:
    """The adapters of one vLLM server, as seen through one sidecar.

    Args:
        pool: returns the engine's connection pool (None before the start phase / after cleanup).
        model: returns the current discovered model (refreshed after a recovery).
        hot_swap: ``DYN_LORA_HOTSWAP_ENABLED``.
        publisher: see :class:`LoraPublisher`.
        resolver: see :class:`SourceResolver` (default :class:`LocalSources`).
    """

    def __init__(
        self,
        pool: Callable[[], ChannelPool | None],
        model: Callable[[], DiscoveredModel | None],
        *,
        hot_swap: bool = False,
        publisher: LoraPublisher | None = None,
        resolver: SourceResolver | None = None,
    ) -> None:
        self._pool = pool
        self._model = model
        self.hot_swap = hot_swap
        self.publisher: LoraPublisher = publisher if publisher is not None else NoPublisher()
        self.resolver: SourceResolver = resolver if resolver is not None else LocalSources()
        self._lock = trio.Lock()
        #: Adapters loaded through this sidecar: name → the local directory given to ``LoadLora``.
        self.loaded_here: dict[str, str] = {}
        #: Names with a published discovery record.
        self.published: set[str] = set()
        self._reconcile_wanted = trio.Event()
        self._reconciled = False
        self._reload_pending = False  # a vLLM recovery asked for a reload that has not completed yet

    # -- Control calls ----------------------------------------------------------------------------------

    def _started(self) -> tuple[ChannelPool, DiscoveredModel]:
        pool, model = self._pool(), self._model()
        if pool is None or model is None:
            raise EngineShutdown("vLLM sidecar is not started")
        if not model.supports_lora:
            raise InvalidArgument(LORA_UNSUPPORTED)
        return pool, model

    async def _list(self, pool: ChannelPool, *, checked: bool = False) -> list[LoraAdapter]:
        """``ListLoras``; ``checked``: refuse an ambiguous list (:func:`check_inventory`), as native does
        for a list, a load and a reconciliation (observed). The list that decides a failed load is checked
        too, as in Dynamo's public sidecar source; that case was not observed on 1.6.1."""
        response = await pool.unary(
            "ListLoras", LIST_LORAS, control_pb2.ListLorasRequest(), control_pb2.ListLorasResponse
        )
        adapters = [_adapter(a) for a in response.adapters]
        if checked:
            check_inventory(adapters)
        return adapters

    @staticmethod
    def _expect(message: control_pb2.LoraAdapter, has: bool, name: str) -> LoraAdapter:
        if not has:
            raise ProtocolError(f"vLLM returned no adapter identity for LoRA `{name}`")
        if message.lora_name != name:
            raise ProtocolError(f"vLLM returned adapter `{message.lora_name}` for LoRA `{name}`")
        return _adapter(message)

    async def _load(self, pool: ChannelPool, name: str, path: str) -> LoraAdapter:
        response = await pool.unary(
            "LoadLora",
            LOAD_LORA,
            control_pb2.LoadLoraRequest(lora_name=name, source_path=path),
            control_pb2.LoadLoraResponse,
        )
        return self._expect(response.adapter, response.HasField("adapter"), name)

    async def _unload(self, pool: ChannelPool, name: str) -> LoraAdapter:
        response = await pool.unary(
            "UnloadLora", UNLOAD_LORA, control_pb2.UnloadLoraRequest(lora_name=name), control_pb2.UnloadLoraResponse
        )
        return self._expect(response.adapter, response.HasField("adapter"), name)

    # -- operations -------------------------------------------------------------------------------------
    #
    # Like the native sidecar, every operation first reconciles when the last one left the state unsure
    # (``_reconciled`` false: at start, after a vLLM recovery, or after a load/unload that failed once it had
    # begun). That is why a refused request can still make one ``ListLoras`` call: it is the
    # reconciliation's, not the request's.

    async def _ensure_reconciled(self) -> None:
        if self._reconciled:
            return
        try:
            await self.reconcile(reload=self._reload_pending)
        except SidecarError as exc:
            LOGGER.warning("LoRA reconciliation is still failing: %s; continuing with the requested operation", exc)

    async def list_adapters(self) -> list[LoraAdapter]:
        """``ListLoras``: the adapters vLLM holds, in its order."""
        pool, _ = self._started()
        await self._ensure_reconciled()
        return await self._list(pool, checked=True)

    async def load(self, name: str, uri: str) -> LoadResult:
        """Load ``uri`` (``file:///abs/dir``) as adapter ``name`` and publish it; see :meth:`load_body`."""
        return await self.load_body({"lora_name": name, "source": {"uri": uri}})

    async def load_body(self, body: Mapping[str, Any]) -> LoadResult:
        """Load the adapter of a ``{"lora_name": …, "source": {"uri": …}}`` body and publish it.

        Control calls: ``ListLoras``, then ``LoadLora`` unless a check refuses (the texts of
        :mod:`trio_sidecar.core.lora_requests`) or the name is already loaded (then the answer is "already loaded", whatever
        the path, unless hot swap was requested). When publishing fails, the adapter is unloaded again.
        """
        pool, model = self._started()
        await self._ensure_reconciled()
        request = parse_load_body(body)
        async with self._lock:
            was_reconciled, self._reconciled = self._reconciled, False
            loaded = await self._list(pool, checked=True)
            check_adapter_name(request.name, (model.served_model_name, *model.served_model_aliases), loaded)
            existing = next((a for a in loaded if a.name == request.name), None)
            max_loras = model.server_info.max_loras
            if existing is not None:
                check_hot_swap(request.name, self.hot_swap)
                await self._publish(existing, max_loras)
                self._reconciled = was_reconciled
                return LoadResult(existing, already_loaded=True)
            check_capacity(len(loaded), max_loras)
            path = await self.resolver.resolve(request)
            try:
                adapter = await self._load(pool, request.name, path)
            except SidecarError as exc:
                observed = await self._after_failed_load(pool, request.name, path, exc)
                if observed is None:
                    raise
                adapter, already = observed
                if already:
                    await self._publish(adapter, max_loras)
                    self._reconciled = was_reconciled
                    return LoadResult(adapter, already_loaded=True)
            try:
                await self._publish(adapter, max_loras)
            except BaseException as exc:
                LOGGER.error("failed to publish LoRA %r (%s); rolling back the load", request.name, exc)
                with trio.CancelScope(shield=True):
                    try:
                        await self._unload(pool, request.name)
                    except SidecarError as undo:
                        LOGGER.warning("rolling back the load of LoRA %r failed: %s", request.name, undo)
                raise
            self.loaded_here[request.name] = path
            self._reconciled = was_reconciled
            LOGGER.info("loaded LoRA adapter %r (lora_id %d)", adapter.name, adapter.lora_id)
            return LoadResult(adapter, already_loaded=False)

    async def unload(self, name: str) -> LoraAdapter:
        """Unload adapter ``name``; see :meth:`unload_body`."""
        return await self.unload_body({"lora_name": name})

    async def unload_body(self, body: Mapping[str, Any]) -> LoraAdapter:
        """Unpublish, then ``UnloadLora`` (Control calls: ``ListLoras``, ``UnloadLora``)."""
        pool, _ = self._started()
        await self._ensure_reconciled()
        name = parse_lora_name(body)
        async with self._lock:
            was_reconciled, self._reconciled = self._reconciled, False
            loaded = await self._list(pool)
            existing = next((a for a in loaded if a.name == name), None)
            if existing is None:
                raise not_loaded(name, [a.name for a in loaded])
            # Stop routing new requests to the adapter before vLLM drops it.
            was_published = name in self.published
            if was_published:
                await self.publisher.unpublish(name)
                self.published.discard(name)
            path = self.loaded_here.pop(name, None)
            try:
                removed = await self._unload(pool, name)
            except SidecarError as exc:
                still = await self._after_failed_unload(pool, existing, exc)
                if still is not None:
                    # vLLM still holds it: route to it again, as before this request.
                    if path is not None:
                        self.loaded_here[name] = path
                    if was_published:
                        with trio.CancelScope(shield=True):
                            try:
                                await self._publish(still, self._max_loras())
                            except SidecarError as undo:
                                LOGGER.warning("republishing LoRA %r after a failed unload failed: %s", name, undo)
                    raise
                removed = existing
            self._reconciled = was_reconciled
            LOGGER.info("unloaded LoRA adapter %r (lora_id %d)", name, removed.lora_id)
            return removed

    def _max_loras(self) -> int:
        model = self._model()
        return model.server_info.max_loras if model is not None else 0

    async def _find(self, pool: ChannelPool, name: str, *, checked: bool = False) -> LoraAdapter | None:
        return next((a for a in await self._list(pool, checked=checked) if a.name == name), None)

    async def _after_failed_load(
        self, pool: ChannelPool, name: str, path: str, error: SidecarError
    ) -> tuple[LoraAdapter, bool] | None:
        """What a failed ``LoadLora`` left behind, as the native sidecar decides it.

        ``ALREADY_EXISTS`` (another client loaded the name meanwhile): "already loaded" when ``ListLoras``
        shows it. A lost connection or a timeout (the outcome is unknown): loaded when ``ListLoras`` shows
        it from the same directory. Returns ``(adapter, already_loaded)``, or None to raise ``error``.
        """
        if error.grpc_code is StatusCode.ALREADY_EXISTS:
            observed = await self._find(pool, name, checked=True)
            if observed is None:
                raise ProtocolError(
                    f"LoadLora reported `{name}` as already loaded but ListLoras does not report it"
                ) from error
            return observed, True
        if error.kind in _AMBIGUOUS:
            LOGGER.warning("LoadLora outcome for LoRA %r is ambiguous (%s); reconciling", name, error)
            observed = await self._find(pool, name, checked=True)
            if observed is None:
                return None
            if observed.source_path != path:
                raise ProtocolError(
                    f"LoRA adapter `{name}` is loaded from `{observed.source_path}` but this load requested "
                    f"`{path}`; vLLM and Dynamo disagree about adapter state"
                ) from error
            return observed, False
        return None

    async def _after_failed_unload(
        self, pool: ChannelPool, existing: LoraAdapter, error: SidecarError
    ) -> LoraAdapter | None:
        """The adapter vLLM still holds after a failed ``UnloadLora`` (None: it is gone, the unload counts).

        ``NOT_FOUND``: gone. A lost connection or a timeout: ``ListLoras`` decides. Any other status: vLLM
        refused, the adapter is still loaded.
        """
        if error.grpc_code is StatusCode.NOT_FOUND:
            return None
        if error.kind in _AMBIGUOUS:
            LOGGER.warning("UnloadLora outcome for LoRA %r is ambiguous (%s); reconciling", existing.name, error)
            return await self._find(pool, existing.name)
        return existing

    async def _publish(self, adapter: LoraAdapter, max_loras: int) -> None:
        await self.publisher.publish(adapter, max_loras)
        self.published.add(adapter.name)

    # -- reconciliation ---------------------------------------------------------------------------------

    def request_reconcile(self) -> None:
        """Ask :meth:`run_reconciler` for a pass that also reloads (called synchronously on a vLLM recovery).

        Nothing to do (no Control call) while no adapter was loaded or published through this sidecar.
        """
        if not (self.loaded_here or self.published):
            return
        self._reconciled = False
        self._reload_pending = True
        self._reconcile_wanted.set()

    async def run_reconciler(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reconcile whenever :meth:`request_reconcile` was called; runs until cancelled."""
        task_status.started()
        while True:
            await self._reconcile_wanted.wait()
            self._reconcile_wanted = trio.Event()
            try:
                await self.reconcile(reload=self._reload_pending)
            except SidecarError as exc:
                LOGGER.warning(
                    "LoRA reconciliation after the vLLM restart failed: %s; it is retried on the next operation", exc
                )

    async def reconcile(self, *, reload: bool = False) -> list[str]:
        """Make vLLM and the published records agree again, after a start or a vLLM restart.

        ``ListLoras``; with ``reload`` (after a vLLM recovery), an adapter loaded through this sidecar that
        vLLM no longer holds is loaded again (``LoadLora`` with the same directory); every adapter vLLM
        holds is published; a published name vLLM does not hold is unpublished. Returns the names loaded
        again.
        """
        pool, model = self._started()
        reloaded: list[str] = []
        async with self._lock:
            held = {a.name: a for a in await self._list(pool, checked=True)}
            for name, path in list(self.loaded_here.items()):
                if name in held or not reload:
                    continue
                try:
                    held[name] = await self._load(pool, name, path)
                except SidecarError as exc:
                    LOGGER.warning("LoRA %r was not loaded again after the vLLM restart: %s", name, exc)
                    del self.loaded_here[name]
                    continue
                reloaded.append(name)
            for name in sorted(self.published - held.keys()):
                await self.publisher.unpublish(name)
                self.published.discard(name)
            for adapter in held.values():
                await self._publish(adapter, model.server_info.max_loras)
            if reload or not self._reload_pending:  # (a pending reload keeps what it is to load again)
                self.loaded_here = {name: path for name, path in self.loaded_here.items() if name in held}
            self._reconciled = True
            if reload:
                self._reload_pending = False
        if reloaded:
            LOGGER.info(
                "loaded %d LoRA adapter(s) again after the vLLM restart: %s", len(reloaded), ", ".join(reloaded)
            )
        return reloaded
