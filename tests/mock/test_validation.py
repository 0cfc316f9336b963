"""The mock's pure request model: docs/reference/mock.md#request-validation order, docs/reference/mock.md#prefill-and-decode-emulation handoff classification, docs/reference/mock.md#multimodal media (table-driven)."""

from __future__ import annotations

import blake3
import pytest
from google.protobuf import struct_pb2

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode as C
from trio_sidecar.mock.generation import RequestRejected, planned_tokens
from trio_sidecar.mock.handoff import (
    Role,
    check_role,
    classify_kv_transfer_params,
    prefill_terminal_params,
)
from trio_sidecar.mock.kvcache import MmSpan
from trio_sidecar.mock.multimodal import check_media, expand_image_placeholders
from trio_sidecar.mock.validation import RequestPolicy, format_f32, parse_dp_rank, prepare_request

FinishReason = pb.FinishInfo.FinishReason
POLICY = RequestPolicy(served_model_name="mocker-model")


def gen(**kw) -> pb.GenerateRequest:
    kw.setdefault("request_id", "r")
    kw.setdefault("token_ids", pb.TokenIds(ids=[1, 2, 3, 4]))
    return pb.GenerateRequest(**kw)


def struct(d: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


def rejected(fn, *args, **kw) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        fn(*args, **kw)
    return info.value


@pytest.mark.parametrize(
    ("metadata", "dp_size", "expected"),
    [((), 1, None), ((("x-data-parallel-rank", "0"),), 1, 0), ((("x-data-parallel-rank", " 1 "),), 2, 1)],
)
def test_dp_rank_metadata_accepted(metadata, dp_size, expected):
    assert parse_dp_rank(metadata, dp_size) == expected


@pytest.mark.parametrize(
    ("value", "dp_size", "message"),
    [
        ("abc", 1, "x-data-parallel-rank metadata must be an unsigned 32-bit integer"),
        ("-1", 1, "x-data-parallel-rank metadata must be an unsigned 32-bit integer"),
        ("4294967296", 1, "x-data-parallel-rank metadata must be an unsigned 32-bit integer"),
        (
            "3",
            1,
            "engine-core error: data parallel rank 3 is not connected to this frontend; connected ranks: [0]",
        ),
        (
            "2",
            2,
            "engine-core error: data parallel rank 2 is not connected to this frontend; connected ranks: [0, 1]",
        ),
    ],
)
def test_dp_rank_metadata_rejected(value, dp_size, message):
    err = rejected(parse_dp_rank, (("x-data-parallel-rank", value),), dp_size)
    assert (err.code, err.message) == (C.INVALID_ARGUMENT, message)


BAD_REQUESTS = [
    (gen(model="other"), C.NOT_FOUND, "model `other` not found"),
    (pb.GenerateRequest(request_id="r", text="hi"), C.UNIMPLEMENTED, "token_ids"),
    (pb.GenerateRequest(request_id="r"), C.INVALID_ARGUMENT, "prompt is required"),
    (gen(token_ids=pb.TokenIds()), C.INVALID_ARGUMENT, "token_ids must not be empty"),
    (gen(lora_name="a"), C.FAILED_PRECONDITION, "engine was not started with LoRA enabled"),
    (
        gen(media=[pb.MediaItem(modality=pb.MODALITY_IMAGE, url="http://x")]),
        C.INVALID_ARGUMENT,
        "multimodal input is not supported by this mock server; start it with --supports-multimodal",
    ),
    (gen(sampling=pb.RandomSampling(num_sequences=2)), C.INVALID_ARGUMENT, "num_sequences must be 0 or 1"),
    (gen(sampling=pb.RandomSampling(top_p=2)), C.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2"),
    (gen(sampling=pb.RandomSampling(top_p=-0.5)), C.INVALID_ARGUMENT, "top_p must be in (0, 1], got -0.5"),
    (gen(stopping=pb.StoppingCriteria(stop_strings=["a", ""])), C.INVALID_ARGUMENT, "stop strings cannot be empty"),
    (
        gen(kv=pb.KVCacheParameters(kv_transfer_params=struct({"do_remote_decode": True}))),
        C.FAILED_PRECONDITION,
        "aggregated mock server received disaggregated KV transfer parameters",
    ),
    (
        gen(stopping=pb.StoppingCriteria(max_new_tokens=32769)),
        C.INVALID_ARGUMENT,
        "max_new_tokens must not exceed 32768",
    ),
    (
        gen(stopping=pb.StoppingCriteria(max_new_tokens=1, min_new_tokens=2)),
        C.INVALID_ARGUMENT,
        "min_new_tokens (2) must not exceed effective max_new_tokens (1)",
    ),
    (
        gen(stopping=pb.StoppingCriteria(min_new_tokens=21)),
        C.INVALID_ARGUMENT,
        "min_new_tokens (21) must not exceed effective max_new_tokens (20)",
    ),
]


@pytest.mark.parametrize(("request_", "code", "text"), BAD_REQUESTS)
def test_bad_requests_get_the_spec_status(request_, code, text):
    err = rejected(prepare_request, request_, POLICY)
    assert err.code == code
    assert text in err.message


def test_first_failing_row_wins():
    # Wrong model (row 4) beats text prompt (row 5), which beats lora (row 8) and n > 1 (row 11).
    req = pb.GenerateRequest(model="x", text="t", lora_name="l", sampling=pb.RandomSampling(num_sequences=3))
    assert rejected(prepare_request, req, POLICY).code == C.NOT_FOUND
    req.model = ""
    assert rejected(prepare_request, req, POLICY).code == C.UNIMPLEMENTED
    req.token_ids.ids.append(1)
    assert rejected(prepare_request, req, POLICY).code == C.FAILED_PRECONDITION
    req.lora_name = ""
    assert rejected(prepare_request, req, POLICY).message == "num_sequences must be 0 or 1"


def test_empty_model_and_served_name_accepted():
    assert prepare_request(gen(model=""), POLICY).prompt == (1, 2, 3, 4)
    assert prepare_request(gen(model="mocker-model"), POLICY).prompt == (1, 2, 3, 4)


def test_defaults_and_min_max():
    prepared = prepare_request(gen(request_id="stable"), POLICY)
    assert prepared.plan.tokens == tuple(planned_tokens(42, "stable", 20))
    assert prepared.uuid == "df0aafa1-cb31-44d6-a837-9077669d9491"
    assert len(prepare_request(gen(stopping=pb.StoppingCriteria(min_new_tokens=20)), POLICY).plan.tokens) == 20
    assert prepare_request(gen(stopping=pb.StoppingCriteria(max_new_tokens=32768)), POLICY).plan.tokens


def test_empty_request_id_gets_a_fresh_id():
    prepared = prepare_request(gen(request_id=""), POLICY, new_request_id=lambda: "fresh")
    assert prepared.request_id == "fresh"


def test_truncation_keeps_the_last_tokens():
    prepared = prepare_request(gen(truncate_prompt_tokens=2), POLICY)
    assert prepared.prompt == (3, 4)
    assert prepare_request(gen(truncate_prompt_tokens=10), POLICY).prompt == (1, 2, 3, 4)


def test_context_limit_caps_and_rejects():
    policy = RequestPolicy(served_model_name="m", max_model_len=8)
    capped = prepare_request(gen(), policy)
    assert len(capped.plan.tokens) == 4 and capped.plan.finish_reason == FinishReason.LENGTH
    err = rejected(prepare_request, gen(stopping=pb.StoppingCriteria(min_new_tokens=5)), policy)
    assert "effective max_new_tokens (4)" in err.message
    err = rejected(prepare_request, gen(token_ids=pb.TokenIds(ids=list(range(8)))), policy)
    assert err.message == "this model's maximum context length is 8 tokens, but the prompt contains 8 input tokens"


def test_chunked_prefill_off_budget():
    policy = RequestPolicy(served_model_name="m", max_num_batched_tokens=3, enable_chunked_prefill=False)
    err = rejected(prepare_request, gen(), policy)
    assert err.message == "prompt of 4 tokens exceeds max_num_batched_tokens 3 with chunked prefill disabled"
    assert prepare_request(gen(), RequestPolicy(served_model_name="m", max_num_batched_tokens=3)).prompt


def test_stop_tokens_through_prepare():
    k = 3
    stop = planned_tokens(42, "s", 10)[k]
    prepared = prepare_request(
        gen(request_id="s", stopping=pb.StoppingCriteria(max_new_tokens=10, stop_token_ids=[stop])), POLICY
    )
    assert len(prepared.plan.tokens) == k + 1 and prepared.plan.stop_token_id == stop
    masked = prepare_request(
        gen(
            request_id="s", stopping=pb.StoppingCriteria(max_new_tokens=10, min_new_tokens=k + 1, stop_token_ids=[stop])
        ),
        POLICY,
    )
    tokens = planned_tokens(42, "s", 10)
    later = [p for p in range(k + 1, 10) if tokens[p] == stop]
    assert masked.plan.tokens == tuple(tokens[: later[0] + 1] if later else tokens)


def test_prompt_seed_source_makes_ids_irrelevant():
    policy = RequestPolicy(served_model_name="m", token_seed_source="prompt")
    a = prepare_request(gen(request_id="a"), policy)
    b = prepare_request(gen(request_id="b"), policy)
    assert a.plan.tokens == b.plan.tokens and a.uuid != b.uuid
    assert (
        prepare_request(gen(request_id="a"), POLICY).plan.tokens
        != prepare_request(gen(request_id="b"), POLICY).plan.tokens
    )


def test_cache_options_are_accepted():
    prepared = prepare_request(gen(kv=pb.KVCacheParameters(cache_salt="s", bypass_prefix_cache=True)), POLICY)
    assert prepared.cache_salt == "s" and prepared.bypass_prefix_cache


# --- handoff (docs/reference/mock.md#prefill-and-decode-emulation) ---------------------------------------------------------------------------------------

DECODE_OK = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "e",
    "remote_host": "127.0.0.1",
    "remote_port": 0,
    "remote_block_ids": [0, 1],
    "mocker_request_id": "r",
}


@pytest.mark.parametrize(
    ("params", "role"),
    [
        (None, Role.AGGREGATED),
        ({}, Role.AGGREGATED),
        ({"do_remote_decode": False, "do_remote_prefill": False}, Role.AGGREGATED),
        ({"do_remote_decode": True}, Role.PREFILL),
        (DECODE_OK, Role.DECODE),
        ({**DECODE_OK, "remote_port": "5600"}, Role.DECODE),
        ({**DECODE_OK, "remote_block_ids": []}, Role.DECODE),
    ],
)
def test_handoff_classification(params, role):
    assert classify_kv_transfer_params(None if params is None else struct(params)) is role


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"do_remote_decode": "yes"}, "KV transfer field 'do_remote_decode' must be a boolean"),
        ({"do_remote_prefill": 1}, "KV transfer field 'do_remote_prefill' must be a boolean"),
        (
            {"do_remote_decode": True, "do_remote_prefill": True},
            "KV transfer parameters cannot set both do_remote_decode and do_remote_prefill",
        ),
        *[
            (
                {"do_remote_decode": True, key: DECODE_OK[key]},
                f"prefill KV transfer parameters must not include '{key}'",
            )
            for key in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
        ],
        (
            {**DECODE_OK, "remote_engine_id": 5},
            "decode KV transfer field 'remote_engine_id' must be a non-empty string",
        ),
        ({**DECODE_OK, "remote_host": ""}, "decode KV transfer field 'remote_host' must be a non-empty string"),
        (
            {**DECODE_OK, "remote_port": 70000},
            "decode KV transfer field 'remote_port' must be a port number (0..65535) or a decimal string",
        ),
        (
            {**DECODE_OK, "remote_port": "x1"},
            "decode KV transfer field 'remote_port' must be a port number (0..65535) or a decimal string",
        ),
        (
            {**DECODE_OK, "remote_block_ids": [1.5]},
            "decode KV transfer field 'remote_block_ids' must be a list of non-negative integers",
        ),
        (
            {**DECODE_OK, "remote_block_ids": [-1]},
            "decode KV transfer field 'remote_block_ids' must be a list of non-negative integers",
        ),
        (
            {k: v for k, v in DECODE_OK.items() if k != "mocker_request_id"},
            "decode KV transfer field 'mocker_request_id' must be a non-empty string",
        ),
        ({"remote_host": "h"}, "KV rendezvous fields require do_remote_prefill=true"),
    ],
)
def test_handoff_rejections(params, message):
    err = rejected(classify_kv_transfer_params, struct(params))
    assert (err.code, err.message) == (C.INVALID_ARGUMENT, message)


