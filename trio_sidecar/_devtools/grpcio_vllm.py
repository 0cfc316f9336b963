"""A vLLM stand-in served by gRPC-core (``grpc.aio``), for soaks and interop drills.

The project's mock (``trio-sidecar mock``) speaks through the project's own transport; this stand-in is
served by grpcio's C-core server, with its stock HTTP/2 policies (keepalive ping enforcement, GOAWAY, flow
control), like the C++ servers and proxies a sidecar may face in front of vLLM. It answers the three
services the sidecars use:

* ``grpc.health.v1.Health``: ``SERVING`` for ``""``, ``vllm.Inference`` and ``vllm.Control``;
* ``vllm.Control``: ``GetServerInfo``, ``GetModelInfo``, ``GetKvEventSources`` (none) and ``Abort``;
* ``vllm.Inference.GenerateStream``: the prompt's ``PromptInfo``, then one message per token (the mock's
  deterministic tokens and text, ``pace`` seconds apart), the last one with ``FinishInfo`` (``LENGTH`` at
  ``max_new_tokens``).

It runs on an asyncio loop in a thread of the calling process (:meth:`GrpcioVllm.start`), so a harness
reads its counters (:attr:`GrpcioVllm.stats`) directly. Test tooling only: grpcio comes with the ``test``
extra, and nothing in the package imports this module.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import grpc

from .._proto.grpc.health.v1 import health_pb2
from .._proto.vllm import control_pb2, inference_pb2
from ..mock.generation import OutputOptions, build_prompt_info, fill_sequence_output, planned_tokens

__all__ = ["GrpcioVllm", "StandInStats"]

_SERVICES = ("", "vllm.Inference", "vllm.Control")
_DEFAULT_MAX_TOKENS = 16


@attrs.define
class StandInStats:
    """What the stand-in saw (read from any thread; ints only, written on its loop)."""

    started: int = 0
    #: streams that sent their last token (``FinishInfo``)
    completed: int = 0
    #: streams the client reset (or whose connection closed) before their end
    cancelled: int = 0
    aborts: int = 0
    #: streams of ``max_new_tokens`` in :attr:`GrpcioVllm.watch_max_tokens` that completed: a soak's dropped
    #: requests use such a length, so this counts dropped streams that ran to completion
    watched_completed: int = 0

    @property
    def active(self) -> int:
        return self.started - self.completed - self.cancelled


class GrpcioVllm:
    """The stand-in on ``127.0.0.1:port`` (0: any free port), in a thread of its own.

    Args:
        model_id: ``ModelInfo.model_id`` (the frontend reads the tokenizer from it).
        served_model_name: ``ModelInfo.served_model_name``.
        pace: seconds between two tokens of a stream.
        options: grpcio server options (channel arguments), e.g. ``("grpc.max_connection_age_ms", 30000)``;
            none: gRPC-core's defaults (its keepalive policy included).
        watch_max_tokens: see :attr:`StandInStats.watched_completed`.
    """

    def __init__(
        self,
        *,
        model_id: str,
        served_model_name: str = "tiny",
        pace: float = 0.002,
        options: Sequence[tuple[str, Any]] = (),
        watch_max_tokens: int | None = None,
        kv_block_size: int = 16,
        total_kv_blocks: int = 4096,
        seed: int = 0,
    ) -> None:
        self.model_id = model_id
        self.served_model_name = served_model_name
        self.pace = pace
        self.options = tuple(options)
        self.watch_max_tokens = watch_max_tokens
        self.kv_block_size = kv_block_size
        self.total_kv_blocks = total_kv_blocks
        self.seed = seed
        self.stats = StandInStats()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> GrpcioVllm:
        """Start the thread and wait until the server listens; returns self."""
        self._thread = threading.Thread(target=self._main, name="grpcio-vllm", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the grpcio vLLM stand-in did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"the grpcio vLLM stand-in failed to start: {self._error!r}") from self._error
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server (``grace`` seconds for the calls in progress, then cancelled) and join the thread."""
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and self._thread is not None and self._thread.is_alive():
            self._grace = grace
            loop.call_soon_threadsafe(stopped.set)
            self._thread.join(grace + 10)

    def __enter__(self) -> GrpcioVllm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the server's thread ------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._grace = 1.0
        server = grpc.aio.server(options=self.options)
        server.add_generic_rpc_handlers((self._health_handler(), self._control_handler(), self._inference_handler()))
        self.port = server.add_insecure_port("127.0.0.1:0" if not self.port else f"127.0.0.1:{self.port}")
        await server.start()
        self._server = server
        self._ready.set()
        await self._stopped.wait()
        await server.stop(self._grace)

    def _health_handler(self) -> grpc.GenericRpcHandler:
        """``grpc.health.v1.Health`` with the package's own messages (grpcio-health-checking's generated
        module would register the same proto symbols again in a process that also runs the mock)."""
        serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

        async def check(request: Any, context: Any) -> health_pb2.HealthCheckResponse:
            if request.service not in _SERVICES:
                await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
            return serving

        async def watch(request: Any, context: Any) -> AsyncIterator[health_pb2.HealthCheckResponse]:
            if request.service not in _SERVICES:
                yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            else:
                yield serving
            await asyncio.Event().wait()  # (until the client cancels or the server stops)

        def serialize(message: Any) -> bytes:
            return message.SerializeToString()

        return grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health",
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    check, request_deserializer=health_pb2.HealthCheckRequest.FromString, response_serializer=serialize
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    watch, request_deserializer=health_pb2.HealthCheckRequest.FromString, response_serializer=serialize
                ),
            },
        )

    def _control_handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any, request_type: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=request_type.FromString, response_serializer=lambda m: m.SerializeToString()
            )

        return grpc.method_handlers_generic_handler(
            "vllm.Control",
            {
                "GetServerInfo": unary(self._server_info, control_pb2.GetServerInfoRequest),
                "GetModelInfo": unary(self._model_info, control_pb2.GetModelInfoRequest),
                "GetKvEventSources": unary(self._kv_event_sources, control_pb2.GetKvEventSourcesRequest),
                "Abort": unary(self._abort, control_pb2.AbortRequest),
            },
        )

    def _inference_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "vllm.Inference",
            {
                "GenerateStream": grpc.unary_stream_rpc_method_handler(
                    self._generate_stream,
                    request_deserializer=inference_pb2.GenerateRequest.FromString,
                    response_serializer=lambda m: m.SerializeToString(),
                )
            },
        )

    async def _server_info(self, request: Any, context: Any) -> control_pb2.ServerInfo:
        return control_pb2.ServerInfo(
            engine_version="grpcio-stand-in",
            api_version="vllm",
            instance_id="grpcio-vllm-stand-in",
            parallelism=control_pb2.ParallelismInfo(
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=1,
                data_parallel_rank=0,
                decode_context_parallel_size=1,
                world_size=1,
                data_parallel_size_local=1,
            ),
            max_model_len=4096,
            kv_block_size=self.kv_block_size,
            total_kv_blocks=self.total_kv_blocks,
            max_running_requests=256,
            max_batched_tokens=8192,
            max_loras=0,
            rl_capabilities=control_pb2.RlCapabilities(),
            effective_attention_block_size=self.kv_block_size,
        )

    async def _model_info(self, request: Any, context: Any) -> control_pb2.ModelInfo:
        return control_pb2.ModelInfo(
            model_id=self.model_id,
            served_model_name=self.served_model_name,
            supports_text_input=False,
            supports_token_ids_input=True,
            supports_lora=False,
            supports_multimodal=False,
        )

    async def _kv_event_sources(self, request: Any, context: Any) -> control_pb2.GetKvEventSourcesResponse:
        return control_pb2.GetKvEventSourcesResponse()

    async def _abort(self, request: Any, context: Any) -> control_pb2.AbortResponse:
        self.stats.aborts += 1
        return control_pb2.AbortResponse()

    async def _generate_stream(
        self, request: inference_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        stats = self.stats
        stats.started += 1
        ended = False
        try:
            prompt = list(request.token_ids.ids)
            n = request.stopping.max_new_tokens or _DEFAULT_MAX_TOKENS
            options = OutputOptions.from_proto(request.response)
            tokens = planned_tokens(self.seed, request.request_id, n)
            yield inference_pb2.GenerateResponse(prompt_info=build_prompt_info(prompt, request.response))
            for i, token in enumerate(tokens):
                if self.pace:
                    await asyncio.sleep(self.pace)
                message = inference_pb2.GenerateResponse()
                fill_sequence_output(message.outputs, (token,), options)
                if i == n - 1:
                    message.outputs.finish_info.num_output_tokens = n
                    message.outputs.finish_info.finish_reason = inference_pb2.FinishInfo.LENGTH
                    ended = True  # the stream ran to its end, whatever happens to this last message
                    stats.completed += 1
                    if n == self.watch_max_tokens:
                        stats.watched_completed += 1
                yield message
        finally:
            if not ended:
                stats.cancelled += 1
