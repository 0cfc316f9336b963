"""Behaviours of the mock server (docs/reference/mock.md) over real sockets on 127.0.0.1 port 0.

Each test name says the behaviour it covers. Fast engine arguments (speedup 0) unless the behaviour needs a
request to stay in flight, where a small speedup ratio keeps it busy for seconds and the test ends it.
"""

from __future__ import annotations

import socket

import pytest
import trio
from google.protobuf import struct_pb2
from mock_helpers import (
    GENERATE,
    GENERATE_STREAM,
    FinishReason,
    abort,
    collect,
    control,
    gen,
    running_mock,
    stream_tokens,
    wait_drained,
)

import trio_sidecar
from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode as C
from trio_sidecar.mock import MockConfig, open_mock_server, planned_tokens, request_uuid
from trio_sidecar.mock.server import CALL_HISTORY, CallRecord, MockConfigError, parse_listen
from trio_sidecar.transport import RpcError, check_health, watch_health

SLOW = {"speedup_ratio": 0.1}  # ~57 ms per decode pass: a 10,000-token request stays in flight for minutes


async def rpc_error(awaitable) -> RpcError:
    with pytest.raises(RpcError) as info:
        await awaitable
    return info.value


def struct(d: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


# --- 1, 20: determinism and stop tokens --------------------------------------------------------------------


async def test_streams_the_reference_tokens_with_the_spec_shape():
    async with running_mock() as (mock, ch):
        for _ in range(2):  # same id twice (sequentially): same tokens
            messages = await collect(ch, gen("stable", max_new_tokens=5))
            assert messages[0].HasField("prompt_info") and not messages[0].HasField("outputs")
            assert messages[0].prompt_info.num_prompt_tokens == 4
            body = messages[1:]
            assert len(body) == 5 and all(m.outputs.num_tokens == 1 for m in body)
            assert stream_tokens(messages) == [31728, 29888, 3667, 8592, 6614]
            assert body[0].outputs.text == "<token:31728>"
            assert [m.outputs.HasField("finish_info") for m in body] == [False] * 4 + [True]
            finish = body[-1].outputs.finish_info
            assert finish.finish_reason == FinishReason.LENGTH and finish.num_output_tokens == 5
        assert mock.active_request_count() == 0


async def test_stop_token_ends_after_k_plus_one_tokens_unless_masked_by_min():
    k = 3
    stop = planned_tokens(42, "stopper", 10)[k]
    async with running_mock() as (_, ch):
        messages = await collect(ch, gen("stopper", max_new_tokens=10, stop_token_ids=[stop]))
        assert len(stream_tokens(messages)) == k + 1
        finish = messages[-1].outputs.finish_info
        assert finish.finish_reason == FinishReason.STOP and finish.stop_token_id == stop
        assert finish.num_output_tokens == k + 1

        tokens = planned_tokens(42, "stopper", 10)
        messages = await collect(ch, gen("stopper", max_new_tokens=10, min_new_tokens=k + 1, stop_token_ids=[stop]))
        later = [p for p in range(k + 1, 10) if tokens[p] == stop]
        assert stream_tokens(messages) == (tokens[: later[0] + 1] if later else tokens)


async def test_logprobs_and_candidates_on_the_wire():
    response = pb.ResponseOptions(
        output_token_ids=True,
        output_logprobs=True,
        output_candidates=pb.CandidateTokens(top_n=2),
        prompt_logprobs=True,
    )
    async with running_mock() as (_, ch):
        messages = await collect(ch, gen("stable", max_new_tokens=3, response=response))
        info = messages[0].prompt_info
        assert list(info.token_ids) == [1, 2, 3, 4] and list(info.ranks) == [0, 1, 1, 1]
        first = messages[1].outputs
        assert list(first.logprobs) == pytest.approx([-0.9]) and list(first.ranks) == [1]
        assert [(t.id, t.rank) for t in first.candidate_tokens[0].tokens] == [(31728, 1), (31729, 2)]


# --- 2, 3, 5, 16, 26, 27: request validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "code", "text"),
    [
        (gen(max_new_tokens=32769), C.INVALID_ARGUMENT, "max_new_tokens must not exceed 32768"),
        (gen(max_new_tokens=1, min_new_tokens=2), C.INVALID_ARGUMENT, "min_new_tokens (2)"),
        (gen(min_new_tokens=21), C.INVALID_ARGUMENT, "effective max_new_tokens (20)"),
        (pb.GenerateRequest(request_id="t", text="hello"), C.UNIMPLEMENTED, "token_ids"),
        (gen(lora_name="adapter"), C.FAILED_PRECONDITION, "engine was not started with LoRA enabled"),
        (gen(model="other"), C.NOT_FOUND, "model `other` not found"),
        (pb.GenerateRequest(request_id="t"), C.INVALID_ARGUMENT, "prompt is required"),
        (gen(prompt=()), C.INVALID_ARGUMENT, "token_ids must not be empty"),
        (gen(sampling=pb.RandomSampling(num_sequences=2)), C.INVALID_ARGUMENT, "num_sequences must be 0 or 1"),
        (gen(sampling=pb.RandomSampling(top_p=2.0)), C.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2"),
        (gen(stopping=pb.StoppingCriteria(stop_strings=[""])), C.INVALID_ARGUMENT, "stop strings cannot be empty"),
    ],
)
async def test_invalid_requests_fail_before_the_stream_opens(request_, code, text):
    async with running_mock() as (mock, ch):
        for call in (
            ch.unary_unary(GENERATE, request_, pb.GenerateResponse),
            collect(ch, request_),
        ):
            err = await rpc_error(call)
            assert err.code == code and text in err.message
        assert mock.active_request_count() == 0
        assert [r[0] for r in mock.recorded_requests] == ["Generate", "GenerateStream"]


async def test_min_tokens_with_default_max_gives_twenty_tokens_and_empty_model_is_accepted():
    async with running_mock() as (_, ch):
        messages = await collect(ch, gen(min_new_tokens=20, model=""))
        assert len(stream_tokens(messages)) == 20
        messages = await collect(ch, gen(model="mocker-model", max_new_tokens=1))
        assert len(stream_tokens(messages)) == 1


async def test_served_model_name_overrides_model():
    async with running_mock(model="/models/x", served_model_name="tiny") as (_, ch):
        info = await control(ch, "GetModelInfo", control_pb2.GetModelInfoRequest(), control_pb2.ModelInfo)
        assert (info.model_id, info.served_model_name) == ("/models/x", "tiny")
        assert len(stream_tokens(await collect(ch, gen(model="tiny", max_new_tokens=1)))) == 1
        err = await rpc_error(collect(ch, gen(model="/models/x")))
        assert err.code == C.NOT_FOUND


async def test_truncate_prompt_tokens_keeps_the_last_n():
    async with running_mock() as (_, ch):
        request = gen(prompt=(1, 2, 3, 4, 5, 6), truncate_prompt_tokens=2, max_new_tokens=1)
        request.response.prompt_token_ids = True
        messages = await collect(ch, request)
        assert messages[0].prompt_info.num_prompt_tokens == 2
        assert list(messages[0].prompt_info.token_ids) == [5, 6]


# --- 4, 10: disaggregated roles -----------------------------------------------------------------------------


async def test_role_validation():
    async with running_mock(disaggregation_mode="prefill") as (_, ch):
        err = await rpc_error(collect(ch, gen()))
        assert (err.code, err.message) == (C.FAILED_PRECONDITION, "prefill mock server requires do_remote_decode=true")
        both = gen(
            kv=pb.KVCacheParameters(kv_transfer_params=struct({"do_remote_decode": True, "do_remote_prefill": True}))
        )
        assert (await rpc_error(collect(ch, both))).code == C.INVALID_ARGUMENT
        for key, value in (
            ("remote_engine_id", "e"),
            ("remote_host", "h"),
            ("remote_port", 1),
            ("remote_block_ids", [0]),
        ):
            params = struct({"do_remote_decode": True, key: value})
            err = await rpc_error(collect(ch, gen(kv=pb.KVCacheParameters(kv_transfer_params=params))))
            assert err.code == C.INVALID_ARGUMENT and key in err.message
    async with running_mock(disaggregation_mode="decode") as (_, ch):
        params = struct(
            {
                "do_remote_prefill": True,
                "remote_engine_id": 7,
                "remote_host": "h",
                "remote_port": 1,
                "remote_block_ids": [0],
                "mocker_request_id": "r",
            }
        )
        err = await rpc_error(collect(ch, gen(kv=pb.KVCacheParameters(kv_transfer_params=params))))
        assert err.code == C.INVALID_ARGUMENT and "remote_engine_id" in err.message


async def test_prefill_handoff_round_trips_through_a_decode_server_and_needs_the_sentinel():
    async with running_mock(disaggregation_mode="prefill") as (_, prefill_ch):
        request = gen("hand-1", prompt=tuple(range(1, 70)), max_new_tokens=1)
        request.kv.kv_transfer_params.update({"do_remote_decode": True})
        messages = await collect(prefill_ch, request)
        finish = messages[-1].outputs.finish_info
        handoff = finish.kv_transfer_params
        assert handoff["do_remote_prefill"] is True and handoff["do_remote_decode"] is False
        assert handoff["remote_engine_id"] == f"mocker-prefill-{request_uuid(42, 'hand-1')}"
        assert handoff["remote_block_ids"] == [0, 1]  # ceil(69 / 64) chunks
        assert handoff["mocker_request_id"] == "hand-1" and handoff["remote_port"] == 0
    async with running_mock(disaggregation_mode="decode") as (mock, decode_ch):
        decode = gen("hand-1", prompt=tuple(range(1, 70)), max_new_tokens=3)
        decode.kv.kv_transfer_params.CopyFrom(handoff)
        messages = await collect(decode_ch, decode)
        assert len(stream_tokens(messages)) == 3
        assert not messages[-1].outputs.finish_info.HasField("kv_transfer_params")

        del decode.kv.kv_transfer_params["mocker_request_id"]
        err = await rpc_error(collect(decode_ch, decode))
        assert err.code == C.INVALID_ARGUMENT and "mocker_request_id" in err.message
        err = await rpc_error(collect(decode_ch, gen()))
        assert (err.code, err.message) == (
            C.FAILED_PRECONDITION,
            "decode mock server requires a prefill KV transfer payload",
        )
        assert mock.active_request_count() == 0


# --- 6: startup validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"engine_args": {"engine_type": "sglang"}}, "engine_type"),
        ({"engine_args": {"dp_size": 0}}, "dp_size"),
        ({"engine_args": {"dp_size": 2, "data_parallel_rank": 2}}, "data_parallel_rank"),
        ({"engine_args": {"worker_type": "prefill"}}, "worker_type"),
        ({"engine_args": {"is_decode": True}}, "worker_type"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"engine_args": {"num_gpu_blocks": 0}}, "num_gpu_blocks"),
        ({"engine_args": {"bogus": 1}}, "bogus"),
        ({"listen": "localhost:0"}, "listen"),
        ({"disaggregation_mode": "both"}, "both"),
    ],
)
async def test_startup_errors_name_the_key(kw, key):
    with pytest.raises(MockConfigError) as info:
        async with open_mock_server(MockConfig(listen=kw.pop("listen", "127.0.0.1:0"), **kw)):
            pytest.fail("started")
    assert key in str(info.value)


