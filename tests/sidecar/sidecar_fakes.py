"""A scripted in-process fake vLLM for the sidecar engine tests (modelled on the native sidecar's test fake).

It serves ``vllm.Inference``, ``vllm.Control`` and ``grpc.health.v1.Health`` on the project transport,
bound to 127.0.0.1 on an OS-chosen port, and records what it observed:

* ``requests``: ``(GenerateRequest, metadata dict, client peer)`` for every ``GenerateStream`` call;
* ``dropped``: request id → ``trio.Event`` set when its handler was cancelled (stream reset or disconnect)
  before it finished, with ``dropped_at`` the Trio time it happened;
* ``abort_calls``: the ``request_ids`` list of every ``Abort``;
* ``health_checks``: the service name of every ``Health.Check``.

Defaults (from upstream's fake): the first message is ``prompt_info`` (with prompt logprob arrays when asked),
then one terminal chunk ``{text " token", token 42, num_tokens 1, logprob -0.25, rank 1,
candidate {43, -0.5, 2}, STOP, stop_token_id 2}``. A request whose ``kv_transfer_params.do_remote_decode``
is true without ``remote_engine_id`` is treated as prefill and its terminal carries :data:`PREFILL_HANDOFF`.

Knobs (attributes, change them before or during a test): ``reject``, ``hang``, ``hang_before_headers``,
``hold_first`` (an Event the handler waits for before its first message), ``tokens``, ``token_delay``,
``early_eof_after``, ``read_error_after``, ``bad_after``, ``unparsable_after`` (a message that is not a
``GenerateResponse``, then the stream stays open), ``after_terminal``, ``model_infos`` (one per
``GetModelInfo`` call, the last repeats), ``server_infos``, ``health_script`` (service → list of
statuses or ``StatusCode`` errors; the last entry repeats), ``kv_sources``, ``abort_hang``.
"""

from __future__ import annotations

from typing import Any

import attrs
import fakes
import trio
from google.protobuf import struct_pb2

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_grpc, control_pb2, inference_grpc, inference_pb2
from trio_sidecar.core.config import SidecarConfig
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import HealthServicer, RpcError, serve_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

PREFILL_HANDOFF: dict[str, Any] = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "127.0.0.1",
    "remote_port": 20097,
    "remote_block_ids": [7, 8],
    "nested": {"flags": [True, None, "opaque"]},
}


#: The mock's fast engine args (docs/reference/mock.md#in-process-api-and-test-hooks, "admitting args").
FAST_ENGINE_ARGS: dict[str, Any] = {
    "block_size": 4,
    "enable_prefix_caching": False,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "speedup_ratio": 0.0,
}


PROMPT = [1, 2, 3]


def request(**extra: Any) -> dict[str, Any]:
    """A generation request body for the fake (3 prompt tokens, ``max_tokens`` 8), plus ``extra`` keys."""
    body: dict[str, Any] = {"token_ids": list(PROMPT), "stop_conditions": {"max_tokens": 8}}
    body.update(extra)
    return body


def decode_request(**extra: Any) -> dict[str, Any]:
    """:func:`request` for a decode worker: with the fake prefill's handoff."""
    return request(prefill_result={"disaggregated_params": dict(PREFILL_HANDOFF)}, **extra)


def usage(chunk: Any) -> tuple[int, int, int]:
    """A chunk's ``(prompt, completion, total)`` token counts."""
    u = chunk.completion_usage
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def sidecar_config(endpoint: str, **overrides: Any) -> SidecarConfig:
    """Test defaults: 2 connections, short timeouts, no prober (tests that need it turn it on)."""
    defaults = dict(connect_attempt_timeout=2.0, startup_deadline=5.0, health_prober=False, abort_timeout=2.0)
    return fakes.sidecar_config(endpoint, **{**defaults, **overrides})


