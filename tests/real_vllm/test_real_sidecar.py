"""The sidecar end to end against the real vLLM 0.32 server: discovery and registration, generation, cancellation, error mapping.

Discovery and registration data, generation compared with a direct gRPC call of the same request,
cancellation (proved by the server's auto-abort log line or an ABORTED terminal, docs/reference/real-vllm.md#abort-and-cancellation), and
the mapping of the server's errors to the sidecar's typed errors.
"""

from __future__ import annotations

import json
import re

import pytest
import trio
from real_vllm_client import open_direct_channel
from real_vllm_helpers import (
    auto_abort_pattern,
    closed_pattern,
    collect,
    drop_outcome,
    race_attempts,
    unique_id,
)
from real_vllm_server import MAX_MODEL_LEN, SERVED_MODEL_NAME

from trio_sidecar import (
    GenerateContext,
    HealthKind,
    InvalidArgument,
    ModelIdentity,
    ProtocolError,
    SidecarConfig,
    WorkerOptions,
    discover,
    open_sidecar,
)
from trio_sidecar._proto.vllm import control_pb2, inference_pb2
from trio_sidecar.core.errors import ErrorKind, status_to_error
from trio_sidecar.core.model import EngineConfig

PROMPT = [5, 6, 7, 8]
LONG = MAX_MODEL_LEN - len(PROMPT)


def sidecar_config(server, **kw) -> SidecarConfig:
    defaults = dict(grpc_connections=2, startup_deadline=120.0, connect_attempt_timeout=10.0, retry_interval=0.5)
    return SidecarConfig(grpc_endpoint=server.endpoint, **{**defaults, **kw})


@pytest.fixture
async def sidecar(real_server):
    async with open_sidecar(sidecar_config(real_server)) as sidecar:
        yield sidecar


@pytest.fixture
async def direct(real_server):
    async with open_direct_channel(real_server.host, real_server.grpc_port) as channel:
        yield channel


async def run(sidecar, request: dict, request_id: str):
    chunks = []
    with trio.fail_after(120):
        async with sidecar.generate(request, GenerateContext(request_id)) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    return chunks


def greedy(max_tokens: int = 8, **extra) -> dict:
    request = {
        "token_ids": list(PROMPT),
        "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
    }
    for key, value in extra.items():
        request.setdefault(key, {}).update(value)
    return request


def direct_request(
    request_id: str,
    *,
    max_tokens: int = 8,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    stop_token_ids=(),
) -> inference_pb2.GenerateRequest:
    """What the sidecar sends for ``greedy(...)`` (docs/reference/sidecar.md#field-mapping), written out by hand."""
    response = inference_pb2.ResponseOptions(output_text=True, output_token_ids=True)
    if logprobs is not None:
        response.output_logprobs = True
        response.output_candidates.top_n = logprobs
    if prompt_logprobs is not None:
        response.prompt_token_ids = True
        response.prompt_logprobs = True
        response.prompt_candidates.top_n = prompt_logprobs
    return inference_pb2.GenerateRequest(
        request_id=request_id,
        model=SERVED_MODEL_NAME,
        token_ids=inference_pb2.TokenIds(ids=PROMPT),
        temperature=0.0,
        sampling=inference_pb2.RandomSampling(num_sequences=1),
        stopping=inference_pb2.StoppingCriteria(
            max_new_tokens=max_tokens, ignore_eos=True, stop_token_ids=sorted(set(stop_token_ids))
        ),
        response=response,
        kv=inference_pb2.KVCacheParameters(),
    )


# -- discovery and registration ------------------------------------------------------------------------------