# --- 7: Control values and UNIMPLEMENTED ------------------------------------------------------------------


async def test_control_values():
    async with running_mock(engine_args={"dp_size": 2, "max_model_len": 512, "num_gpu_blocks": 100}) as (_, ch):
        info = await control(ch, "GetServerInfo", control_pb2.GetServerInfoRequest(), control_pb2.ServerInfo)
        assert info.engine_version == trio_sidecar.__version__ and info.api_version == "vllm"
        assert info.instance_id == "trio-sidecar-mock-aggregated"
        assert info.HasField("rl_capabilities") and info.rl_capabilities == control_pb2.RlCapabilities()  # as vLLM
        p = info.parallelism
        assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size, p.data_parallel_rank) == (
            1,
            1,
            2,
            0,
        )
        assert (p.decode_context_parallel_size, p.world_size, p.data_parallel_size_local) == (1, 1, 2)
        assert (info.max_model_len, info.kv_block_size, info.total_kv_blocks) == (512, 4, 200)
        assert (info.max_running_requests, info.max_batched_tokens, info.max_loras) == (64, 1024, 0)
        assert info.effective_attention_block_size == 4
        model = await control(ch, "GetModelInfo", control_pb2.GetModelInfoRequest(), control_pb2.ModelInfo)
        assert (model.model_id, model.served_model_name, list(model.served_model_aliases)) == (
            "mocker-model",
            "mocker-model",
            [],
        )
        assert (model.supports_text_input, model.supports_token_ids_input, model.supports_lora) == (False, True, False)
        assert not model.supports_multimodal and model.reasoning_parser == "" and model.tool_call_parser == ""