def reference_model_info(**overrides: Any) -> control_pb2.ModelInfo:
    """The upstream reference ``ModelInfo`` (docs/reference/sidecar.md#registration-data)."""
    fields: dict[str, Any] = dict(
        model_id="model-source",
        served_model_name="served-model",
        served_model_aliases=["model-alias"],
        supports_text_input=True,
        supports_token_ids_input=True,
        supports_multimodal=False,
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
    )
    fields.update(overrides)
    return control_pb2.ModelInfo(**fields)


def reference_server_info(*, dp_size: int = 4, **overrides: Any) -> control_pb2.ServerInfo:
    """The upstream reference ``ServerInfo`` (docs/reference/sidecar.md#registration-data), with rank 0."""
    fields: dict[str, Any] = dict(
        engine_version="test-vllm",
        api_version="vllm",
        instance_id="test-instance",
        parallelism=control_pb2.ParallelismInfo(
            tensor_parallel_size=2,
            pipeline_parallel_size=1,
            data_parallel_size=dp_size,
            data_parallel_rank=0,
            decode_context_parallel_size=1,
        ),
        max_model_len=8192,
        kv_block_size=16,
        total_kv_blocks=4096,
        max_running_requests=128,
        max_batched_tokens=2048,
    )
    fields.update(overrides)
    return control_pb2.ServerInfo(**fields)


def _struct_to_python(struct: struct_pb2.Struct) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(struct)


def _candidates(n: int) -> inference_pb2.CandidateTokenInfo:
    info = inference_pb2.CandidateTokenInfo()
    if n:
        info.tokens.add(id=43, logprob=-0.5, rank=2)
    return info


class _Unparsable:
    """A response whose bytes are not a ``GenerateResponse`` (a length-delimited field cut short)."""

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf method the server calls
        return b"\x12\x05\x18\x01\x22"