async def test_discovery_reports_the_real_identity_limits_and_parallelism(real_server):
    config = sidecar_config(real_server)
    with trio.fail_after(60):
        model = await discover(config)
    assert model.identity == ModelIdentity(
        model_id=str(real_server.env.model),
        served_model_name=SERVED_MODEL_NAME,
        served_model_aliases=(),
        reasoning_parser=None,
        tool_call_parser=None,
    )
    assert model.data_parallel_size() == 1
    assert model.supports_multimodal is False
    info = model.server_info
    assert (info.engine_version, info.api_version) == ("0.32.0", "vllm")
    assert info.instance_id.isdecimal()
    p = info.parallelism
    assert (
        p.tensor_parallel_size,
        p.pipeline_parallel_size,
        p.data_parallel_size,
        p.data_parallel_rank,
        p.decode_context_parallel_size,
        p.world_size,
        p.data_parallel_size_local,
    ) == (1, 1, 1, 0, 1, 1, 1)
    assert (info.max_loras, info.effective_attention_block_size) == (0, 128)
    assert info.HasField("rl_capabilities")

    # The start phase checks compatibility with the bootstrap model and yields the registration data.
    with trio.fail_after(60):
        async with open_sidecar(config, expected=model) as sidecar:
            assert sidecar.model.identity == model.identity
            assert sidecar.health.value.kind is HealthKind.SERVING
            assert sidecar.kv_event_sources == ()  # vLLM started without --kv-events-config
            assert sidecar.engine_config == EngineConfig(
                model=str(real_server.env.model),
                served_model_name=SERVED_MODEL_NAME,
                aliases=(),
                context_length=MAX_MODEL_LEN,
                kv_cache_block_size=128,
                total_kv_blocks=4096,
                max_num_seqs=8,
                max_num_batched_tokens=2048,
                data_parallel_size=1,
                data_parallel_start_rank=0,
            )
            engine_config, sources = sidecar.engine_config, sidecar.kv_event_sources

    from trio_sidecar.dynamo.plan import plan_registration

    plan = plan_registration(config, WorkerOptions(), engine_config, sources, environ={})
    assert plan.endpoint_path == "dynamo.backend.generate"
    assert (plan.model_path, plan.served_model_name, plan.aliases) == (
        str(real_server.env.model),
        SERVED_MODEL_NAME,
        (),
    )
    assert (plan.worker_type, plan.model_types, plan.kv_cache_block_size) == (
        "Aggregated",
        ("Chat", "Completions"),
        128,
    )
    runtime = plan.runtime_config
    assert {
        k: runtime[k]
        for k in (
            "context_length",
            "total_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "data_parallel_size",
            "data_parallel_start_rank",
        )
    } == {
        "context_length": 256,
        "total_kv_blocks": 4096,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "data_parallel_size": 1,
        "data_parallel_start_rank": 0,
    }
    assert "kv_event_publishing_enabled" not in runtime  # as native


# -- generation matches a direct call ------------------------------------------------------------------------


def expected_top_logprobs(o) -> list[list[dict]]:
    """docs/reference/sidecar.md#per-message-checks: the server's candidates in order, the sampled token first only if missing."""
    out = []
    for i, token in enumerate(o.token_ids):
        position = [
            {"rank": c.rank, "token_id": c.id, "token": None, "logprob": c.logprob}
            for c in o.candidate_tokens[i].tokens
        ]
        if token not in [c.id for c in o.candidate_tokens[i].tokens]:
            position.insert(0, {"rank": o.ranks[i], "token_id": token, "token": None, "logprob": o.logprobs[i]})
        out.append(position)
    return out


def expected_prompt_logprobs(info) -> list:
    out: list = [None]
    for j in range(1, info.num_prompt_tokens):
        entry = {str(info.token_ids[j]): {"logprob": info.logprobs[j], "rank": info.ranks[j]}}
        for c in info.candidate_tokens[j].tokens:
            entry.setdefault(str(c.id), {"logprob": c.logprob, "rank": c.rank})
        out.append(entry)
    return out