async def test_control_knobs_stand_in_for_one_node_of_a_hybrid_dp_group():
    knobs = {
        "dp_size": 4,
        "data_parallel_rank": 2,
        "data_parallel_size_local": 2,
        "num_gpu_blocks": 100,
        "enable_prefix_caching": True,  # KV events on
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 3,
        "world_size": 6,
        "effective_attention_block_size": 32,
        "reasoning_parser": "deepseek_r1",
        "tool_call_parser": "hermes",
    }
    async with running_mock(engine_args=knobs) as (_, ch):
        info = await control(ch, "GetServerInfo", control_pb2.GetServerInfoRequest(), control_pb2.ServerInfo)
        p = info.parallelism
        assert (p.data_parallel_size, p.data_parallel_rank, p.data_parallel_size_local) == (4, 2, 2)
        assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.world_size) == (2, 3, 6)
        assert info.total_kv_blocks == 200  # the hosted ranks' blocks, summed
        assert info.effective_attention_block_size == 32 and info.kv_block_size == 4
        model = await control(ch, "GetModelInfo", control_pb2.GetModelInfoRequest(), control_pb2.ModelInfo)
        assert (model.reasoning_parser, model.tool_call_parser) == ("deepseek_r1", "hermes")
        sources = await control(
            ch, "GetKvEventSources", control_pb2.GetKvEventSourcesRequest(), control_pb2.GetKvEventSourcesResponse
        )
        assert [s.data_parallel_rank for s in sources.sources] == [2, 3]
        assert len(await collect(ch, gen("on-3", max_new_tokens=1), metadata=(("x-data-parallel-rank", "3"),))) == 2
        error = await rpc_error(collect(ch, gen("on-0", max_new_tokens=1), metadata=(("x-data-parallel-rank", "0"),)))
        assert error.code == C.INVALID_ARGUMENT and "connected ranks: [2, 3]" in error.message


async def test_the_optional_attention_block_size_can_be_absent_and_the_local_size_unreported():
    async with running_mock(
        engine_args={
            "dp_size": 2,
            "data_parallel_size_local": 0,
            "effective_attention_block_size": None,
            "enable_prefix_caching": True,
        }
    ) as (_, ch):
        info = await control(ch, "GetServerInfo", control_pb2.GetServerInfoRequest(), control_pb2.ServerInfo)
        assert not info.HasField("effective_attention_block_size")
        assert (info.parallelism.data_parallel_size, info.parallelism.data_parallel_size_local) == (2, 0)
        sources = await control(
            ch, "GetKvEventSources", control_pb2.GetKvEventSourcesRequest(), control_pb2.GetKvEventSourcesResponse
        )
        assert [s.data_parallel_rank for s in sources.sources] == [0, 1]


async def test_null_limits_are_reported_as_zero_and_mode_in_instance_id():
    async with running_mock(
        disaggregation_mode="decode", engine_args={"max_num_seqs": None, "max_num_batched_tokens": None}
    ) as (_, ch):
        info = await control(ch, "GetServerInfo", control_pb2.GetServerInfoRequest(), control_pb2.ServerInfo)
        assert (info.max_running_requests, info.max_batched_tokens, info.max_model_len) == (0, 0, 0)
        assert info.instance_id == "trio-sidecar-mock-decode"


