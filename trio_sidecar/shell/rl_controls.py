"""The RL Control calls (docs/rl.md#embedded-api): ``PauseGeneration`` … ``GetWeightVersion`` on the sidecar's
connection pool, each one unary call with the pool's error edge (a gRPC status becomes the sidecar error of
its kind, ``"{Rpc}: {message} ({Code})"``).

The request messages are built here from already-validated values (:mod:`trio_sidecar.core.rl_requests` parses the JSON
bodies of the engine routes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .._proto.vllm import control_pb2
from ..core.errors import EngineShutdown
from ..core.rl_requests import PauseMode

if TYPE_CHECKING:
    from .pool import ChannelPool

__all__ = ["RlControls", "WakeState"]

_SERVICE = "/vllm.Control/"


@attrs.frozen
class WakeState:
    """After ``WakeUp`` (or ``ResumeGeneration`` on a server with sleep mode): whether the engine still sleeps.

    ``sleeping`` is None when it was not asked (a server without sleep mode).
    """

    sleeping: bool | None


class RlControls:
    """The RL Control RPCs of one sidecar. ``pool`` returns the sidecar's pool (None once it is closed)."""

    def __init__(self, pool: Any, *, sleep_mode: bool) -> None:
        self._pool = pool
        self.sleep_mode = sleep_mode

    async def _call(self, rpc: str, request: Any, response_type: Any) -> Any:
        pool: ChannelPool | None = self._pool()
        if pool is None:
            raise EngineShutdown("vLLM sidecar is not started")
        return await pool.unary(rpc, _SERVICE + rpc, request, response_type)

    # --- pause ---------------------------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode = PauseMode.ABORT, clear_cache: bool | None = None) -> None:
        request = control_pb2.PauseGenerationRequest(mode=mode.proto)
        if clear_cache is not None:
            request.clear_cache = clear_cache
        await self._call("PauseGeneration", request, control_pb2.PauseGenerationResponse)

    async def resume_generation(self) -> WakeState:
        """``ResumeGeneration``; on a server with sleep mode also ``IsSleeping`` (a resumed engine may still sleep)."""
        await self._call(
            "ResumeGeneration", control_pb2.ResumeGenerationRequest(), control_pb2.ResumeGenerationResponse
        )
        return WakeState(await self.is_sleeping() if self.sleep_mode else None)

    async def is_paused(self) -> bool:
        response = await self._call("IsPaused", control_pb2.IsPausedRequest(), control_pb2.IsPausedResponse)
        return bool(response.paused)

    # --- sleep ---------------------------------------------------------------------------------------------

    async def sleep(self, level: int | None = None, mode: PauseMode = PauseMode.ABORT) -> None:
        request = control_pb2.SleepRequest(mode=mode.proto)
        if level is not None:
            request.level = level
        await self._call("Sleep", request, control_pb2.SleepResponse)

    async def wake_up(self, tags: Sequence[str] = ()) -> WakeState:
        """``WakeUp`` then ``IsSleeping``."""
        await self._call("WakeUp", control_pb2.WakeUpRequest(tags=list(tags)), control_pb2.WakeUpResponse)
        return WakeState(await self.is_sleeping())

    async def is_sleeping(self) -> bool:
        response = await self._call("IsSleeping", control_pb2.IsSleepingRequest(), control_pb2.IsSleepingResponse)
        return bool(response.sleeping)

    # --- weights -------------------------------------------------------------------------------------------

    async def init_weight_transfer_engine(self, init_info_json: bytes) -> None:
        await self._call(
            "InitWeightTransferEngine",
            control_pb2.InitWeightTransferEngineRequest(init_info_json=init_info_json),
            control_pb2.InitWeightTransferEngineResponse,
        )

    async def start_weight_update(self, *, draft: bool = False) -> None:
        if draft:
            await self._call(
                "StartDraftWeightUpdate",
                control_pb2.StartDraftWeightUpdateRequest(),
                control_pb2.StartDraftWeightUpdateResponse,
            )
        else:
            await self._call(
                "StartWeightUpdate", control_pb2.StartWeightUpdateRequest(), control_pb2.StartWeightUpdateResponse
            )

    async def update_weights(self, update_info_json: bytes) -> None:
        await self._call(
            "UpdateWeights",
            control_pb2.UpdateWeightsRequest(update_info_json=update_info_json),
            control_pb2.UpdateWeightsResponse,
        )

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        request = control_pb2.FinishWeightUpdateRequest()
        if weight_version is not None:
            request.weight_version = weight_version
        await self._call("FinishWeightUpdate", request, control_pb2.FinishWeightUpdateResponse)

    async def update_weight_version(self, weight_version: str) -> None:
        await self._call(
            "UpdateWeightVersion",
            control_pb2.UpdateWeightVersionRequest(weight_version=weight_version),
            control_pb2.UpdateWeightVersionResponse,
        )

    async def get_weight_version(self) -> str:
        response = await self._call(
            "GetWeightVersion", control_pb2.GetWeightVersionRequest(), control_pb2.GetWeightVersionResponse
        )
        return str(response.weight_version)