@pytest.mark.parametrize(
    ("mode", "role", "message"),
    [
        (Role.AGGREGATED, Role.PREFILL, "aggregated mock server received disaggregated KV transfer parameters"),
        (Role.PREFILL, Role.AGGREGATED, "prefill mock server requires do_remote_decode=true"),
        (Role.DECODE, Role.AGGREGATED, "decode mock server requires a prefill KV transfer payload"),
        (Role.DECODE, Role.PREFILL, "decode mock server requires a prefill KV transfer payload"),
    ],
)
def test_role_mismatch(mode, role, message):
    err = rejected(check_role, mode, role)
    assert (err.code, err.message) == (C.FAILED_PRECONDITION, message)
    check_role(role, role)


def test_prefill_terminal_params_round_trip_into_a_decode_request():
    params = prefill_terminal_params("u-1", "req", 130)
    assert params["remote_block_ids"] == [0, 1, 2]  # ceil(130 / 64)
    assert params["remote_engine_id"] == "mocker-prefill-u-1"
    assert params["mocker_request_id"] == "req" and params["remote_port"] == 0
    assert classify_kv_transfer_params(params) is Role.DECODE
    decode = RequestPolicy(served_model_name="m", mode=Role.DECODE)
    assert prepare_request(gen(kv=pb.KVCacheParameters(kv_transfer_params=params)), decode).role is Role.DECODE