async def test_shutdown_is_the_only_unimplemented_control_rpc():
    async with running_mock() as (_, ch):
        err = await rpc_error(control(ch, "Shutdown", control_pb2.ShutdownRequest(), control_pb2.ShutdownResponse))
        assert (err.code, err.message) == (C.UNIMPLEMENTED, "shutdown is not supported by the mocker")


# --- 8, 9, 12: capacity and concurrency --------------------------------------------------------------------


async def test_capacity_rejection_unary_and_streaming():
    async with running_mock(engine_args={"num_gpu_blocks": 1}) as (mock, ch):
        request = gen(prompt=(1, 2, 3, 4, 5))
        err = await rpc_error(ch.unary_unary(GENERATE, request, pb.GenerateResponse))
        assert (err.code, err.message) == (C.RESOURCE_EXHAUSTED, "request exceeds the simulated KV-cache capacity")
        seen = []
        with pytest.raises(RpcError) as info:
            async with ch.unary_stream(GENERATE_STREAM, request, pb.GenerateResponse) as stream:
                async for message in stream:
                    seen.append(message)
        # The stream opens (prompt_info first) and then fails; whether our client surfaces the early
        # message depends on arrival timing, so the exact shape is pinned by the grpcio test.
        assert all(m.HasField("prompt_info") for m in seen) and len(seen) <= 1
        assert info.value.code == C.RESOURCE_EXHAUSTED
        assert mock.active_request_count() == 0


async def test_concurrency_limit_and_permit_held_until_the_stream_ends():
    async with running_mock(max_concurrent_requests=2, engine_args={"max_num_seqs": 1, **SLOW}) as (mock, ch):
        async with ch.unary_stream(GENERATE_STREAM, gen("a", max_new_tokens=100), pb.GenerateResponse) as a:
            async with ch.unary_stream(GENERATE_STREAM, gen("b", max_new_tokens=100), pb.GenerateResponse) as b:
                await a.__anext__()
                await b.__anext__()
                assert mock.active_request_count() == 2
                err = await rpc_error(collect(ch, gen("c", max_new_tokens=1)))
                assert (err.code, err.message) == (C.RESOURCE_EXHAUSTED, "Mocker concurrent request limit reached")
                with trio.fail_after(5):  # queued requests count against the limit
                    await mock.metrics_value(0).wait_value(lambda m: (m.running_requests, m.waiting_requests) == (1, 1))
        await wait_drained(mock)
        assert len(stream_tokens(await collect(ch, gen("c", max_new_tokens=1)))) == 1


# --- 11: unary ------------------------------------------------------------------------------------------------


async def test_unary_accumulates_the_output():
    async with running_mock() as (mock, ch):
        response = await ch.unary_unary(
            GENERATE, gen("stable", max_new_tokens=2), pb.GenerateResponse, metadata=[("x-data-parallel-rank", "0")]
        )
        assert response.HasField("prompt_info") and response.prompt_info.num_prompt_tokens == 4
        out = response.outputs
        assert out.num_tokens == 2 and list(out.token_ids) == [31728, 29888]
        assert out.text == "<token:31728><token:29888>"
        assert out.finish_info.finish_reason == FinishReason.LENGTH and out.finish_info.num_output_tokens == 2
        assert mock.active_request_count() == 0
        err = await rpc_error(
            ch.unary_unary(GENERATE, gen(), pb.GenerateResponse, metadata=[("x-data-parallel-rank", "1")])
        )
        assert err.code == C.INVALID_ARGUMENT
        assert "data parallel rank 1 is not connected to this frontend; connected ranks: [0]" in err.message
        err = await rpc_error(
            ch.unary_unary(GENERATE, gen(), pb.GenerateResponse, metadata=[("x-data-parallel-rank", "one")])
        )
        assert err.message == "x-data-parallel-rank metadata must be an unsigned 32-bit integer"
        rpc, recorded, metadata, peer = mock.recorded_requests[0]
        assert (rpc, recorded.request_id, metadata) == ("Generate", "stable", (("x-data-parallel-rank", "0"),))
        assert peer[0] == "127.0.0.1" and peer[1] == ch.local_address[1]


# --- 13: slow consumer -----------------------------------------------------------------------------------------


async def test_slow_consumer_survives():
    async with running_mock() as (mock, ch):
        async with ch.unary_stream(GENERATE_STREAM, gen(max_new_tokens=50), pb.GenerateResponse) as stream:
            await trio.sleep(0.05)  # the engine finishes all 50 tokens while nobody reads
            messages = [m async for m in stream]
        assert len(stream_tokens(messages)) == 50
        finish = messages[-1].outputs.finish_info
        assert finish.finish_reason == FinishReason.LENGTH and finish.num_output_tokens == 50
        assert mock.active_request_count() == 0


