"""Test peers for the transport: one echo service implemented twice (our server and grpc.aio).

Both implementations serve ``vllm.Inference`` with the same behaviour, selected by ``request_id``:

Generate (unary):
  ``echo``      outputs.text = request.text
  ``metadata``  outputs.text = JSON list of the request's ``x-*`` metadata pairs
  ``timeout``   outputs.text = "1" if the call carries a deadline (grpc-timeout) else "0"
  ``fail``      status code ``priority``, message ``request.text``, trailing metadata ``x-trailer: yes``
  ``boom``      raises ValueError("secret detail")
  ``sleep``     sleeps ``truncate_prompt_tokens`` ms, then echoes
  ``big``       outputs.text = "x" * truncate_prompt_tokens
GenerateStream:
  ``stream``    ``truncate_prompt_tokens`` messages (index i, text request.text), ``priority`` ms apart;
                if ``request.sampling.top_k`` > 0, fails with that status code after the messages.
  ``big``       one small message, then one of ``truncate_prompt_tokens`` bytes, then one small message

Every handler records into ``Recorder`` (thread-safe enough for the asserts: single writes).
The grpc.aio side runs on an asyncio loop in a background thread (``AioThread``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import trio

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import inference_grpc
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import RpcError

GENERATE = "/vllm.Inference/Generate"
GENERATE_STREAM = "/vllm.Inference/GenerateStream"
MIB = 1024 * 1024


class Recorder:
    """What the server-side handlers saw (times are time.monotonic())."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.cancelled: dict[str, float] = {}
        self.produced: dict[str, int] = {}
        self.finished: dict[str, float] = {}

    def mark(self, table: str, key: str) -> None:
        getattr(self, table)[key] = time.monotonic()


def request(
    command: str, *, text: str = "", n: int = 0, interval_ms: int = 0, fail_code: int = 0, key: str = ""
) -> Any:
    req = pb.GenerateRequest(request_id=command, text=text, truncate_prompt_tokens=n, priority=interval_ms)
    if fail_code:
        req.sampling.top_k = fail_code
    if key:
        req.model = key
    return req


def _metadata_json(pairs: Any) -> str:
    return json.dumps(sorted([k, v] for k, v in pairs if k.startswith("x-")))


# -- our server ----------------------------------------------------------------------------------------


class TrioEcho(inference_grpc.InferenceServicer):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
        command = request.request_id
        key = request.model or command
        self.recorder.mark("started", key)
        try:
            if command == "metadata":
                return pb.GenerateResponse(outputs=pb.SequenceOutput(text=_metadata_json(context.metadata)))
            if command == "timeout":
                return pb.GenerateResponse(outputs=pb.SequenceOutput(text="1" if context.deadline else "0"))
            if command == "fail":
                raise RpcError(StatusCode(request.priority), request.text, [("x-trailer", "yes")])
            if command == "boom":
                raise ValueError("secret detail")
            if command == "sleep":
                await trio.sleep(request.truncate_prompt_tokens / 1000)
            if command == "big":
                return pb.GenerateResponse(outputs=pb.SequenceOutput(text="x" * request.truncate_prompt_tokens))
            return pb.GenerateResponse(outputs=pb.SequenceOutput(text=request.text))
        except trio.Cancelled:
            self.recorder.mark("cancelled", key)
            raise
        finally:
            self.recorder.mark("finished", key)

    async def GenerateStream(self, request: Any, context: Any) -> Any:  # noqa: N802
        key = request.model or request.request_id
        self.recorder.mark("started", key)
        self.recorder.produced[key] = 0
        try:
            if request.request_id == "big":
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=0))
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=1, text="x" * request.truncate_prompt_tokens))
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=2))
                return
            for i in range(request.truncate_prompt_tokens):
                if i and request.priority:
                    await trio.sleep(request.priority / 1000)
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=i, text=request.text))
                self.recorder.produced[key] = i + 1
            if request.sampling.top_k:
                raise RpcError(StatusCode(request.sampling.top_k), request.text)
        except trio.Cancelled:
            self.recorder.mark("cancelled", key)
            raise
        finally:
            self.recorder.mark("finished", key)


# -- grpc.aio server -----------------------------------------------------------------------------------


