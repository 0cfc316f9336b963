"""The mock's ``vllm.Control`` servicer and its fixed answers (docs/reference/mock.md#control-and-health-answers,
docs/reference/mock.md#lora-adapters, docs/reference/mock.md#rl-controls)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio_sidecar
from trio_sidecar._proto.vllm import control_grpc, control_pb2
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock import engine_args as _engine_args
from trio_sidecar.mock import lora as _lora
from trio_sidecar.mock import rl as _rl
from trio_sidecar.mock.config import PreparedConfig
from trio_sidecar.mock.generation import RequestRejected
from trio_sidecar.transport import RpcError

if TYPE_CHECKING:
    from trio_sidecar.mock.server import MockServer

__all__ = ["SHUTDOWN_UNIMPLEMENTED", "ControlServicer", "model_info", "rl_capabilities", "server_info"]

SHUTDOWN_UNIMPLEMENTED = "shutdown is not supported by the mocker"


def _recorded(handler: Callable[..., Any]) -> Callable[..., Any]:
    """A Control handler that first records ``(rpc name, request)`` in ``MockServer.control_calls`` and
    turns the pure modules' ``RequestRejected`` into its RPC status."""
    name = handler.__name__

    async def wrapper(self: ControlServicer, request: Any, context: Any) -> Any:
        server = self._server
        if server._record:
            server.control_calls.append((name, request))
        try:
            return await handler(self, request, context)
        except RequestRejected as err:
            raise RpcError(err.code, err.message) from None

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = handler.__doc__
    return wrapper


class ControlServicer(control_grpc.ControlServicer):
    """Control: fixed answers, ``Abort``, and the LoRA and RL RPCs on the server's adapter table and RL
    state (docs/reference/mock.md#lora-adapters, docs/reference/mock.md#rl-controls). Every call is recorded
    first, whatever its outcome."""

    def __init__(self, server: MockServer) -> None:
        self._server = server

    @_recorded
    async def GetServerInfo(self, request: Any, context: Any) -> control_pb2.ServerInfo:  # noqa: N802
        return self._server.server_info

    @_recorded
    async def GetModelInfo(self, request: Any, context: Any) -> control_pb2.ModelInfo:  # noqa: N802
        return self._server.model_info

    @_recorded
    async def Abort(self, request: control_pb2.AbortRequest, context: Any) -> control_pb2.AbortResponse:  # noqa: N802
        self._server.abort(request.request_ids)
        return control_pb2.AbortResponse()

    @_recorded
    async def GetKvEventSources(self, request: Any, context: Any) -> control_pb2.GetKvEventSourcesResponse:  # noqa: N802
        response = control_pb2.GetKvEventSourcesResponse()
        for rank, pub in enumerate(self._server._publishers, start=self._server._first_rank):
            replay_port = pub.replay_port
            response.sources.add(
                transport="zmq",
                endpoint=f"tcp://0.0.0.0:{pub.port}",
                topic="",
                replay_endpoint=f"tcp://0.0.0.0:{replay_port}" if replay_port is not None else "",
                data_parallel_rank=rank,
                encoding="msgpack",
                schema_version=1,
            )
        return response

    # --- LoRA (docs/reference/mock.md#lora-adapters) ---------------------------------------------------

    @_recorded
    async def LoadLora(self, request: control_pb2.LoadLoraRequest, context: Any) -> control_pb2.LoadLoraResponse:  # noqa: N802
        adapter = self._server.lora.load(request.lora_name, request.source_path)
        return control_pb2.LoadLoraResponse(adapter=_adapter_pb(adapter))

    @_recorded
    async def UnloadLora(self, request: control_pb2.UnloadLoraRequest, context: Any) -> control_pb2.UnloadLoraResponse:  # noqa: N802
        adapter = self._server.lora.unload(request.lora_name)
        return control_pb2.UnloadLoraResponse(adapter=_adapter_pb(adapter))

    @_recorded
    async def ListLoras(self, request: Any, context: Any) -> control_pb2.ListLorasResponse:  # noqa: N802
        return control_pb2.ListLorasResponse(adapters=[_adapter_pb(a) for a in self._server.lora.list()])

    # --- RL (docs/reference/mock.md#rl-controls) -------------------------------------------------------

    @_recorded
    async def PauseGeneration(
        self, request: control_pb2.PauseGenerationRequest, context: Any
    ) -> control_pb2.PauseGenerationResponse:  # noqa: N802
        mode = self._server.rl.pause(_rl.PauseMode.from_proto(request.mode))
        await self._server.apply_pause(mode)
        return control_pb2.PauseGenerationResponse()

    @_recorded
    async def ResumeGeneration(self, request: Any, context: Any) -> control_pb2.ResumeGenerationResponse:  # noqa: N802
        self._server.rl.resume()
        return control_pb2.ResumeGenerationResponse()

    @_recorded
    async def IsPaused(self, request: Any, context: Any) -> control_pb2.IsPausedResponse:  # noqa: N802
        return control_pb2.IsPausedResponse(paused=self._server.rl.paused)

    @_recorded
    async def Sleep(self, request: control_pb2.SleepRequest, context: Any) -> control_pb2.SleepResponse:  # noqa: N802
        level = request.level if request.HasField("level") else None
        mode = self._server.rl.sleep(level, _rl.PauseMode.from_proto(request.mode))
        await self._server.apply_pause(mode)
        return control_pb2.SleepResponse()

    @_recorded
    async def WakeUp(self, request: control_pb2.WakeUpRequest, context: Any) -> control_pb2.WakeUpResponse:  # noqa: N802
        self._server.rl.wake_up(list(request.tags))
        return control_pb2.WakeUpResponse()

    @_recorded
    async def IsSleeping(self, request: Any, context: Any) -> control_pb2.IsSleepingResponse:  # noqa: N802
        return control_pb2.IsSleepingResponse(sleeping=self._server.rl.sleeping)

    @_recorded
    async def InitWeightTransferEngine(
        self, request: control_pb2.InitWeightTransferEngineRequest, context: Any
    ) -> control_pb2.InitWeightTransferEngineResponse:  # noqa: N802
        self._server.rl.init_weight_transfer(request.init_info_json)
        return control_pb2.InitWeightTransferEngineResponse()

    @_recorded
    async def StartWeightUpdate(self, request: Any, context: Any) -> control_pb2.StartWeightUpdateResponse:  # noqa: N802
        self._server.rl.start_weight_update()
        return control_pb2.StartWeightUpdateResponse()

    @_recorded
    async def StartDraftWeightUpdate(self, request: Any, context: Any) -> control_pb2.StartDraftWeightUpdateResponse:  # noqa: N802
        self._server.rl.start_weight_update(draft=True)
        return control_pb2.StartDraftWeightUpdateResponse()

    @_recorded
    async def UpdateWeights(
        self, request: control_pb2.UpdateWeightsRequest, context: Any
    ) -> control_pb2.UpdateWeightsResponse:  # noqa: N802
        self._server.rl.update_weights(request.update_info_json)
        return control_pb2.UpdateWeightsResponse()

    @_recorded
    async def FinishWeightUpdate(
        self, request: control_pb2.FinishWeightUpdateRequest, context: Any
    ) -> control_pb2.FinishWeightUpdateResponse:  # noqa: N802
        version = request.weight_version if request.HasField("weight_version") else None
        self._server.rl.finish_weight_update(version)
        return control_pb2.FinishWeightUpdateResponse()

    @_recorded
    async def UpdateWeightVersion(
        self, request: control_pb2.UpdateWeightVersionRequest, context: Any
    ) -> control_pb2.UpdateWeightVersionResponse:  # noqa: N802
        self._server.rl.set_weight_version(request.weight_version)
        return control_pb2.UpdateWeightVersionResponse()

    @_recorded
    async def GetWeightVersion(self, request: Any, context: Any) -> control_pb2.GetWeightVersionResponse:  # noqa: N802
        return control_pb2.GetWeightVersionResponse(weight_version=self._server.rl.weight_version)

    @_recorded
    async def Shutdown(self, request: Any, context: Any) -> Any:  # noqa: N802
        raise RpcError(StatusCode.UNIMPLEMENTED, SHUTDOWN_UNIMPLEMENTED)