def test_mode_parse():
    assert Role.parse("agg") is Role.AGGREGATED and Role.parse("Prefill") is Role.PREFILL
    assert Role.parse("encode") is Role.ENCODE
    with pytest.raises(ValueError):
        Role.parse("both")


# --- multimodal (docs/reference/mock.md#multimodal) ----------------------------------------------------------------


def test_media_checks():
    check_media([], False)
    check_media([pb.MediaItem(modality=pb.MODALITY_IMAGE, data_uri="data:image/png;base64,AA==")], True)
    check_media([pb.MediaItem(modality=pb.MODALITY_IMAGE, raw_bytes=b"\x89PNG")], True)
    check_media([pb.MediaItem(modality=pb.MODALITY_VIDEO, url="http://v.mp4")], True)
    assert rejected(check_media, [pb.MediaItem(modality=pb.MODALITY_AUDIO, url="http://a")], True).message == (
        "only image and video media are supported by the mock server"
    )
    assert (
        rejected(check_media, [pb.MediaItem(modality=pb.MODALITY_IMAGE)], True).message == "media item 0 has no source"
    )
    items = [pb.MediaItem(modality=pb.MODALITY_IMAGE, url="u"), pb.MediaItem(modality=pb.MODALITY_IMAGE, url="")]
    assert rejected(check_media, items, True).message == "media item 1 has no source"