# --- 14, 15: KV-event sources --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "caching", "dp_size", "count"),
    [
        ("aggregated", True, 1, 1),
        ("prefill", True, 1, 1),
        ("decode", True, 1, 0),
        ("aggregated", False, 1, 0),
        ("aggregated", True, 2, 2),
    ],
)
async def test_kv_event_source_counts(mode, caching, dp_size, count):
    engine_args = {"enable_prefix_caching": caching, "dp_size": dp_size}
    async with running_mock(disaggregation_mode=mode, engine_args=engine_args) as (mock, ch):
        response = await control(
            ch, "GetKvEventSources", control_pb2.GetKvEventSourcesRequest(), control_pb2.GetKvEventSourcesResponse
        )
        assert len(response.sources) == count == len(mock.kv_event_endpoints)
        for rank, (source, bound) in enumerate(zip(response.sources, mock.kv_event_endpoints, strict=True)):
            port = bound.rsplit(":", 1)[1]
            assert bound == f"tcp://127.0.0.1:{port}"
            assert source.endpoint == f"tcp://0.0.0.0:{port}"
            assert (source.transport, source.topic, source.replay_endpoint) == ("zmq", "", "")
            assert (source.data_parallel_rank, source.encoding, source.schema_version) == (rank, "msgpack", 1)


async def test_replay_endpoint_is_advertised_per_rank():
    engine_args = {"enable_prefix_caching": True, "dp_size": 2, "zmq_replay_port": 0}
    async with running_mock(engine_args=engine_args) as (mock, ch):
        response = await control(
            ch, "GetKvEventSources", control_pb2.GetKvEventSourcesRequest(), control_pb2.GetKvEventSourcesResponse
        )
        replay = [s.replay_endpoint for s in response.sources]
        assert len(replay) == 2 and all(r.startswith("tcp://0.0.0.0:") for r in replay)
        assert len(set(replay)) == 2 and not set(replay) & {s.endpoint for s in response.sources}


async def test_a_failed_publisher_is_not_advertised():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine_args = {"enable_prefix_caching": True, "zmq_kv_events_port": port}
        async with running_mock(engine_args=engine_args) as (mock, ch):
            response = await control(
                ch, "GetKvEventSources", control_pb2.GetKvEventSourcesRequest(), control_pb2.GetKvEventSourcesResponse
            )
            assert list(response.sources) == [] and mock.kv_event_endpoints == []
            assert len(stream_tokens(await collect(ch, gen(max_new_tokens=2)))) == 2


# --- 17: context limit ----------------------------------------------------------------------------------------


async def test_context_limit():
    async with running_mock(engine_args={"max_model_len": 8}) as (_, ch):
        messages = await collect(ch, gen(max_new_tokens=100))
        assert len(stream_tokens(messages)) == 4
        assert messages[-1].outputs.finish_info.finish_reason == FinishReason.LENGTH
        err = await rpc_error(collect(ch, gen(min_new_tokens=5)))
        assert err.code == C.INVALID_ARGUMENT and "effective max_new_tokens (4)" in err.message
        err = await rpc_error(collect(ch, gen(prompt=range(8))))
        assert err.message == "this model's maximum context length is 8 tokens, but the prompt contains 8 input tokens"


# --- 18: Abort ------------------------------------------------------------------------------------------------


async def test_abort_ends_the_stream_with_an_aborted_terminal_and_ok():
    async with running_mock(engine_args=SLOW) as (mock, ch):
        async with ch.unary_stream(GENERATE_STREAM, gen("ab", max_new_tokens=10_000), pb.GenerateResponse) as stream:
            first = await stream.__anext__()
            assert first.HasField("prompt_info")
            with trio.fail_after(2):
                await abort(ch, "ab")
                rest = [m async for m in stream]  # ends with status OK (no RpcError)
        terminal = rest[-1].outputs
        assert terminal.finish_info.finish_reason == FinishReason.ABORTED
        assert terminal.num_tokens == 0 and list(terminal.token_ids) == []
        assert not terminal.finish_info.HasField("kv_transfer_params")
        sent = len(stream_tokens(rest))
        assert terminal.finish_info.num_output_tokens == sent
        assert sum(m.outputs.HasField("finish_info") for m in rest) == 1
        await wait_drained(mock)
        assert mock.call_record("ab") == CallRecord("ab", sent, "abort")
        await abort(ch, "ab", "ab", "unknown")  # repeated and unknown: no-ops
        await abort(ch)
        assert mock.abort_calls == [["ab"], ["ab", "ab", "unknown"], []]


async def test_abort_of_a_unary_generate_returns_the_tokens_so_far():
    async with running_mock(engine_args=SLOW) as (mock, ch):
        async with trio.open_nursery() as nursery:
            result = []

            async def call():
                result.append(await ch.unary_unary(GENERATE, gen("ua", max_new_tokens=10_000), pb.GenerateResponse))

            nursery.start_soon(call)
            with trio.fail_after(5):
                await mock.metrics_value(0).wait_value(lambda m: m.running_requests == 1)
            with trio.fail_after(2):
                await abort(ch, "ua")
        out = result[0].outputs
        assert result[0].HasField("prompt_info")
        assert out.finish_info.finish_reason == FinishReason.ABORTED
        assert out.finish_info.num_output_tokens == out.num_tokens == len(out.token_ids)
        assert mock.active_request_count() == 0


async def test_a_natural_finish_racing_an_abort_yields_exactly_one_terminal():
    async with running_mock() as (mock, ch):
        for i in range(10):
            rid = f"race-{i}"
            async with ch.unary_stream(GENERATE_STREAM, gen(rid, max_new_tokens=3), pb.GenerateResponse) as stream:
                await stream.__anext__()
                await abort(ch, rid)
                rest = [m async for m in stream]
            terminals = [m.outputs.finish_info for m in rest if m.outputs.HasField("finish_info")]
            assert len(terminals) == 1
            assert terminals[0].num_output_tokens == len(stream_tokens(rest))
            assert terminals[0].finish_reason in (FinishReason.LENGTH, FinishReason.ABORTED)
        assert mock.active_request_count() == 0


