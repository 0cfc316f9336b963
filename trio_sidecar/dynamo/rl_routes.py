"""The RL controls of ``trio-sidecar run`` on Dynamo (docs/rl.md): the engine routes on the system port and the
``rl`` request-plane endpoint.

Dynamo 1.6.1's system status server (``DYN_SYSTEM_PORT``) serves ``/engine/{route}`` for every
``runtime.register_engine_route(route, callback)``: it calls ``callback(body)`` on the asyncio loop and answers
200 with the returned dict, or 500 ``{"error": "Handler error", "message": str(exc)}`` when it raises. Like
the native sidecar:

* the control routes answer their own checks as 200 ``{"status": "error", "message": …}``; the update routes
  raise them (500);
* an engine error (a gRPC status of the Control call) is raised on every route (500,
  ``{Kind}: {Rpc}: {message} ({Code})``);
* ``pause_generation`` and ``sleep`` first withdraw the worker from discovery
  (``unregister_endpoint_instance``; a failure is answered, nothing is sent to vLLM); ``resume_generation``
  and ``wake_up`` put it back once vLLM no longer sleeps.

The callbacks reach the sidecar (Trio) through :class:`.thread.TrioCalls`; the Control calls go through the
sidecar's own pool (:class:`~trio_sidecar.shell.rl_controls.RlControls`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..core.errors import InvalidArgument, SidecarError, native_error_text, native_kind_name
from ..core.rl_requests import (
    CONTROL_BODY_NOT_OBJECT,
    UPDATE_BODY_NOT_OBJECT,
    engine_routes,
    parse_finish_weight_update,
    parse_init_weight_transfer,
    parse_model_taints,
    parse_pause,
    parse_sleep,
    parse_update_weight_version,
    parse_update_weights,
    parse_wake_up,
    rl_dispatch,
    routes_answer,
    wake_state_answer,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ..api import Sidecar
    from .runtime import DynamoSide
    from .thread import TrioCalls

__all__ = ["RlSurface"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.rl")

Route = Callable[[Any], Awaitable[dict[str, Any]]]


class RouteError(Exception):
    """Raised by a route callback: the system server answers 500 ``Handler error``.

    Dynamo's Python binding prints a callback's exception as ``Python callback failed: {Class}: {message}``,
    so each kind is raised as a class named like the native sidecar's kind: after that prefix the text is
    native's (``InvalidRequest: StartWeightUpdate: … (FailedPrecondition)``).
    """


_ROUTE_ERRORS: dict[str, type[RouteError]] = {
    name: type(name, (RouteError,), {"__module__": __name__, "__qualname__": name})
    for name in ("InvalidRequest", "Internal", "EngineShutdown", "Unavailable", "Timeout", "Cancelled")
}


def _route_error(error: SidecarError) -> RouteError:
    return _ROUTE_ERRORS[native_kind_name(error)](str(error))


class RlSurface:
    """The engine routes and the ``rl`` endpoint of one worker. Every method runs on the asyncio loop."""

    def __init__(
        self,
        dynamo: DynamoSide,
        sidecar: Sidecar,
        calls: TrioCalls,
        *,
        lora: bool,
        world_size: int | None,
        admin_base_url: str | None,
        endpoint_path: str | None = None,
    ) -> None:
        self._dynamo = dynamo
        self._calls = calls
        self.capabilities = sidecar.rl_capabilities
        self._controls = sidecar.rl_controls()
        self.routes = engine_routes(self.capabilities, lora=lora)
        self._world_size = world_size
        self._admin_base_url = admin_base_url
        #: ``ns.component.rl`` with ``--enable-rl``, else None (the routes are served all the same).
        self.endpoint_path = endpoint_path

    def describe(self) -> dict[str, Any]:
        """The answer to ``{"method": "routes"}``."""
        return routes_answer(self.routes, self._dynamo.system_url(), self._world_size, self._admin_base_url)

    async def rl_handler(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """The ``rl`` request-plane endpoint: one answer per request, no Control call."""
        yield rl_dispatch(request, self.describe)

    def callbacks(self) -> dict[str, Route]:
        """``/engine/{route}`` → callback, for the routes this worker serves except the LoRA ones."""
        own = {
            "control/pause_generation": self._control(self._pause),
            "control/resume_generation": self._control(self._resume),
            "control/is_paused": self._control(self._is_paused),
            "control/is_sleeping": self._control(self._is_sleeping),
            "control/get_weight_version": self._control(self._get_weight_version),
            "control/sleep": self._control(self._sleep),
            "control/wake_up": self._control(self._wake_up),
            "update/init_weight_transfer_engine": self._update(self._init_weight_transfer),
            "update/start_weight_update": self._update(self._start_weight_update),
            "update/start_draft_weight_update": self._update(self._start_draft_weight_update),
            "update/update_weights": self._update(self._update_weights),
            "update/finish_weight_update": self._update(self._finish_weight_update),
            "update/update_weight_version": self._update(self._update_weight_version),
            "update/model_taints": self._update(self._model_taints),
        }
        return {route: callback for route, callback in own.items() if route in self.routes}

    # --- the two answer styles ----------------------------------------------------------------------------------

    @staticmethod
    def _control(handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Route:
        async def route(body: Any) -> dict[str, Any]:
            if not isinstance(body, dict):
                return {"status": "error", "message": CONTROL_BODY_NOT_OBJECT}
            try:
                return await handler(body)
            except InvalidArgument as exc:
                if exc.grpc_code is not None:  # vLLM's answer: an engine error
                    raise _route_error(exc) from exc
                return {"status": "error", "message": native_error_text(exc)}
            except SidecarError as exc:
                raise _route_error(exc) from exc

        return route

    @staticmethod
    def _update(handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Route:
        async def route(body: Any) -> dict[str, Any]:
            if not isinstance(body, dict):
                return {"status": "error", "message": UPDATE_BODY_NOT_OBJECT}
            try:
                return await handler(body)
            except SidecarError as exc:
                raise _route_error(exc) from exc

        return route

    async def _engine(self, method: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """A Control call, made on the Trio side through the sidecar's pool."""
        return await self._calls.call(method, *args)

    async def _withdraw(self, route: str) -> dict[str, Any] | None:
        try:
            await self._dynamo.withdraw_for_rl()
        except Exception as exc:  # noqa: BLE001 - Dynamo raises plain exceptions
            return {"status": "error", "message": f"failed to unregister endpoint before /engine/{route}: {exc}"}
        return None

    async def _restore(self) -> None:
        try:
            await self._dynamo.restore_after_rl()
        except Exception as exc:  # noqa: BLE001
            LOGGER.error("register_endpoint_instance failed after the RL controls resumed vLLM: %s", exc)

    # --- control routes -----------------------------------------------------------------------------------------

    async def _pause(self, body: dict[str, Any]) -> dict[str, Any]:
        request = parse_pause(body)
        failed = await self._withdraw("control/pause_generation")
        if failed is not None:
            return failed
        await self._engine(self._controls.pause_generation, request.mode, request.clear_cache)
        return {"status": "paused"}

    async def _resume(self, body: dict[str, Any]) -> dict[str, Any]:
        state = await self._engine(self._controls.resume_generation)
        if not state.sleeping:
            await self._restore()
        return wake_state_answer("resumed", state.sleeping)

    async def _is_paused(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"is_paused": await self._engine(self._controls.is_paused)}

    async def _is_sleeping(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"is_sleeping": await self._engine(self._controls.is_sleeping)}

    async def _get_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"weight_version": await self._engine(self._controls.get_weight_version)}

    async def _sleep(self, body: dict[str, Any]) -> dict[str, Any]:
        request = parse_sleep(body)
        failed = await self._withdraw("control/sleep")
        if failed is not None:
            return failed
        await self._engine(self._controls.sleep, request.level, request.mode)
        return {"status": "sleeping"}

    async def _wake_up(self, body: dict[str, Any]) -> dict[str, Any]:
        state = await self._engine(self._controls.wake_up, parse_wake_up(body))
        if not state.sleeping:
            await self._restore()
            return wake_state_answer("awake", False)
        return wake_state_answer("partially_awake", True)

    # --- update routes ------------------------------------------------------------------------------------------

    async def _init_weight_transfer(self, body: dict[str, Any]) -> dict[str, Any]:
        await self._engine(self._controls.init_weight_transfer_engine, parse_init_weight_transfer(body))
        return {"message": "Weight transfer initialized"}

    async def _start_weight_update(self, body: dict[str, Any]) -> dict[str, Any]:
        await self._engine(self._controls.start_weight_update)
        return {"message": "Weight update started"}

    async def _start_draft_weight_update(self, body: dict[str, Any]) -> dict[str, Any]:
        await self._engine(self._start_draft)
        return {"message": "Draft weight update started"}

    async def _start_draft(self) -> None:
        await self._controls.start_weight_update(draft=True)

    async def _update_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        await self._engine(self._controls.update_weights, parse_update_weights(body))
        return {"message": "Weights updated"}

    async def _finish_weight_update(self, body: dict[str, Any]) -> dict[str, Any]:
        await self._engine(self._controls.finish_weight_update, parse_finish_weight_update(body))
        return {"message": "Weight update finished"}

    async def _update_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        version = parse_update_weight_version(body)
        await self._engine(self._controls.update_weight_version, version)
        return {"success": True, "new_version": version}

    async def _model_taints(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            taints = parse_model_taints(body)
        except ValueError:
            raise  # Dynamo's own taint route raises ValueError with these texts
        await self._dynamo.update_model_taints(set(taints))
        return {"status": "ok", "taints": list(taints)}
