"""Pins of the live vLLM 0.32.0 behaviours of docs/reference/real-vllm.md#live-behaviours, through the project's transport.

These are the facts the mock and the sidecar are built on; if a vLLM upgrade changes one, this file says
which. Control values are checked on the raw wire (field numbers decoded by hand, ``real_vllm_wire``) so they do not
depend on our generated schema.
"""

from __future__ import annotations

import pytest
import trio
from real_vllm_client import open_direct_channel, rpc_error_types
from real_vllm_helpers import (
    ABORT,
    GENERATE,
    collect,
    drop_outcome,
    generate_request,
    race_attempts,
    unique_id,
)
from real_vllm_server import MAX_MODEL_LEN, READY_LOG_LINE, SERVED_MODEL_NAME
from real_vllm_wire import RawMessage, decode, scalar_fields

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_pb2, inference_pb2
from trio_sidecar.core.status import StatusCode

SERVING = health_pb2.HealthCheckResponse.SERVING
LENGTH = inference_pb2.FinishInfo.LENGTH
ABORTED = inference_pb2.FinishInfo.ABORTED
# max_new_tokens = max_model_len - prompt length (docs/reference/real-vllm.md#abort-and-cancellation), so a stream lasts long enough to act on.
LONG = MAX_MODEL_LEN - 4


@pytest.fixture
async def direct(real_server):
    async with open_direct_channel(real_server.host, real_server.grpc_port) as channel:
        yield channel


async def health_check(channel, service: str):
    return await channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        health_pb2.HealthCheckRequest(service=service),
        health_pb2.HealthCheckResponse,
        timeout=30,
    )


# -- health (docs/reference/real-vllm.md#health) ---------------------------------------------------------------------------------------


def test_the_server_logs_readiness(real_server):
    # docs/reference/real-vllm.md#readiness: logged after the engine handshake, by the Rust frontend, with the gRPC address.
    assert real_server.find_in_log(rf"{READY_LOG_LINE} addr={real_server.host}:{real_server.grpc_port} ")