async def test_call_records_tell_how_each_request_ended_and_are_kept_after_it():
    async with running_mock() as (mock, ch):
        assert mock.call_record("never") is None
        done = await collect(ch, gen("done", max_new_tokens=3))
        assert (
            mock.call_record("done")
            == CallRecord("done", len(stream_tokens(done)), "finish")
            == CallRecord("done", 3, "finish")
        )
        await collect(ch, gen("done", max_new_tokens=1))  # the same id again: the last call is kept
        assert mock.call_record("done") == CallRecord("done", 1, "finish")
        for i in range(CALL_HISTORY):
            await collect(ch, gen(f"filler-{i}", max_new_tokens=1))
        assert mock.call_record("done") is None  # older than the last CALL_HISTORY ended calls
        assert mock.call_record(f"filler-{CALL_HISTORY - 1}") == CallRecord(f"filler-{CALL_HISTORY - 1}", 1, "finish")


# --- 19: duplicate in-flight id --------------------------------------------------------------------------------


async def test_duplicate_in_flight_request_id():
    async with running_mock(engine_args=SLOW) as (mock, ch):
        async with ch.unary_stream(GENERATE_STREAM, gen("dup", max_new_tokens=10_000), pb.GenerateResponse) as stream:
            await stream.__anext__()
            err = await rpc_error(collect(ch, gen("dup", max_new_tokens=1)))
            assert (err.code, err.message) == (C.ALREADY_EXISTS, "request_id 'dup' is already in flight")
        await wait_drained(mock)
        assert len(stream_tokens(await collect(ch, gen("dup", max_new_tokens=1)))) == 1


# --- 21: dropped stream ------------------------------------------------------------------------------------------


async def test_dropped_stream_frees_its_slot_and_spares_the_others():
    async with running_mock(engine_args={"speedup_ratio": 0.1}) as (mock, ch):
        async with ch.unary_stream(GENERATE_STREAM, gen("keep", max_new_tokens=10_000), pb.GenerateResponse) as keep:
            await keep.__anext__()
            async with ch.unary_stream(
                GENERATE_STREAM, gen("drop", max_new_tokens=10_000), pb.GenerateResponse
            ) as drop:
                await drop.__anext__()
                await drop.__anext__()  # the first token
            # Left the block: RST_STREAM. The dropped request leaves within 2 s...
            with trio.fail_after(2):
                while mock.active_request_count() != 1 or mock.metrics(0).running_requests != 1:
                    await trio.sleep(0.01)
            dropped = mock.call_record("drop")
            assert dropped.ended == "drop" and dropped.tokens_sent >= 1
            assert mock.call_record("keep").ended is None  # still in flight
            # ...and the other one keeps streaming.
            more = [await keep.__anext__() for _ in range(3)]
            assert all(m.outputs.num_tokens == 1 for m in more) and mock.metrics(0).running_requests == 1
            await abort(ch, "keep")
            rest = [m async for m in keep]
        assert rest[-1].outputs.finish_info.finish_reason == FinishReason.ABORTED
        await wait_drained(mock)


# --- 22: KV events through the server -------------------------------------------------------------------------