@pytest.mark.parametrize(
    ("logprobs", "prompt_logprobs"),
    [(None, None), (2, None), (0, None), (1, 1)],
    ids=["plain", "logprobs-2", "logprobs-0", "both"],
)
async def test_generation_through_the_sidecar_matches_a_direct_call(sidecar, direct, logprobs, prompt_logprobs):
    options = {}
    if logprobs is not None:
        options["logprobs"] = logprobs
    if prompt_logprobs is not None:
        options["prompt_logprobs"] = prompt_logprobs
    chunks = await run(sidecar, greedy(output_options=options), unique_id("via-sidecar"))
    reference = await collect(
        direct, direct_request(unique_id("direct"), logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    )
    assert reference.error is None, reference.error
    outputs = [m.outputs for m in reference.messages if m.HasField("outputs") and m.outputs.num_tokens]

    dicts = [c.to_dict() for c in chunks]
    assert [d["token_ids"] for d in dicts] == [list(o.token_ids) for o in outputs]
    assert "".join(d.get("text", "") for d in dicts) == "".join(o.text for o in outputs)
    final = dicts[-1]
    assert final["finish_reason"] == "length"
    assert final["completion_usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert all("finish_reason" not in d for d in dicts[:-1])
    if logprobs is None:
        assert all("log_probs" not in d and "top_logprobs" not in d for d in dicts)
    else:
        assert [d["log_probs"] for d in dicts] == [list(o.logprobs) for o in outputs]
        if logprobs == 0:
            assert all("top_logprobs" not in d for d in dicts)
        else:
            assert [d["top_logprobs"] for d in dicts] == [expected_top_logprobs(o) for o in outputs]
            assert all(len(position) == logprobs for d in dicts for position in d["top_logprobs"])
    if prompt_logprobs is None:
        assert "engine_data" not in final
    else:
        info = reference.messages[0].prompt_info
        assert final["engine_data"] == {"prompt_logprobs": expected_prompt_logprobs(info)}


async def test_seeded_sampling_through_the_sidecar_matches_a_direct_call(sidecar, direct):
    # Every sampling and penalty field of docs/reference/sidecar.md#field-mapping set; a mis-mapped one changes the tokens.
    sampling = {
        "temperature": 0.8,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.05,
        "seed": 123,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
    }
    chunks = await run(sidecar, greedy(24, sampling_options=sampling), unique_id("seeded"))
    request = direct_request(unique_id("seeded-direct"), max_tokens=24)
    request.temperature = 0.8
    request.sampling.top_k, request.sampling.top_p, request.sampling.min_p = 20, 0.9, 0.05
    request.sampling.seed = 123
    request.decoding.presence_penalty, request.decoding.frequency_penalty = 0.3, 0.2
    request.decoding.repetition_penalty = 1.1
    reference = await collect(direct, request)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference.tokens() and len(tokens) == 24
    # The seed matters (so the comparison above is not trivially true): another seed, other tokens.
    request.request_id, request.sampling.seed = unique_id("other-seed"), 124
    assert (await collect(direct, request)).tokens() != tokens


JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("guided", "field", "value"),
    [
        ({"regex": "(yes|no)[0-9]{3}"}, "regex", "(yes|no)[0-9]{3}"),
        ({"choice": ["alpha", "beta"]}, "choice", ["alpha", "beta"]),
        ({"json": JSON_SCHEMA}, "json", json.dumps(JSON_SCHEMA, separators=(",", ":"))),
    ],
    ids=["regex", "choice", "json"],
)
async def test_guided_decoding_through_the_sidecar_matches_a_direct_call(sidecar, direct, guided, field, value):
    # Without ignore_eos: once the grammar is complete only EOS is allowed, and vLLM stops (STOP). With
    # ignore_eos the model keeps going *unconstrained* after the grammar has ended (seen live).
    request_ = greedy(24, sampling_options={"guided_decoding": guided}, stop_conditions={"ignore_eos": False})
    chunks = await run(sidecar, request_, unique_id("guided"))
    request = direct_request(unique_id("guided-direct"), max_tokens=24)
    request.stopping.ignore_eos = False
    if field == "choice":
        request.decoding.choice.choices.extend(value)
    else:
        setattr(request.decoding, field, value)
    reference = await collect(direct, request)
    assert reference.error is None, reference.error
    text = "".join(c.text or "" for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == reference.tokens()
    assert text == "".join(m.outputs.text for m in reference.messages)
    if field == "regex":
        assert re.fullmatch(value, text) and chunks[-1].finish_reason == "stop"
    elif field == "choice":
        assert text in value and chunks[-1].finish_reason == "stop"
    else:
        assert text.startswith("{")


async def test_stop_token_through_the_sidecar_matches_a_direct_call(sidecar, direct):
    plain = await collect(direct, direct_request(unique_id("plan"), max_tokens=16))
    tokens = plain.tokens()
    stop = tokens[3]
    k = tokens.index(stop)  # the first occurrence ends generation
    chunks = await run(sidecar, greedy(16, stop_conditions={"stop_token_ids": [stop]}), unique_id("stop"))
    reference = await collect(direct, direct_request(unique_id("stop-direct"), max_tokens=16, stop_token_ids=[stop]))
    got = [t for c in chunks for t in c.token_ids]
    assert got == reference.tokens() == tokens[: k + 1]
    final = chunks[-1].to_dict()
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", stop)
    assert reference.terminal().stop_token_id == stop
    assert final["completion_usage"]["completion_tokens"] == k + 1


async def test_dp_rank_routing_reaches_the_server_as_metadata(sidecar, real_server):
    # docs/reference/sidecar.md#data-parallel-rank: routing.dp_rank travels as x-data-parallel-rank; vLLM logs what it received.
    offset = real_server.log_size()
    with_rank, without = unique_id("with-rank"), unique_id("without-rank")
    a = await run(sidecar, dict(greedy(), routing={"dp_rank": 0}), with_rank)
    b = await run(sidecar, greedy(), without)
    assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
    assert real_server.find_in_log(rf"request_id={with_rank} [^\n]*data_parallel_rank=Some\(0\)", offset)
    assert real_server.find_in_log(rf"request_id={without} [^\n]*data_parallel_rank=None", offset)


# Prompts whose greedy continuation contains special tokens (<s>, </s>, <unk>, <pad>) on the tiny model.
SPECIAL_PROMPTS = ([253, 18, 203, 225], [350, 116, 239, 152], [343, 264, 59, 87], [50, 286, 134, 20])


async def test_skip_special_tokens_is_forwarded(sidecar, direct):
    for prompt in SPECIAL_PROMPTS:
        texts = {}
        for skip in (True, False):
            request = direct_request(unique_id("special-direct"), max_tokens=16)
            request.token_ids.ids[:] = prompt
            request.response.skip_special_tokens = skip
            texts[skip] = "".join(m.outputs.text for m in (await collect(direct, request)).messages)
        if texts[True] != texts[False]:
            break
    else:
        pytest.fail("no prompt produced a special token; pick new SPECIAL_PROMPTS for this model")
    for options, expected in (({"skip_special_tokens": False}, texts[False]), ({}, texts[True])):
        request = dict(greedy(16, output_options=options), token_ids=list(prompt))
        chunks = await run(sidecar, request, unique_id("special"))
        assert "".join(c.text or "" for c in chunks) == expected, options


# -- cancellation --------------------------------------------------------------------------------------------
#
# On a loaded 2-core machine the server can produce a whole 252-token stream before a cancellation lands
# (docs/reference/real-vllm.md#abort-and-cancellation), so each test retries with a fresh request id when the server logged a normal completion
# (``race_attempts``).
# The sidecar's follow-up Control.Abort (abort_on_cancel) can also win the race against the reset and end
# the request silently, so the tests that prove the reset path by the auto-abort log line turn it off.


async def stop_the_first_to_stream(sidecar, ids: tuple[str, str]) -> tuple[str | None, dict[str, list]]:
    """Run two LONG requests together; stop the first one that shows a chunk while the other is unfinished.
    Returns that request's id (None when both arrived whole) and every request's chunks."""
    contexts = {rid: GenerateContext(rid) for rid in ids}
    chunks: dict[str, list] = {rid: [] for rid in ids}
    victim: list[str] = []

    async def request(rid: str, other: str) -> None:
        async with sidecar.generate(greedy(LONG), contexts[rid]) as stream:
            async for chunk in stream:
                chunks[rid].append(chunk)
                other_unfinished = not any(c.finish_reason for c in chunks[other])
                if not victim and other_unfinished and not chunk.finish_reason:
                    victim.append(rid)
                    contexts[rid].stop()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, ids[0], ids[1])
        nursery.start_soon(request, ids[1], ids[0])
    return (victim[0] if victim else None), chunks


async def test_stopping_a_request_aborts_it_on_the_server_and_spares_a_concurrent_one(direct, real_server):
    # vLLM streams some requests and delivers others in one burst at their end
    # (docs/reference/real-vllm.md#abort-and-cancellation). Two requests start together; the first to show a
    # chunk while the other is still unfinished is stopped (the victim), the other is the bystander. That the
    # bystander was in flight when the victim was aborted is read from the server's log order.
    reference = (await collect(direct, direct_request(unique_id("ref"), max_tokens=LONG))).tokens()
    assert len(reference) == LONG
    attempts: list[tuple[str, bool]] = []
    async with open_sidecar(sidecar_config(real_server, abort_on_cancel=False)) as sidecar:
        for attempt in race_attempts():
            await trio.sleep(0.2 if attempt else 0)
            offset = real_server.log_size()
            ids = (unique_id("first"), unique_id("second"))
            with trio.fail_after(120):
                victim, chunks = await stop_the_first_to_stream(sidecar, ids)
            if not victim:
                attempts.append(("both delivered at once", False))
                continue
            victim_id: str = victim
            bystander_id = ids[1] if victim_id == ids[0] else ids[0]
            victim_chunks, bystander_chunks = chunks[victim_id], chunks[bystander_id]
            outcome = await drop_outcome(real_server, victim_id, offset=offset)
            log = real_server.log_since(offset)
            abort_at = re.search(auto_abort_pattern(victim_id), log)
            bystander_closed_at = re.search(closed_pattern(bystander_id), log)
            spared = bool(abort_at and bystander_closed_at and abort_at.start() < bystander_closed_at.start())
            attempts.append((outcome, spared))
            if outcome == "aborted" and spared:
                break
        else:
            pytest.fail(
                "could not cancel a request while another was in flight (every attempt raced); "
                f"(outcome, aborted before the bystander closed) per attempt: {attempts}"
            )
        last = victim_chunks[-1].to_dict()
        streamed = sum(len(c.token_ids) for c in victim_chunks)
        # Like every non-prefill chunk it carries text: "" or what vLLM's detokenizer flushed with the
        # ABORTED terminal (pending partial UTF-8 as U+FFFD; docs/conformance.md "What differs").
        text = last.pop("text")
        assert isinstance(text, str) and set(text) <= {"\ufffd"}, text
        assert last == {
            "token_ids": [],
            "index": 0,
            "finish_reason": "cancelled",
            "completion_usage": {"prompt_tokens": 4, "completion_tokens": streamed, "total_tokens": 4 + streamed},
        }
        assert streamed < LONG
        # The concurrent request was not disturbed: all its tokens, in order, and a normal finish.
        assert [t for c in bystander_chunks for t in c.token_ids] == reference
        assert bystander_chunks[-1].finish_reason == "length"
        assert sidecar.engine.aborts_queued == 0


async def test_leaving_the_generate_block_early_aborts_the_request(real_server):
    async with open_sidecar(sidecar_config(real_server, abort_on_cancel=False)) as sidecar:
        for attempt in race_attempts():
            await trio.sleep(0.2 if attempt else 0)
            request_id = unique_id("leave")
            offset = real_server.log_size()
            with trio.fail_after(60):
                async with sidecar.generate(greedy(LONG), GenerateContext(request_id)) as stream:
                    async for _chunk in stream:
                        break
            if await drop_outcome(real_server, request_id, offset=offset) == "aborted":
                return
    pytest.fail("every stream finished before the sidecar dropped it")


async def test_the_follow_up_abort_reaches_the_server_and_is_harmless(sidecar, real_server):
    """With abort_on_cancel (default) a cancelled request is also sent Control.Abort (docs/reference/sidecar.md#abort-after-abandoning-a-stream)."""
    for attempt in race_attempts():
        await trio.sleep(0.2 if attempt else 0)
        request_id = unique_id("abort-after-cancel")
        offset = real_server.log_size()
        sent_before = sidecar.engine.aborts_sent
        ctx = GenerateContext(request_id)
        with trio.fail_after(60):
            async with sidecar.generate(greedy(LONG), ctx) as stream:
                chunks = []
                async for chunk in stream:
                    chunks.append(chunk)
                    ctx.stop()
        if chunks[-1].finish_reason != "cancelled":
            continue  # the server finished first: nothing to abort
        with trio.fail_after(30):
            while sidecar.engine.aborts_sent == sent_before:
                await trio.sleep(0.05)
        await trio.sleep(1.0)
        if not real_server.find_in_log(rf"request_id={re.escape(request_id)} [^\n]*stream closed", offset):
            break  # ended by the reset or by the Abort, never ran to completion
    else:
        pytest.fail("every request finished before it could be cancelled")
    assert sidecar.health.value.kind is HealthKind.SERVING
    assert len([t for c in await run(sidecar, greedy(), unique_id("after")) for t in c.token_ids]) == 8


async def test_control_abort_ends_a_sidecar_stream_with_a_cancelled_chunk(sidecar, direct):
    for attempt in race_attempts():
        await trio.sleep(0.2 if attempt else 0)
        request_id = unique_id("abort-via-control")
        chunks = []
        with trio.fail_after(60):
            async with sidecar.generate(greedy(LONG), GenerateContext(request_id)) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        await direct.unary_unary(
                            "/vllm.Control/Abort",
                            control_pb2.AbortRequest(request_ids=[request_id]),
                            control_pb2.AbortResponse,
                            timeout=30,
                        )
        if chunks[-1].finish_reason == "cancelled":
            break
    else:
        pytest.fail("every stream finished before its Abort arrived")
    streamed = sum(len(c.token_ids) for c in chunks)
    assert streamed < LONG
    # The real ABORTED terminal (no tokens, num_output_tokens = tokens sent) converts to the cancelled chunk.
    # It may carry text: vLLM flushes the detokenizer's pending partial UTF-8 (as U+FFFD) on the terminal.
    final = chunks[-1].to_dict()
    final.pop("text", None)
    assert final == {
        "token_ids": [],
        "index": 0,
        "finish_reason": "cancelled",
        "completion_usage": {"prompt_tokens": 4, "completion_tokens": streamed, "total_tokens": 4 + streamed},
    }


# -- error mapping -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            dict(greedy(), routing={"dp_rank": 3}),
            "GenerateStream: engine-core error: data parallel rank 3 is not connected to this frontend; "
            "connected ranks: [0] (InvalidArgument)",
        ),
        (
            dict(greedy(), token_ids=[5] * 300),
            "GenerateStream: this model's maximum context length is 256 tokens, but the prompt contains 300 "
            "input tokens (InvalidArgument)",
        ),
        (
            dict(greedy(), token_ids=[5] * 256),
            "GenerateStream: this model's maximum context length is 256 tokens, but the prompt contains 256 "
            "input tokens (InvalidArgument)",
        ),
    ],
    ids=["dp-rank-3", "prompt-300", "prompt-256"],
)
async def test_server_rejections_become_typed_errors_with_the_server_text(sidecar, request_, message):
    with trio.fail_after(60):
        with pytest.raises(InvalidArgument) as info:
            async with sidecar.generate(request_, GenerateContext(unique_id("rejected"))):
                pytest.fail("the open should have failed")  # pragma: no cover
    assert str(info.value) == message
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT
    # The sidecar keeps serving.
    assert len([t for c in await run(sidecar, greedy(), unique_id("after")) for t in c.token_ids]) == 8