def test_placeholder_expansion():
    assert expand_image_placeholders([5, 9, 6], 1, 9, 3) == (5, 9, 9, 9, 6)
    assert expand_image_placeholders([5, 9, 9], 0, 9, 3) == (5, 9, 9)
    err = rejected(expand_image_placeholders, [5, 6], 1, 9, 3)
    assert (err.code, err.message) == (C.INVALID_ARGUMENT, "expected 1 image placeholders in token_ids, found 0")


def test_multimodal_request_prompt_is_expanded():
    policy = RequestPolicy(served_model_name="m", supports_multimodal=True)
    req = gen(
        token_ids=pb.TokenIds(ids=[1, 31999, 2]), media=[pb.MediaItem(modality=pb.MODALITY_IMAGE, url="http://x")]
    )
    assert prepare_request(req, policy).prompt == (1, *[31999] * 16, 2)


def test_each_expanded_image_is_a_feature_keyed_by_its_uuid_or_the_digest_of_its_source():
    policy = RequestPolicy(served_model_name="m", supports_multimodal=True, tokens_per_image=3)
    uuid = "f8a38c4266c6e1eb" + "0" * 48
    media = [
        pb.MediaItem(modality=pb.MODALITY_IMAGE, url="http://x", uuid=uuid),
        pb.MediaItem(modality=pb.MODALITY_IMAGE, data_uri="data:image/png;base64,AA=="),
    ]
    prepared = prepare_request(gen(token_ids=pb.TokenIds(ids=[1, 31999, 2, 31999]), media=media), policy)
    assert prepared.prompt == (1, 31999, 31999, 31999, 2, 31999, 31999, 31999)
    digest = blake3.blake3(b"data:image/png;base64,AA==").hexdigest()
    assert prepared.mm_spans == (MmSpan(1, 3, uuid), MmSpan(5, 3, digest))
    assert prepare_request(gen(token_ids=pb.TokenIds(ids=[1, 2])), policy).mm_spans == ()


@pytest.mark.parametrize(("value", "text"), [(2.0, "2"), (1.5, "1.5"), (1.1, "1.1"), (float("nan"), "NaN")])
def test_format_f32_like_rust(value, text):
    assert format_f32(value) == text