def test_no_not_serving_phase_during_startup(real_server):
    """docs/reference/real-vllm.md#readiness: until the engine is ready, Check fails (UNAVAILABLE / refused); it never reports NOT_SERVING."""
    outcomes = real_server.startup_outcomes
    if not outcomes:
        pytest.skip("attached server: startup not observed")
    assert outcomes[-1] == "SERVING", outcomes
    assert "NOT_SERVING" not in outcomes, outcomes
    assert set(outcomes[:-1]) <= {"connection refused", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, outcomes


@pytest.mark.parametrize("service", ["", "vllm.Inference", "vllm.Control"])
async def test_health_check_reports_serving(direct, service):
    assert (await health_check(direct, service)).status == SERVING


async def test_health_check_of_an_unknown_service_is_not_found(direct):
    with pytest.raises(rpc_error_types()) as info:
        await health_check(direct, "vllm.Nope")
    assert (info.value.code, info.value.message) == (StatusCode.NOT_FOUND, "service not registered")


async def test_health_watch_streams_serving_first(direct):
    request = health_pb2.HealthCheckRequest(service="vllm.Inference")
    with trio.fail_after(30):
        async with direct.unary_stream(
            "/grpc.health.v1.Health/Watch", request, health_pb2.HealthCheckResponse
        ) as stream:
            first = await stream.__anext__()
    assert first.status == SERVING


@pytest.mark.parametrize(
    "method",
    [
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/vllm.Generate/Generate",  # the pre-split service (0.22-0.26)
        "/vllm.Inference/NoSuchMethod",
        "/vllm.Control/NoSuchMethod",
    ],
)
async def test_unknown_methods_and_reflection_are_unimplemented(direct, method):
    with pytest.raises(rpc_error_types()) as info:
        await direct.unary_unary(method, RawMessage(), RawMessage, timeout=30)
    assert info.value.code == StatusCode.UNIMPLEMENTED


# -- Control on the raw wire (docs/reference/real-vllm.md#control) ----------------------------------------------------------------------


async def test_server_info_raw_fields(direct):
    raw = await direct.unary_unary("/vllm.Control/GetServerInfo", RawMessage(), RawMessage, timeout=30)
    fields = scalar_fields(raw.data)
    assert fields[1] == b"0.32.0"
    assert fields[2] == b"vllm"
    assert fields[3].decode().isdecimal()
    # ParallelismInfo: TP, PP, DP, DCP, world size, DP-local all 1; rank 0 omitted as a proto3 default.
    assert scalar_fields(fields[4]) == {1: 1, 2: 1, 3: 1, 5: 1, 6: 1, 7: 1}
    assert fields[5] == MAX_MODEL_LEN
    assert fields[6] == 128  # kv_block_size
    assert fields[7] == 4096  # total_kv_blocks: 1 GiB of CPU KV cache for this model
    assert fields[8] == 8  # max_running_requests = --max-num-seqs
    assert fields[9] == 2048  # max_batched_tokens
    assert 10 not in fields  # max_loras 0 (LoRA off) omitted
    assert fields[11] == b""  # rl_capabilities present as an empty message
    assert fields[14] == 128  # effective_attention_block_size
    assert set(fields) == {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 14}


async def test_model_info_raw_fields(direct, real_server):
    raw = await direct.unary_unary("/vllm.Control/GetModelInfo", RawMessage(), RawMessage, timeout=30)
    assert decode(raw.data) == {
        1: [str(real_server.env.model).encode()],
        2: [SERVED_MODEL_NAME.encode()],
        20: [1],
        21: [1],
    }


async def test_kv_event_sources_are_empty_without_kv_events(direct):
    raw = await direct.unary_unary("/vllm.Control/GetKvEventSources", RawMessage(), RawMessage, timeout=30)
    assert raw.data == b""


# -- stream shape (docs/reference/real-vllm.md#inference-stream) -----------------------------------------------------------------------------------


async def test_generate_stream_shape_with_logprobs_and_candidates(direct):
    request = generate_request(unique_id("shape"), logprobs=True, top_n=2, prompt_logprobs=True)
    out = await collect(direct, request)
    assert out.error is None, out.error
    assert len(out.messages) == 9
    first = out.messages[0]
    assert first.HasField("prompt_info") and not first.HasField("outputs")
    info = first.prompt_info
    assert info.num_prompt_tokens == 4
    assert list(info.token_ids) == [5, 6, 7, 8]
    assert (info.logprobs[0], info.ranks[0]) == (0.0, 0)  # placeholder for the first position
    assert len(info.logprobs) == len(info.ranks) == len(info.candidate_tokens) == 4
    for i, message in enumerate(out.messages[1:], start=1):
        assert not message.HasField("prompt_info")
        o = message.outputs
        assert (o.index, o.num_tokens, len(o.token_ids), len(o.logprobs), len(o.ranks)) == (0, 1, 1, 1, 1)
        assert len(o.candidate_tokens) == 1
        top = o.candidate_tokens[0].tokens
        assert len(top) == 2
        # Greedy: the sampled token is the best one and is listed first with rank 1 (docs/reference/sidecar.md#per-message-checks).
        assert (top[0].id, top[0].rank, o.ranks[0]) == (o.token_ids[0], 1, 1)
        assert top[1].rank == 2 and top[1].logprob <= top[0].logprob
        assert o.HasField("finish_info") == (i == 8)
    final = out.messages[-1].outputs.finish_info
    assert (final.finish_reason, final.num_output_tokens) == (LENGTH, 8)


async def test_candidate_entries_are_empty_without_output_candidates(direct):
    out = await collect(direct, generate_request(unique_id("nocand"), logprobs=True))
    assert out.error is None, out.error
    outputs = [m.outputs for m in out.messages if m.HasField("outputs")]
    assert sum(o.num_tokens for o in outputs) == 8
    for o in outputs:
        assert len(o.candidate_tokens) == len(o.token_ids) == len(o.logprobs)
        assert all(len(c.tokens) == 0 for c in o.candidate_tokens)


async def test_unary_generate_matches_the_stream(direct):
    streamed = await collect(direct, generate_request(unique_id("s"), logprobs=True))
    unary = await direct.unary_unary(
        GENERATE, generate_request(unique_id("u"), logprobs=True), inference_pb2.GenerateResponse, timeout=120
    )
    assert unary.prompt_info.num_prompt_tokens == 4
    assert list(unary.outputs.token_ids) == streamed.tokens()
    assert unary.outputs.num_tokens == 8
    assert len(unary.outputs.candidate_tokens) == 8
    assert unary.outputs.finish_info.finish_reason == LENGTH


async def test_greedy_generation_is_deterministic(direct):
    a = await collect(direct, generate_request(unique_id("det")))
    b = await collect(direct, generate_request(unique_id("det")))
    assert a.tokens() == b.tokens() and len(a.tokens()) == 8


async def test_max_new_tokens_zero_generates_up_to_the_context_limit(direct):
    # Not a "server default 20" (docs/reference/wire.md#default-values): vllm-rs 0.32 leaves max_tokens unset, and the
    # engine then stops at max_model_len (ignore_eos keeps the random model from stopping at EOS earlier).
    out = await collect(direct, generate_request(unique_id("max0"), max_new_tokens=0))
    assert out.error is None, out.error
    terminal = out.terminal()
    assert (terminal.finish_reason, terminal.num_output_tokens) == (LENGTH, MAX_MODEL_LEN - 4)


async def test_duplicate_active_request_id_is_accepted(direct):
    request_id = unique_id("dup")
    results = {}

    async def run(key):
        results[key] = await collect(direct, generate_request(request_id, max_new_tokens=32))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a")
        nursery.start_soon(run, "b")
    assert results["a"].error is None and results["b"].error is None
    assert results["a"].tokens() == results["b"].tokens()


# -- Abort and cancellation (docs/reference/real-vllm.md#abort-and-cancellation) ---------------------------------------------------------------------------


async def abort(channel, *ids: str):
    return await channel.unary_unary(ABORT, control_pb2.AbortRequest(request_ids=list(ids)), RawMessage, timeout=30)


async def test_abort_without_ids_and_with_unknown_ids_is_a_no_op(direct):
    assert (await abort(direct)).data == b""
    assert (await abort(direct, "never-seen", "never-seen")).data == b""
    # The server still serves afterwards.
    assert len((await collect(direct, generate_request(unique_id("after-abort")))).tokens()) == 8


async def test_abort_ends_an_open_stream_with_an_aborted_terminal_and_status_ok(direct):
    for attempt in (
        race_attempts()
    ):  # a 252-token stream can finish before the Abort lands (docs/reference/real-vllm.md#abort-and-cancellation)
        await trio.sleep(0.2 if attempt else 0)
        request_id = unique_id("abort-me")
        out_messages = []
        with trio.fail_after(60):
            async with direct.unary_stream(
                "/vllm.Inference/GenerateStream",
                generate_request(request_id, max_new_tokens=LONG),
                inference_pb2.GenerateResponse,
                timeout=60,
            ) as stream:
                async for message in stream:
                    out_messages.append(message)
                    if len(out_messages) == 1:
                        await abort(direct, request_id)
        terminal = out_messages[-1].outputs.finish_info
        if terminal.finish_reason == ABORTED:
            break
    else:
        pytest.fail("every stream finished before its Abort arrived")
    last = out_messages[-1].outputs
    assert (last.num_tokens, list(last.token_ids)) == (0, [])
    assert terminal.num_output_tokens == sum(m.outputs.num_tokens for m in out_messages)
    assert terminal.num_output_tokens < LONG
    # Repeating the abort for the finished request is a no-op.
    assert (await abort(direct, request_id, request_id)).data == b""


async def test_dropping_a_stream_auto_aborts_the_request(direct, real_server):
    for attempt in race_attempts():
        await trio.sleep(0.2 if attempt else 0)
        request_id = unique_id("drop-me")
        offset = real_server.log_size()
        with trio.fail_after(60):
            async with direct.unary_stream(
                "/vllm.Inference/GenerateStream",
                generate_request(request_id, max_new_tokens=LONG),
                inference_pb2.GenerateResponse,
                timeout=60,
            ) as stream:
                async for message in stream:
                    assert message.HasField("prompt_info")
                    break  # leave the block after the first message: the transport resets the stream
        if await drop_outcome(real_server, request_id, offset=offset) == "aborted":
            break
    else:
        pytest.fail("every dropped stream finished before the reset arrived")
    # A later request is unaffected.
    assert len((await collect(direct, generate_request(unique_id("after-drop")))).tokens()) == 8


# -- error texts (docs/reference/real-vllm.md#error-texts) --------------------------------------------------------------------------------------

LORA_VARINT = b"\x78\x01"  # GenerateRequest field 15 as a varint (the unreleased fork's data_parallel_rank)


def _request(**kw):
    return generate_request(unique_id("err"), **kw)


ERROR_CASES = [
    # id, request factory, metadata, code, exact message or None, substring
    ("wrong-model", lambda: _request(model="nope"), (), StatusCode.NOT_FOUND, "model `nope` not found", None),
    (
        "missing-prompt",
        lambda: inference_pb2.GenerateRequest(request_id=unique_id("err")),
        (),
        StatusCode.INVALID_ARGUMENT,
        "prompt is required",
        None,
    ),
    (
        "min-over-max",
        lambda: _with_stopping(_request(max_new_tokens=2), min_new_tokens=5),
        (),
        StatusCode.INVALID_ARGUMENT,
        "`min_tokens` must be less than or equal to `max_tokens`, got min_tokens=5, max_tokens=2",
        None,
    ),
    (
        "top-p-2",
        lambda: _request(sampling=inference_pb2.RandomSampling(top_p=2.0)),
        (),
        StatusCode.INVALID_ARGUMENT,
        "top_p must be in (0, 1], got 2",
        None,
    ),
    # Says "text request" although the prompt is token ids; the external request id is quoted.
    (
        "empty-stop-string",
        lambda: _with_stopping(_request(), stop_strings=[""]),
        (),
        StatusCode.INVALID_ARGUMENT,
        "text request `{request_id}` stop strings cannot be empty",
        None,
    ),
    (
        "prompt-300",
        lambda: _request(prompt=[5] * 300),
        (),
        StatusCode.INVALID_ARGUMENT,
        "this model's maximum context length is 256 tokens, but the prompt contains 300 input tokens",
        None,
    ),
    (
        "prompt-256",
        lambda: _request(prompt=[5] * 256),
        (),
        StatusCode.INVALID_ARGUMENT,
        None,
        "this model's maximum context length is 256 tokens",
    ),
    (
        "lora-name",
        lambda: _request(lora_name="adapter"),
        (),
        StatusCode.FAILED_PRECONDITION,
        "engine was not started with LoRA enabled",
        None,
    ),
    (
        "dp-rank-3",
        lambda: _request(),
        (("x-data-parallel-rank", "3"),),
        StatusCode.INVALID_ARGUMENT,
        "engine-core error: data parallel rank 3 is not connected to this frontend; connected ranks: [0]",
        None,
    ),
    (
        "dp-rank-abc",
        lambda: _request(),
        (("x-data-parallel-rank", "abc"),),
        StatusCode.INVALID_ARGUMENT,
        "x-data-parallel-rank metadata must be an unsigned 32-bit integer",
        None,
    ),
    (
        "fork-field-15",
        lambda: RawMessage(_request().SerializeToString() + LORA_VARINT),
        (),
        StatusCode.INTERNAL,
        "failed to decode Protobuf message: GenerateRequest.lora_name: invalid wire type: Varint "
        "(expected LengthDelimited)",
        None,
    ),
]


def _with_stopping(request, **stopping):
    for key, value in stopping.items():
        if isinstance(value, list):
            getattr(request.stopping, key).extend(value)
        else:
            setattr(request.stopping, key, value)
    return request


@pytest.mark.parametrize(
    ("make", "metadata", "code", "exact", "substring"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
async def test_error_texts(direct, make, metadata, code, exact, substring):
    request = make()
    out = await collect(direct, request, metadata=metadata)
    assert out.error is not None, f"expected {code.name}, got {len(out.messages)} messages and OK"
    assert out.code == code, out.error
    if exact is not None:
        assert out.message == exact.format(request_id=getattr(request, "request_id", ""))
    else:
        assert substring in out.message
    # Every one of these is rejected as a trailers-only response: the open of the stream fails (what the
    # sidecar's generate() relies on to raise before yielding anything, docs/reference/sidecar.md#stream-level-rules).
    assert (out.phase, out.messages) == ("open", [])


async def test_dp_rank_metadata_zero_and_whitespace_are_accepted(direct):
    for value in ("0", " 0 "):
        out = await collect(direct, generate_request(unique_id("rank0")), metadata=(("x-data-parallel-rank", value),))
        assert out.error is None, (value, out.error)
        assert len(out.tokens()) == 8


async def test_skip_special_tokens_field_8_is_honoured(direct):
    # The contract marks the release that introduced ResponseOptions.skip_special_tokens as unverified:
    # 0.32 honours it. allowed_token_ids forces the special token <pad> (id 3).
    texts = {}
    for skip in (None, True, False):
        request = generate_request(unique_id("skip"), max_new_tokens=3)
        request.decoding.allowed_token_ids.append(3)
        if skip is not None:
            request.response.skip_special_tokens = skip
        out = await collect(direct, request)
        assert out.error is None and out.tokens() == [3, 3, 3], (skip, out.error)
        texts[skip] = "".join(m.outputs.text for m in out.messages)
    assert texts == {None: "", True: "", False: "<pad><pad><pad>"}


async def test_dp_rank_metadata_is_logged_by_the_server(direct, real_server):
    request_id = unique_id("rank-logged")
    offset = real_server.log_size()
    out = await collect(direct, generate_request(request_id), metadata=(("x-data-parallel-rank", "0"),))
    assert out.error is None
    assert real_server.find_in_log(rf"request_id={request_id} [^\n]*data_parallel_rank=Some\(0\)", offset)


async def test_empty_model_name_is_accepted(direct):
    out = await collect(direct, generate_request(unique_id("nomodel"), model=""))
    assert out.error is None and len(out.tokens()) == 8