async def test_kv_events_for_a_two_block_prompt_and_its_eviction():
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    engine_args = {"enable_prefix_caching": True, "num_gpu_blocks": 4, "block_size": 4}
    async with running_mock(engine_args=engine_args) as (mock, ch):
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(mock.kv_event_endpoints[0])
            # ZMQ slow joiner: events published before the subscription is in place are lost, so probe
            # with empty messages until one arrives (they only advance the sequence number).
            with trio.fail_after(5):
                while True:
                    mock._publishers[0].publish([])
                    await trio.sleep(0.02)
                    try:
                        sub.recv_multipart(zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        continue
            while True:  # drain the remaining probes
                try:
                    sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

            async def receive_events(predicate):
                events = []
                with trio.fail_after(5):
                    while not predicate(events):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            await trio.sleep(0.01)
                            continue
                        assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8
                        timestamp, batch, dp_rank = msgpack.unpackb(frames[2])
                        assert isinstance(timestamp, float) and dp_rank == 0
                        events.append((int.from_bytes(frames[1], "big"), batch))
                return events

            prompt = tuple(range(100, 108))  # two full blocks
            await collect(ch, gen("kv-1", prompt=prompt, max_new_tokens=1))
            stored = await receive_events(
                lambda evs: sum(len(e["block_hashes"]) for _, b in evs for e in b if e["type"] == "BlockStored") >= 2
            )
            blocks = [e for _, b in stored for e in b if e["type"] == "BlockStored"]
            first = blocks[0]
            assert first["parent_block_hash"] is None and first["block_size"] == 4
            assert len(first["token_ids"]) == len(first["block_hashes"]) * 4
            hashes = [h for e in blocks for h in e["block_hashes"]]
            tokens = [t for e in blocks for t in e["token_ids"]]
            assert tokens[:8] == list(prompt)
            if len(blocks) > 1:
                assert blocks[1]["parent_block_hash"] == blocks[0]["block_hashes"][-1]

            # A 16-token prompt needs the whole pool: the cached blocks are evicted.
            await collect(ch, gen("kv-2", prompt=tuple(range(500, 516)), max_new_tokens=1))
            later = await receive_events(
                lambda evs: (
                    {h for _, b in evs for e in b if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
                    >= set(hashes[:2])
                )
            )
            seqs = [s for s, _ in stored + later]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        finally:
            sub.close(linger=0)
            context.term()


# --- 23: health --------------------------------------------------------------------------------------------------


async def test_health_check_watch_and_graceful_shutdown():
    async with running_mock(engine_args=SLOW) as (mock, ch):
        for name in ("", "vllm.Control", "vllm.Inference"):
            assert await check_health(ch, name) == health_pb2.HealthCheckResponse.SERVING
        err = await rpc_error(check_health(ch, "vllm.Nope"))
        assert (err.code, err.message) == (C.NOT_FOUND, "service not registered")

        seen = []
        async with watch_health(ch, "vllm.Inference") as updates:
            seen.append(await updates.__anext__())
            mock.set_serving_status("vllm.Inference", health_pb2.HealthCheckResponse.NOT_SERVING)
            seen.append(await updates.__anext__())
            mock.set_serving_status(None, health_pb2.HealthCheckResponse.SERVING)
            seen.append(await updates.__anext__())
        assert seen == [1, 2, 1]

        with trio.fail_after(5):
            async with watch_health(ch, "") as updates:
                assert await updates.__anext__() == health_pb2.HealthCheckResponse.SERVING
                async with ch.unary_stream(
                    GENERATE_STREAM, gen("inflight", max_new_tokens=10_000), pb.GenerateResponse
                ) as stream:
                    await stream.__anext__()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(mock.graceful_shutdown)
                        after = [s async for s in updates]  # NOT_SERVING, then the Watch ends OK
                        with pytest.raises(RpcError) as info:
                            async for _ in stream:
                                pass
        assert after == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert (info.value.code, info.value.message) == (C.UNAVAILABLE, "server shutting down")
        assert await check_health(ch, "vllm.Control") == health_pb2.HealthCheckResponse.NOT_SERVING
        err = await rpc_error(collect(ch, gen("late")))
        assert err.code == C.UNAVAILABLE
        assert mock.active_request_count() == 0


# --- 24: data parallelism ----------------------------------------------------------------------------------------


async def test_dp_rank_metadata_and_least_loaded_choice():
    async with running_mock(engine_args={"dp_size": 2, **SLOW}) as (mock, ch):
        rank1 = [("x-data-parallel-rank", "1")]
        async with ch.unary_stream(
            GENERATE_STREAM, gen("on-1", max_new_tokens=10_000), pb.GenerateResponse, metadata=rank1
        ) as s1:
            await s1.__anext__()
            with trio.fail_after(5):
                await mock.metrics_value(1).wait_value(lambda m: m.running_requests == 1)
            assert mock.metrics(0).running_requests == 0 and mock.metrics(1).dp_rank == 1
            # Without metadata: the least-loaded rank (rank 0 here).
            async with ch.unary_stream(GENERATE_STREAM, gen("auto", max_new_tokens=10_000), pb.GenerateResponse) as s2:
                await s2.__anext__()
                with trio.fail_after(5):
                    await mock.metrics_value(0).wait_value(lambda m: m.running_requests == 1)
                # Tie (1, 1) → the lowest rank.
                async with ch.unary_stream(
                    GENERATE_STREAM, gen("tie", max_new_tokens=10_000), pb.GenerateResponse
                ) as s3:
                    await s3.__anext__()
                    with trio.fail_after(5):
                        await mock.metrics_value(0).wait_value(lambda m: m.running_requests + m.waiting_requests == 2)
                await abort(ch, "auto", "on-1")
        err = await rpc_error(collect(ch, gen(), metadata=[("x-data-parallel-rank", "2")]))
        assert err.code == C.INVALID_ARGUMENT and "connected ranks: [0, 1]" in err.message
        await wait_drained(mock, 0)
        await wait_drained(mock, 1)


# --- 25: multimodal ----------------------------------------------------------------------------------------------


async def test_multimodal_flag():
    image = pb.MediaItem(modality=pb.MODALITY_IMAGE, url="http://example.invalid/cat.png")
    async with running_mock() as (_, ch):
        err = await rpc_error(collect(ch, gen(prompt=(1, 31999), media=[image])))
        assert err.code == C.INVALID_ARGUMENT and "--supports-multimodal" in err.message
    async with running_mock(supports_multimodal=True) as (_, ch):
        info = await control(ch, "GetModelInfo", control_pb2.GetModelInfoRequest(), control_pb2.ModelInfo)
        assert info.supports_multimodal
        data_uri = pb.MediaItem(modality=pb.MODALITY_IMAGE, data_uri="data:image/png;base64,iVBORw0KGgo=")
        for item in (image, data_uri):
            messages = await collect(ch, gen(prompt=(1, 31999, 2), media=[item], max_new_tokens=1))
            assert messages[0].prompt_info.num_prompt_tokens == 2 + 16
        audio = pb.MediaItem(modality=pb.MODALITY_AUDIO, url="http://example.invalid/a.wav")
        err = await rpc_error(collect(ch, gen(prompt=(1, 31999), media=[audio])))
        assert err.message == "only image and video media are supported by the mock server"
        video = pb.MediaItem(modality=pb.MODALITY_VIDEO, url="http://example.invalid/v.mp4")
        messages = await collect(ch, gen(prompt=(1, 31999, 2), media=[video], max_new_tokens=1))
        assert messages[0].prompt_info.num_prompt_tokens == 2 + 16
        err = await rpc_error(collect(ch, gen(prompt=(1, 31999), media=[pb.MediaItem(modality=pb.MODALITY_IMAGE)])))
        assert err.message == "media item 0 has no source"
        err = await rpc_error(collect(ch, gen(prompt=(1, 2), media=[image])))
        assert err.message == "expected 1 image placeholders in token_ids, found 0"


async def test_an_encode_server_answers_an_encoder_handoff_and_no_tokens():
    image = pb.MediaItem(modality=pb.MODALITY_IMAGE, url="http://example.invalid/cat.png", uuid="cat")
    async with running_mock(supports_multimodal=True, disaggregation_mode="encode") as (mock, ch):
        messages = await collect(ch, gen("e1", prompt=(1, 31999, 2), media=[image], max_new_tokens=1))
        assert messages[0].prompt_info.num_prompt_tokens == 2 + 16
        assert [m.outputs.num_tokens for m in messages[1:]] == [0]
        finish = messages[-1].outputs.finish_info
        assert (finish.finish_reason, finish.num_output_tokens) == (pb.FinishInfo.STOP, 0)
        assert dict(finish.ec_transfer_params) == {"mocker_encode_request_id": "e1", "mm_hashes": ["cat"]}
        assert not finish.HasField("kv_transfer_params")
        err = await rpc_error(collect(ch, gen("e2", prompt=(1, 2), max_new_tokens=1)))
        assert (err.code, err.message) == (C.INVALID_ARGUMENT, "encode mock server requires media")
        prefill = gen("e3", prompt=(1, 31999), media=[image], max_new_tokens=1)
        prefill.kv.kv_transfer_params.update({"do_remote_decode": True})
        err = await rpc_error(collect(ch, prefill))
        assert (err.code, err.message) == (C.FAILED_PRECONDITION, "encode mock server received KV transfer parameters")


# --- 29: preemption through the server --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["lifo", "fifo"])
async def test_preemption_under_kv_pressure_is_counted(mode):
    # 4 blocks of 4 tokens; two 6-token prompts growing to 14 tokens cannot both stay resident.
    engine_args = {"num_gpu_blocks": 4, "preemption_mode": mode}
    async with running_mock(engine_args=engine_args) as (mock, ch):
        async with trio.open_nursery() as nursery:
            for rid in ("p1", "p2"):
                nursery.start_soon(collect, ch, gen(rid, prompt=tuple(range(6)), max_new_tokens=8))
        assert mock.metrics(0).vllm_preemptions_total >= 1
        await wait_drained(mock)


# --- configuration and hooks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:0", ("127.0.0.1", 0)), ("0.0.0.0:50051", ("0.0.0.0", 50051)), ("[::1]:8000", ("::1", 8000))],
)
def test_parse_listen_accepts_literal_ips(text, expected):
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    "text", ["localhost:1", "127.0.0.1", "::1:80", "[127.0.0.1]:80", "127.0.0.1:x", "1.2.3.4:65536"]
)
def test_parse_listen_rejects_everything_else(text):
    with pytest.raises(MockConfigError, match="invalid listen address"):
        parse_listen(text)