def _aio_handlers(recorder: Recorder) -> grpc.GenericRpcHandler:
    async def generate(req: Any, context: grpc.aio.ServicerContext) -> Any:
        command = req.request_id
        key = req.model or command
        recorder.mark("started", key)
        try:
            if command == "metadata":
                return pb.GenerateResponse(
                    outputs=pb.SequenceOutput(text=_metadata_json(context.invocation_metadata()))
                )
            if command == "timeout":
                return pb.GenerateResponse(outputs=pb.SequenceOutput(text="1" if context.time_remaining() else "0"))
            if command == "fail":
                context.set_trailing_metadata((("x-trailer", "yes"),))
                await context.abort(grpc.StatusCode[StatusCode(req.priority).name], req.text)
            if command == "boom":
                raise ValueError("secret detail")
            if command == "sleep":
                await asyncio.sleep(req.truncate_prompt_tokens / 1000)
            if command == "big":
                return pb.GenerateResponse(outputs=pb.SequenceOutput(text="x" * req.truncate_prompt_tokens))
            return pb.GenerateResponse(outputs=pb.SequenceOutput(text=req.text))
        except asyncio.CancelledError:
            recorder.mark("cancelled", key)
            raise
        finally:
            recorder.mark("finished", key)

    async def generate_stream(req: Any, context: grpc.aio.ServicerContext) -> Any:
        key = req.model or req.request_id
        recorder.mark("started", key)
        recorder.produced[key] = 0
        try:
            if req.request_id == "big":
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=0))
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=1, text="x" * req.truncate_prompt_tokens))
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=2))
                return
            for i in range(req.truncate_prompt_tokens):
                if i and req.priority:
                    await asyncio.sleep(req.priority / 1000)
                yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=i, text=req.text))
                recorder.produced[key] = i + 1
            if req.sampling.top_k:
                await context.abort(grpc.StatusCode[StatusCode(req.sampling.top_k).name], req.text)
        except asyncio.CancelledError:
            recorder.mark("cancelled", key)
            raise
        finally:
            recorder.mark("finished", key)

    health_statuses = {"": health_pb2.HealthCheckResponse.SERVING}

    async def health_check(req: Any, context: grpc.aio.ServicerContext) -> Any:
        if req.service not in health_statuses:
            await context.abort(grpc.StatusCode.NOT_FOUND, "service not registered")
        return health_pb2.HealthCheckResponse(status=health_statuses[req.service])

    inference = grpc.method_handlers_generic_handler(
        "vllm.Inference",
        {
            "Generate": grpc.unary_unary_rpc_method_handler(
                generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                generate_stream,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
        },
    )
    return inference, grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health",
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                health_check,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            )
        },
    )


def aio_options(max_message_length: int = 64 * MIB) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_length),
        ("grpc.max_receive_message_length", max_message_length),
        # Distinct channels in one process must not share a subchannel (docs/reference/transport.md#grpcio-peers-in-tests).
        ("grpc.use_local_subchannel_pool", 1),
    ]


class AioThread:
    """An asyncio loop in a daemon thread, for grpc.aio peers; ``call`` runs a coroutine there from Trio."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio-peer", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def call(self, fn: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 30) -> Any:
        return await trio.to_thread.run_sync(lambda: self.run(fn(), timeout))

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class AioServer:
    """A grpc.aio server (the echo service + a Check-only health service) on 127.0.0.1:0."""

    def __init__(
        self, aio: AioThread, recorder: Recorder, max_message_length: int = 64 * MIB, options: Any = ()
    ) -> None:
        self.aio = aio
        self.recorder = recorder
        self.max_message_length = max_message_length
        self.options = list(options)  # more grpc.aio server options (ping policy, connection age, ...)
        self.server: Any = None
        self.port = 0

    async def start(self) -> None:
        async def start() -> int:
            self.server = grpc.aio.server(options=aio_options(self.max_message_length) + self.options)
            self.server.add_generic_rpc_handlers(_aio_handlers(self.recorder))
            port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            return port

        self.port = await self.aio.call(start)

    async def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await self.aio.call(lambda: server.stop(None))


def status_of(error: grpc.aio.AioRpcError) -> tuple[StatusCode, str]:
    return StatusCode(error.code().value[0]), error.details() or ""


async def aio_unary(channel: grpc.aio.Channel, req: Any, *, metadata: Any = None, timeout: float | None = None) -> Any:
    method = channel.unary_unary(
        GENERATE,
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    return await method(req, metadata=metadata, timeout=timeout)


def aio_stream(channel: grpc.aio.Channel, req: Any, *, metadata: Any = None, timeout: float | None = None) -> Any:
    method = channel.unary_stream(
        GENERATE_STREAM,
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    return method(req, metadata=metadata, timeout=timeout)