async def test_wrong_model_from_a_direct_client_maps_to_invalid_argument(direct):
    # The sidecar always sends the discovered name (docs/reference/real-vllm.md#abort-and-cancellation), so a direct client provokes it.
    out = await collect(
        direct,
        direct_request(unique_id("wrong")).__class__(
            request_id=unique_id("wrong"), model="not-tiny", token_ids=inference_pb2.TokenIds(ids=PROMPT)
        ),
    )
    assert out.error is not None
    error = status_to_error("GenerateStream", out.error.code, out.error.message)
    assert isinstance(error, InvalidArgument)
    assert str(error) == "GenerateStream: model `not-tiny` not found (NotFound)"


async def test_prefill_mode_against_an_engine_without_a_kv_connector_is_a_protocol_error(real_server):
    # vLLM without --kv-transfer-config ignores do_remote_decode and returns no kv_transfer_params; the
    # sidecar must say so instead of handing an empty handoff to the decode worker (docs/reference/sidecar.md#per-message-checks item 5).
    config = sidecar_config(real_server, disaggregation_mode="prefill")
    with trio.fail_after(60):
        async with open_sidecar(config) as sidecar:
            with pytest.raises(ProtocolError) as info:
                await run(sidecar, greedy(), unique_id("prefill"))
    assert str(info.value) == "invalid vLLM gRPC response: prefill terminal is missing kv_transfer_params"


async def test_lora_selection_is_rejected_locally_and_never_reaches_the_server(sidecar, real_server):
    request_id = unique_id("lora")
    with pytest.raises(InvalidArgument) as info:
        async with sidecar.generate(dict(greedy(), routing={"lora_name": "adapter"}), GenerateContext(request_id)):
            pytest.fail("conversion should have failed")  # pragma: no cover
    assert str(info.value) == "LoRA request selection is not supported by vLLM gRPC"
    await trio.sleep(0.5)
    assert not re.search(re.escape(request_id), real_server.log_text())