def _adapter_pb(adapter: _lora.LoraAdapter) -> control_pb2.LoraAdapter:
    return control_pb2.LoraAdapter(
        lora_id=adapter.lora_id, lora_name=adapter.lora_name, source_path=adapter.source_path
    )


def rl_capabilities(args: _engine_args.EngineArgs) -> _rl.RlCapabilities:
    return _rl.RlCapabilities(
        weight_transfer_backend=args.weight_transfer_backend or "",
        sleep_mode_enabled=args.enable_sleep_mode,
        draft_weight_updates_enabled=args.enable_draft_weight_updates,
    )


# --- fixed Control values (docs/reference/mock.md#control-and-health-answers) --------------------------------------------------------------------


def server_info(prepared: PreparedConfig) -> control_pb2.ServerInfo:
    args = prepared.args
    return control_pb2.ServerInfo(
        engine_version=trio_sidecar.__version__,
        api_version="vllm",
        instance_id=f"trio-sidecar-mock-{prepared.mode.value}",
        parallelism=control_pb2.ParallelismInfo(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            data_parallel_size=args.dp_size,
            data_parallel_rank=args.data_parallel_rank,
            decode_context_parallel_size=1,
            world_size=args.world_size,
            data_parallel_size_local=len(args.local_ranks)
            if args.data_parallel_size_local is None
            else args.data_parallel_size_local,
        ),
        max_model_len=args.max_model_len or 0,
        kv_block_size=args.block_size,
        # vLLM sums the KV blocks of the ranks it hosts.
        total_kv_blocks=(
            args.num_gpu_blocks * len(args.local_ranks) if args.total_kv_blocks is None else args.total_kv_blocks
        ),
        max_running_requests=args.max_num_seqs or 0,
        max_batched_tokens=args.max_num_batched_tokens or 0,
        max_loras=args.max_loras,
        rl_capabilities=control_pb2.RlCapabilities(
            weight_transfer_enabled=bool(args.weight_transfer_backend),
            weight_transfer_backend=args.weight_transfer_backend or "",
            sleep_mode_enabled=args.enable_sleep_mode,
            draft_weight_updates_enabled=args.enable_draft_weight_updates,
        ),
        effective_attention_block_size=(
            args.block_size if args.effective_attention_block_size == -1 else args.effective_attention_block_size
        ),
    )


def model_info(prepared: PreparedConfig) -> control_pb2.ModelInfo:
    config = prepared.config
    return control_pb2.ModelInfo(
        model_id=config.model,
        served_model_name=prepared.policy.served_model_name,
        supports_text_input=prepared.policy.tokenize is not None,
        supports_token_ids_input=True,
        supports_lora=prepared.args.max_loras > 0,
        supports_multimodal=config.supports_multimodal,
        reasoning_parser=prepared.args.reasoning_parser,
        tool_call_parser=prepared.args.tool_call_parser,
    )