@attrs.define(eq=False)
class FakeVllm:
    # knobs
    reject: bool = False
    open_error: tuple[StatusCode, str] | None = None  # answered instead of headers
    hang: bool = False
    hang_before_headers: bool = False
    hold_first: trio.Event | None = None
    tokens: int = 1
    token_delay: float = 0.0
    early_eof_after: int | None = None
    read_error_after: int | None = None
    bad_after: int | None = None
    unparsable_after: int | None = None
    after_terminal: int = 0
    model_infos: list[control_pb2.ModelInfo] = attrs.field(factory=lambda: [reference_model_info()])
    server_infos: list[control_pb2.ServerInfo] = attrs.field(factory=lambda: [reference_server_info()])
    health_script: dict[str, list[Any]] = attrs.field(factory=dict)
    kv_sources: list[control_pb2.KvEventSource] = attrs.field(factory=list)
    abort_hang: bool = False
    abort_error: tuple[StatusCode, str] | None = None
    hang_rpcs: set[str] = attrs.field(factory=set)  # "GetModelInfo", "GetServerInfo", "GetKvEventSources"
    # records
    requests: list[tuple[inference_pb2.GenerateRequest, dict[str, str], tuple[str, int]]] = attrs.field(factory=list)
    dropped: dict[str, trio.Event] = attrs.field(factory=dict)
    dropped_at: dict[str, float] = attrs.field(factory=dict)
    finished: set[str] = attrs.field(factory=set)
    abort_calls: list[list[str]] = attrs.field(factory=list)
    abort_received: trio.Event = attrs.field(factory=trio.Event)
    health_checks: list[str] = attrs.field(factory=list)
    control_peers: set[tuple[str, int]] = attrs.field(factory=set)  # client ports of Check/Control calls
    model_info_calls: int = 0
    server_info_calls: int = 0
    request_arrived: trio.Event = attrs.field(factory=trio.Event)
    first_sent: trio.Event = attrs.field(factory=trio.Event)
    # set by serve()
    server: Any = None
    health: Any = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r, _m, _p in self.requests]

    def drop_event(self, request_id: str) -> trio.Event:
        return self.dropped.setdefault(request_id, trio.Event())

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.health = _ScriptedHealth(self)
        servicers = [_Inference(self), _Control(self), self.health]

        await serve_grpc(servicers, host="127.0.0.1", port=0, task_status=_Started(self, task_status))

    # -- message builders -------------------------------------------------------------------------

    def _chunk(
        self, request: inference_pb2.GenerateRequest, *, final: int | None = None, index: int = 0
    ) -> inference_pb2.GenerateResponse:
        out = inference_pb2.SequenceOutput(index=index, text=" token", num_tokens=1, token_ids=[42])
        if request.response.output_logprobs:
            out.logprobs.append(-0.25)
            out.ranks.append(1)
            out.candidate_tokens.append(_candidates(request.response.output_candidates.top_n))
        if final is not None:
            out.finish_info.CopyFrom(
                inference_pb2.FinishInfo(
                    num_output_tokens=final, finish_reason=inference_pb2.FinishInfo.STOP, stop_token_id=2
                )
            )
            kv = request.kv.kv_transfer_params
            params = _struct_to_python(kv) if request.kv.HasField("kv_transfer_params") else {}
            if params.get("do_remote_decode") is True and "remote_engine_id" not in params:
                out.finish_info.kv_transfer_params.update(PREFILL_HANDOFF)
        return inference_pb2.GenerateResponse(outputs=out)

    def _prompt_info(self, request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateResponse:
        ids = list(request.token_ids.ids)
        info = inference_pb2.PromptInfo(num_prompt_tokens=len(ids))
        if request.response.prompt_token_ids or request.response.prompt_logprobs:
            info.token_ids.extend(ids)
        if request.response.prompt_logprobs:
            n = request.response.prompt_candidates.top_n
            for _ in ids:
                info.logprobs.append(-1.0)
                info.ranks.append(1)
                info.candidate_tokens.append(_candidates(n))
        return inference_pb2.GenerateResponse(prompt_info=info)


@attrs.define
class _Started:
    """Adapts ``task_status``: ``started(server)`` records the server and hands the fake itself back."""

    fake: FakeVllm
    inner: Any

    def started(self, server: Any = None) -> None:
        self.fake.server = server
        self.inner.started(self.fake)


class _Inference(inference_grpc.InferenceServicer):
    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake

    async def GenerateStream(self, request: inference_pb2.GenerateRequest, context: Any):  # type: ignore[override]
        fake = self.fake
        rid = request.request_id
        fake.requests.append((request, dict(context.metadata), tuple(context.peer)))
        fake.request_arrived.set()
        drop = fake.drop_event(rid)
        completed = False
        try:
            if fake.reject:
                raise RpcError(StatusCode.INVALID_ARGUMENT, "rejected by fake vLLM")
            if fake.open_error is not None:
                raise RpcError(*fake.open_error)
            if fake.hang_before_headers:
                await trio.sleep_forever()
            if fake.hold_first is not None:
                await fake.hold_first.wait()
            yield fake._prompt_info(request)
            fake.first_sent.set()
            sent = 0
            while True:
                if fake.early_eof_after is not None and sent >= fake.early_eof_after:
                    completed = True
                    return
                if fake.read_error_after is not None and sent >= fake.read_error_after:
                    completed = True
                    raise RpcError(StatusCode.UNAVAILABLE, "connection reset by fake vLLM")
                if fake.bad_after is not None and sent >= fake.bad_after:
                    yield fake._chunk(request, index=1)
                    await trio.sleep_forever()
                if fake.unparsable_after is not None and sent >= fake.unparsable_after:
                    yield _Unparsable()
                    await trio.sleep_forever()
                if not fake.hang and sent + 1 >= fake.tokens:
                    break
                if fake.token_delay or fake.hang:
                    await trio.sleep(fake.token_delay or 0.01)
                yield fake._chunk(request)
                sent += 1
            yield fake._chunk(request, final=sent + 1)
            for _ in range(fake.after_terminal):
                yield fake._chunk(request, index=7)
            completed = True
            fake.finished.add(rid)
        finally:
            if not completed and not fake.reject and fake.open_error is None:
                fake.dropped_at[rid] = trio.current_time()
                drop.set()


class _Control(control_grpc.ControlServicer):
    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake

    async def GetModelInfo(self, request: Any, context: Any) -> control_pb2.ModelInfo:  # type: ignore[override]
        fake = self.fake
        fake.control_peers.add(tuple(context.peer))
        if "GetModelInfo" in fake.hang_rpcs:
            await trio.sleep_forever()
        info = fake.model_infos[min(fake.model_info_calls, len(fake.model_infos) - 1)]
        fake.model_info_calls += 1
        return info

    async def GetServerInfo(self, request: Any, context: Any) -> control_pb2.ServerInfo:  # type: ignore[override]
        fake = self.fake
        fake.control_peers.add(tuple(context.peer))
        if "GetServerInfo" in fake.hang_rpcs:
            await trio.sleep_forever()
        info = fake.server_infos[min(fake.server_info_calls, len(fake.server_infos) - 1)]
        fake.server_info_calls += 1
        return info

    async def GetKvEventSources(self, request: Any, context: Any) -> control_pb2.GetKvEventSourcesResponse:  # type: ignore[override]
        if "GetKvEventSources" in self.fake.hang_rpcs:
            await trio.sleep_forever()
        return control_pb2.GetKvEventSourcesResponse(sources=self.fake.kv_sources)

    async def Abort(self, request: control_pb2.AbortRequest, context: Any) -> control_pb2.AbortResponse:  # type: ignore[override]
        fake = self.fake
        fake.abort_calls.append(list(request.request_ids))
        fake.abort_received.set()
        if fake.abort_hang:
            await trio.sleep_forever()
        if fake.abort_error is not None:
            raise RpcError(*fake.abort_error)
        return control_pb2.AbortResponse()


class _ScriptedHealth(HealthServicer):
    """The transport's health servicer (Watch works), with ``Check`` scripted per service when asked."""

    def __init__(self, fake: FakeVllm) -> None:
        super().__init__({"": SERVING, "vllm.Control": SERVING, "vllm.Inference": SERVING})
        self.fake = fake

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:  # type: ignore[override]
        fake = self.fake
        fake.health_checks.append(request.service)
        fake.control_peers.add(tuple(context.peer))
        script = fake.health_script.get(request.service)
        if script:
            step = script.pop(0) if len(script) > 1 else script[0]
            if isinstance(step, StatusCode):
                raise RpcError(step, f"scripted {step.name}")
            if step == "hang":
                await trio.sleep_forever()
            return health_pb2.HealthCheckResponse(status=step)
        return await super().Check(request, context)


class PausableProxy:
    """A TCP proxy on 127.0.0.1:0 whose server→client direction can be paused (the fault-injecting wrapper
    of the cancellation tests, docs/reference/sidecar.md#aggregated-and-prefill-modes: a pending open or a pending read, with the server fully alive behind it).

    Usage: ``proxy = await nursery.start(PausableProxy(host, port).serve)``; ``proxy.endpoint``.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.connections = 0
        self._flowing = trio.Event()
        self._flowing.set()
        self._scopes: set[trio.CancelScope] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pause(self) -> None:
        if self._flowing.is_set():
            self._flowing = trio.Event()

    def resume(self) -> None:
        self._flowing.set()

    def break_connections(self) -> None:
        """Close every proxied connection abruptly (a connection-level read error for the client)."""
        for scope in list(self._scopes):
            scope.cancel()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client:
            try:
                upstream = await trio.open_tcp_stream(*self.target)
            except OSError:
                return
            self.connections += 1
            async with upstream, trio.open_nursery() as nursery:
                self._scopes.add(nursery.cancel_scope)

                async def pipe(src: trio.SocketStream, dst: trio.SocketStream, gated: bool) -> None:
                    try:
                        while data := await src.receive_some(65536):
                            if gated:
                                await self._flowing.wait()
                                while not self._flowing.is_set():  # paused again meanwhile
                                    await self._flowing.wait()
                            await dst.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(pipe, client, upstream, False)
                nursery.start_soon(pipe, upstream, client, True)
            self._scopes.discard(nursery.cancel_scope)
