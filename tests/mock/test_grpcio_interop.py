"""A grpcio (grpc.aio, the reference implementation) client drives the mock for the core scenarios.

The mock runs in the test's Trio loop; the grpc.aio client runs in its own asyncio loop in a worker
thread (``trio.to_thread.run_sync(asyncio.run, ...)``). Health uses our generated ``health_pb2`` through
generic calls (grpcio-health-checking's module would clash with our descriptors).
"""

from __future__ import annotations

import asyncio

import pytest
import trio

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from mock_helpers import FinishReason, gen, running_mock, wait_drained  # noqa: E402

from trio_sidecar._proto.grpc.health.v1 import health_pb2  # noqa: E402
from trio_sidecar._proto.vllm import control_pb2  # noqa: E402
from trio_sidecar._proto.vllm import inference_pb2 as pb  # noqa: E402


def _unary(channel, path, response_type):
    return channel.unary_unary(
        path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_type.FromString
    )


def _stream(channel):
    return channel.unary_stream(
        "/vllm.Inference/GenerateStream",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.GenerateResponse.FromString,
    )


def run_grpcio(address: str, scenario):
    """Run ``scenario(channel)`` on a fresh grpc.aio channel in a worker thread's asyncio loop."""

    async def main():
        async with aio.insecure_channel(address) as channel:
            return await scenario(channel)

    return trio.to_thread.run_sync(asyncio.run, main())


async def test_grpcio_health_and_control_values():
    async def scenario(channel):
        check = _unary(channel, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckResponse)
        statuses = [
            (await check(health_pb2.HealthCheckRequest(service=name))).status
            for name in ("", "vllm.Control", "vllm.Inference")
        ]
        try:
            await check(health_pb2.HealthCheckRequest(service="nope"))
            unknown = None
        except aio.AioRpcError as err:
            unknown = (err.code(), err.details())
        server = await _unary(channel, "/vllm.Control/GetServerInfo", control_pb2.ServerInfo)(
            control_pb2.GetServerInfoRequest()
        )
        model = await _unary(channel, "/vllm.Control/GetModelInfo", control_pb2.ModelInfo)(
            control_pb2.GetModelInfoRequest()
        )
        return statuses, unknown, server, model

    async with running_mock(served_model_name="tiny") as (mock, _):
        statuses, unknown, server, model = await run_grpcio(mock.address, scenario)
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 3
    assert unknown == (grpc.StatusCode.NOT_FOUND, "service not registered")
    assert (server.api_version, server.kv_block_size, server.total_kv_blocks, server.max_running_requests) == (
        "vllm",
        4,
        4096,
        64,
    )
    assert server.parallelism.data_parallel_size == 1 and server.rl_capabilities == control_pb2.RlCapabilities()
    assert (model.model_id, model.served_model_name, model.supports_token_ids_input) == ("mocker-model", "tiny", True)


async def test_grpcio_streams_the_reference_tokens_and_unary_agrees():
    async def scenario(channel):
        messages = [m async for m in _stream(channel)(gen("stable", max_new_tokens=5))]
        unary = await _unary(channel, "/vllm.Inference/Generate", pb.GenerateResponse)(gen("req-1", max_new_tokens=5))
        return messages, unary

    async with running_mock() as (mock, _):
        messages, unary = await run_grpcio(mock.address, scenario)
        assert mock.active_request_count() == 0
    assert messages[0].HasField("prompt_info") and not messages[0].HasField("outputs")
    assert [t for m in messages[1:] for t in m.outputs.token_ids] == [31728, 29888, 3667, 8592, 6614]
    assert messages[-1].outputs.finish_info.finish_reason == FinishReason.LENGTH
    assert list(unary.outputs.token_ids) == [2110, 19376, 28263, 4772, 16215]
    assert unary.outputs.finish_info.num_output_tokens == 5


async def test_grpcio_sees_prompt_info_then_the_capacity_error():
    async def scenario(channel):
        seen = []
        try:
            async for message in _stream(channel)(gen(prompt=(1, 2, 3, 4, 5))):
                seen.append(message)
        except aio.AioRpcError as err:
            return seen, (err.code(), err.details())
        return seen, None

    async with running_mock(engine_args={"num_gpu_blocks": 1}) as (mock, _):
        seen, error = await run_grpcio(mock.address, scenario)
    assert [m.HasField("prompt_info") for m in seen] == [True]
    assert error == (grpc.StatusCode.RESOURCE_EXHAUSTED, "request exceeds the simulated KV-cache capacity")