async def test_engine_args_instance_and_repr_shows_live_state():
    from trio_sidecar.mock.engine_args import EngineArgs

    args = EngineArgs(speedup_ratio=0.1, block_size=4, enable_prefix_caching=False)
    async with open_mock_server(MockConfig(listen="127.0.0.1:0", engine_args=args)) as mock:
        assert mock.address == f"127.0.0.1:{mock.port}" and mock.port > 0
        from trio_sidecar.transport import open_channel

        async with open_channel("127.0.0.1", mock.port) as ch:
            async with ch.unary_stream(GENERATE_STREAM, gen("live", max_new_tokens=10_000), pb.GenerateResponse) as s:
                await s.__anext__()
                assert "[1 active |" in repr(mock)
        await wait_drained(mock)
        assert repr(mock) == f"<MockServer 127.0.0.1:{mock.port} [0 active | rank 0: 0 running, 0 waiting]>"


async def test_recording_can_be_turned_off():
    async with running_mock(record_requests=False) as (mock, ch):
        await collect(ch, gen(max_new_tokens=1))
        await abort(ch, "r")
        assert mock.recorded_requests == [] and mock.abort_calls == []


async def test_ipv6_loopback_listen():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    from trio_sidecar.transport import open_channel

    async with open_mock_server(MockConfig(listen="[::1]:0", engine_args={"enable_prefix_caching": False})) as mock:
        assert mock.address == f"[::1]:{mock.port}"
        async with open_channel("::1", mock.port) as ch:
            assert await check_health(ch, "") == health_pb2.HealthCheckResponse.SERVING


async def test_serve_mock_reports_the_server_through_task_status(nursery):
    from trio_sidecar.mock import serve_mock
    from trio_sidecar.transport import open_channel

    mock = await nursery.start(serve_mock, MockConfig(listen="127.0.0.1:0", engine_args={"speedup_ratio": 0.0}))
    async with open_channel("127.0.0.1", mock.port) as ch:
        assert len(stream_tokens(await collect(ch, gen(max_new_tokens=3)))) == 3