async def test_a_cancelled_grpcio_stream_releases_its_slot():
    async def scenario(channel):
        call = _stream(channel)(gen("cancel-me", max_new_tokens=10_000))
        first = await call.read()
        second = await call.read()
        call.cancel()
        await asyncio.sleep(0)
        return first, second

    async with running_mock(max_concurrent_requests=1, engine_args={"speedup_ratio": 0.1}) as (mock, _):
        first, second = await run_grpcio(mock.address, scenario)
        assert first.HasField("prompt_info") and second.outputs.num_tokens == 1
        await wait_drained(mock)  # running, waiting and active reach 0 within 2 s
        assert mock.metrics(0).active_decode_blocks == 0

        async def again(channel):  # the single permit is free again
            return [m async for m in _stream(channel)(gen("after", max_new_tokens=2))]

        assert len(await run_grpcio(mock.address, again)) == 3


async def test_grpcio_error_codes():
    cases = [
        (gen(model="other"), (), grpc.StatusCode.NOT_FOUND, "model `other` not found"),
        (pb.GenerateRequest(request_id="t", text="hi"), (), grpc.StatusCode.UNIMPLEMENTED, "send token_ids"),
        (gen(max_new_tokens=32769), (), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must not exceed 32768"),
        (gen(), (("x-data-parallel-rank", "x"),), grpc.StatusCode.INVALID_ARGUMENT, "unsigned 32-bit integer"),
        (gen(), (("x-data-parallel-rank", "3"),), grpc.StatusCode.INVALID_ARGUMENT, "connected ranks: [0]"),
        (gen(lora_name="l"), (), grpc.StatusCode.FAILED_PRECONDITION, "engine was not started with LoRA enabled"),
    ]

    async def scenario(channel):
        results = []
        for request, metadata, _, _ in cases:
            try:
                async for _ in _stream(channel)(request, metadata=metadata):
                    pass
                results.append(None)
            except aio.AioRpcError as err:
                results.append((err.code(), err.details()))
        try:
            await _unary(channel, "/vllm.Control/LoadLora", control_pb2.LoadLoraResponse)(
                control_pb2.LoadLoraRequest(lora_name="a", source_path="/adapters/a")
            )
        except aio.AioRpcError as err:
            results.append((err.code(), err.details()))
        return results

    async with running_mock() as (mock, _):
        results = await run_grpcio(mock.address, scenario)
    for (_, _, code, text), result in zip(cases, results, strict=False):
        assert result is not None and result[0] == code and text in result[1]
    assert results[-1] == (grpc.StatusCode.FAILED_PRECONDITION, "engine was not started with LoRA enabled")


@pytest.mark.parametrize("compression", ["Gzip", "Deflate"])
async def test_grpcio_compressed_requests_are_served(compression, monkeypatch):
    """A grpc.aio client compressing its requests (gRPC gzip / deflate): the mock answers normally."""
    from trio_sidecar.transport._decompress import BoundedReadBuffer

    inflated: list[str] = []
    original = BoundedReadBuffer.decompress

    def spy(self, data):  # proves the requests really arrived compressed
        inflated.append(self._message_encoding)
        return original(self, data)

    monkeypatch.setattr(BoundedReadBuffer, "decompress", spy)
    prompt = [7] * 1000  # compressible (1,000 identical bytes), so grpcio really sends it compressed

    async def scenario(channel):
        generate = _unary(channel, "/vllm.Inference/Generate", pb.GenerateResponse)
        unary = await generate(
            gen("c-unary", prompt=prompt, max_new_tokens=3), compression=getattr(grpc.Compression, compression)
        )
        streamed = [
            m
            async for m in _stream(channel)(
                gen("c-stream", prompt=prompt, max_new_tokens=3), compression=getattr(grpc.Compression, compression)
            )
        ]
        return unary, streamed

    async with running_mock() as (mock, _):
        unary, streamed = await run_grpcio(mock.address, scenario)
        assert len(unary.outputs.token_ids) == 3
        assert unary.prompt_info.num_prompt_tokens == len(prompt)
        assert sum(len(m.outputs.token_ids) for m in streamed) == 3
        assert streamed[-1].outputs.finish_info.finish_reason == FinishReason.LENGTH
        assert inflated == [compression.lower()] * 2
        await wait_drained(mock)
