"""Request conversion (docs/reference/sidecar.md#request-conversion, docs/reference/sidecar.md#json-and-protobuf-struct, docs/reference/sidecar.md#data-parallel-rank): validation order, mapping, extra_args, kv params."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from trio_sidecar._proto.vllm import inference_pb2
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import build_generate_request
from trio_sidecar.core.errors import InvalidArgument
from trio_sidecar.core.jsonstruct import struct_to_json
from trio_sidecar.core.protocol import PreprocessedRequest, RoutingHints, structure_request

AGG, PREFILL, DECODE, ENCODE = (
    DisaggregationMode.AGG,
    DisaggregationMode.PREFILL,
    DisaggregationMode.DECODE,
    DisaggregationMode.ENCODE,
)


def build(req: dict[str, Any], mode: DisaggregationMode = AGG, request_id: str = "req-1"):
    return build_generate_request(structure_request(req), request_id, "served-model", mode)


def rejects(req: dict[str, Any], message: str, mode: DisaggregationMode = AGG) -> None:
    with pytest.raises(InvalidArgument) as info:
        build(req, mode)
    assert str(info.value) == message


BASE: dict[str, Any] = {"token_ids": [1, 2, 3]}


def with_(**kw: Any) -> dict[str, Any]:
    req = copy.deepcopy(BASE)
    for key, value in kw.items():
        if isinstance(value, dict) and isinstance(req.get(key), dict):
            req[key].update(value)
        else:
            req[key] = value
    return req


# ---------------------------------------------------------------- reference mapping (docs/reference/sidecar.md#reference-example)

REFERENCE = {
    "token_ids": [1, 2, 3],
    "mdc_sum": "b8b02fab",
    "sampling_options": {
        "top_k": 4,
        "top_p": 0.9,
        "min_p": 0.1,
        "seed": 123,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.1,
        "include_stop_str_in_output": True,
        "guided_decoding": {"json": {"type": "object", "properties": {"a": {"type": "string"}}}},
    },
    "stop_conditions": {"max_tokens": 1, "min_tokens": 1, "stop": ["done"], "ignore_eos": True},
    "output_options": {"logprobs": 1, "prompt_logprobs": 1},
    "extra_args": {"bypass_prefix_cache": True, "kv_transfer_params": {"connector_data": {"values": [1, True, None]}}},
}


def test_reference_aggregated_mapping() -> None:
    built = build(REFERENCE)
    m = built.message
    assert m.request_id == "req-1" and m.model == "served-model"
    assert m.WhichOneof("prompt") == "token_ids" and list(m.token_ids.ids) == [1, 2, 3]
    assert m.priority == 0 and not m.HasField("temperature")
    assert m.sampling.num_sequences == 1 and m.sampling.top_k == 4
    assert m.sampling.top_p == pytest.approx(0.9) and m.sampling.min_p == pytest.approx(0.1)
    assert m.sampling.HasField("seed") and m.sampling.seed == 123
    d = m.decoding
    assert (d.presence_penalty, d.frequency_penalty, d.repetition_penalty) == pytest.approx((0.3, 0.4, 1.1))
    assert d.WhichOneof("structured_output") == "json"
    assert d.json == '{"type":"object","properties":{"a":{"type":"string"}}}'
    assert len(d.logit_bias) == 0 and len(d.allowed_token_ids) == 0
    s = m.stopping
    assert (s.max_new_tokens, s.min_new_tokens) == (1, 1)
    assert list(s.stop_strings) == ["done"] and s.include_stop_strings and s.ignore_eos
    r = m.response
    assert r.prompt_token_ids and r.prompt_logprobs and r.prompt_candidates.top_n == 1
    assert r.HasField("output_text") and r.output_text and r.output_token_ids and r.output_logprobs
    assert r.HasField("output_candidates") and r.output_candidates.top_n == 1
    assert not r.HasField("skip_special_tokens")
    assert m.kv.bypass_prefix_cache is True
    assert m.kv.cache_salt == ""  # mdc_sum is never a salt
    assert struct_to_json(m.kv.kv_transfer_params) == {"connector_data": {"values": [1, True, None]}}
    assert not m.kv.HasField("ec_transfer_params")
    assert m.truncate_prompt_tokens == 0 and not m.HasField("session_id")
    assert len(m.media) == 0 and m.lora_name == ""
    assert built.metadata == () and built.dp_rank is None
    assert built.prompt_tokens == 3 and built.has_media is False


def test_minimal_request_defaults() -> None:
    m = build(BASE).message
    assert m.sampling.top_k == 0 and m.sampling.top_p == 0.0 and m.sampling.min_p == 0.0
    assert not m.sampling.HasField("seed")
    assert m.decoding.WhichOneof("structured_output") is None
    assert (m.stopping.max_new_tokens, m.stopping.min_new_tokens) == (0, 0)
    assert list(m.stopping.stop_strings) == [] and list(m.stopping.stop_token_ids) == []
    assert not m.response.prompt_token_ids and not m.response.prompt_logprobs
    assert not m.response.HasField("prompt_candidates") and not m.response.HasField("output_candidates")
    assert not m.response.output_logprobs and m.response.output_text and m.response.output_token_ids
    assert m.HasField("kv") and not m.kv.HasField("kv_transfer_params")
    assert m.kv.bypass_prefix_cache is False and m.kv.cache_salt == ""


def test_temperature_forwarded_only_when_present() -> None:
    assert not build(BASE).message.HasField("temperature")
    m = build(with_(sampling_options={"temperature": 0.0})).message
    assert m.HasField("temperature") and m.temperature == 0.0
    assert build(with_(sampling_options={"temperature": 0.7})).message.temperature == pytest.approx(0.7)


def test_empty_request_id_gets_a_uuid() -> None:
    m = build(BASE, request_id="").message
    assert len(m.request_id) == 36 and m.request_id.count("-") == 4


def test_stop_token_ids_union_sorted_dedup() -> None:
    m = build(with_(stop_conditions={"stop_token_ids": [9, 2, 9], "stop_token_ids_hidden": [5, 2]})).message
    assert list(m.stopping.stop_token_ids) == [2, 5, 9]


def test_priority_passthrough() -> None:
    assert build(with_(routing={"priority": -7})).message.priority == -7


def test_max_tokens_passthrough() -> None:
    m = build(with_(stop_conditions={"max_tokens": 7, "min_tokens": 2})).message
    assert (m.stopping.max_new_tokens, m.stopping.min_new_tokens) == (7, 2)


@pytest.mark.parametrize(("value", "expected"), [(None, None), (True, True), (False, False)])
def test_skip_special_tokens(value: bool | None, expected: bool | None) -> None:
    m = build(with_(output_options={"skip_special_tokens": value})).message
    if expected is None:
        assert not m.response.HasField("skip_special_tokens")
    else:
        assert m.response.HasField("skip_special_tokens") and m.response.skip_special_tokens is expected


def test_logprobs_zero_requests_logprobs_without_candidates_count() -> None:
    r = build(with_(output_options={"logprobs": 0})).message.response
    assert r.output_logprobs and r.HasField("output_candidates") and r.output_candidates.top_n == 0


# ---------------------------------------------------------------- validation (docs/reference/sidecar.md#validation-order)

UNSUPPORTED = [
    (with_(token_ids=[]), "token_ids must not be empty"),
    ({}, "token_ids must not be empty"),
    (with_(prompt_embeds="AAAA"), "prompt embeddings are not supported by vLLM gRPC"),
    (with_(mm_processor_kwargs={}), "mm_processor_kwargs are not supported by vLLM gRPC"),
    (with_(routing={"lora_name": "adapter"}), "LoRA request selection is not supported by vLLM gRPC"),
    (with_(bootstrap_info={"bootstrap_room": 1}), "Dynamo bootstrap handoff is not supported by the vLLM sidecar"),
    (
        with_(stop_conditions={"stop_token_ids_visible": [2]}),
        "visible stop token IDs are not supported by vLLM gRPC",
    ),
    (with_(stop_conditions={"max_thinking_tokens": 5}), "max_thinking_tokens is not supported by vLLM gRPC"),
    (with_(sampling_options={"n": 2}), "n must be 1"),
    (with_(sampling_options={"best_of": 2}), "best_of must be 1"),
    (with_(sampling_options={"use_beam_search": True}), "beam search is not supported"),
    (with_(sampling_options={"length_penalty": 2.0}), "non-default length_penalty is not supported"),
    (with_(sampling_options={"top_k": -2}), "top_k must be -1, 0, or positive; got -2"),
    (with_(output_options={"logprobs": 2147483648}), "vLLM logprobs request must fit in i32; got 2147483648"),
    (with_(output_options={"prompt_logprobs": 2147483648}), "vLLM logprobs request must fit in i32; got 2147483648"),
]


@pytest.mark.parametrize(("req", "message"), UNSUPPORTED)
def test_unsupported_features_rejected(req: dict, message: str) -> None:
    rejects(req, message)


def test_encode_mode_needs_media() -> None:
    rejects(BASE, "encode requests require multimodal media", ENCODE)


def test_accepted_neutral_values() -> None:
    m = build(
        with_(
            sampling_options={"n": 1, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0 + 1e-7},
            stop_conditions={"stop_token_ids_visible": []},
            routing={"lora_name": ""},
            mm_routing_info={"x": 1},
            output_options={"logprobs": 2147483647},
        )
    ).message
    assert m.response.output_candidates.top_n == 2147483647


def test_validation_order_follows_the_table() -> None:
    everything_wrong = {
        "token_ids": [],
        "prompt_embeds": "x",
        "mm_processor_kwargs": {},
        "routing": {"lora_name": "a"},
        "bootstrap_info": {},
        "stop_conditions": {"stop_token_ids_visible": [1], "max_thinking_tokens": 1},
        "sampling_options": {
            "n": 2,
            "best_of": 2,
            "use_beam_search": True,
            "length_penalty": 2.0,
            "top_k": -5,
            "guided_decoding": {"backend": "xgrammar"},
        },
        "output_options": {"logprobs": 2**31},
        "extra_args": {"unknown": 1},
        "multi_modal_data": {"pdf_url": ["https://x/a.pdf"]},
    }
    order = [
        "token_ids must not be empty",
        "prompt embeddings are not supported by vLLM gRPC",
        "mm_processor_kwargs are not supported by vLLM gRPC",
        "encode requests support image and video media only",
        "LoRA request selection is not supported by vLLM gRPC",
        "Dynamo bootstrap handoff is not supported by the vLLM sidecar",
        "visible stop token IDs are not supported by vLLM gRPC",
        "max_thinking_tokens is not supported by vLLM gRPC",
        "n must be 1",
        "best_of must be 1",
        "beam search is not supported",
        "non-default length_penalty is not supported",
        "top_k must be -1, 0, or positive; got -5",
        "vLLM logprobs request must fit in i32; got 2147483648",
        "guided decoding backend and whitespace_pattern are not supported by vLLM gRPC",
        "extra_args.unknown is not supported by vLLM gRPC",
    ]
    # Fix the request one problem at a time and check the next message is the next row.
    fixes: list[tuple[str, Any]] = [
        ("token_ids", [1]),
        ("prompt_embeds", None),
        ("mm_processor_kwargs", None),
        ("__mode__", AGG),
        ("routing", {}),
        ("bootstrap_info", None),
        ("stop_conditions.stop_token_ids_visible", None),
        ("stop_conditions.max_thinking_tokens", None),
        ("sampling_options.n", None),
        ("sampling_options.best_of", None),
        ("sampling_options.use_beam_search", None),
        ("sampling_options.length_penalty", None),
        ("sampling_options.top_k", None),
        ("output_options.logprobs", None),
        ("sampling_options.guided_decoding", None),
        ("extra_args", None),
    ]
    req = copy.deepcopy(everything_wrong)
    mode = ENCODE
    assert len(order) == len(fixes)
    for message, (path, value) in zip(order, fixes, strict=True):
        rejects(req, message, mode)
        if path == "__mode__":
            mode = value
        elif "." in path:
            outer, inner = path.split(".")
            req[outer][inner] = value
        else:
            req[path] = value
    rejects(req, "vLLM gRPC does not support media modality `pdf_url`", mode)


def test_length_penalty_epsilon() -> None:
    build(with_(sampling_options={"length_penalty": 1.0 + 1.1920929e-07}))
    rejects(with_(sampling_options={"length_penalty": 1.0 + 2.5e-07}), "non-default length_penalty is not supported")


@pytest.mark.parametrize(("k", "wire"), [(None, 0), (-1, 0), (0, 0), (5, 5), (1, 1)])
def test_top_k_mapping(k: int | None, wire: int) -> None:
    assert build(with_(sampling_options={"top_k": k})).message.sampling.top_k == wire


def test_invalid_request_shape_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match=r"^invalid PreprocessedRequest: .*token_ids"):
        structure_request({"token_ids": "abc"})
    with pytest.raises(InvalidArgument, match=r"^invalid PreprocessedRequest: "):
        structure_request([1, 2])  # type: ignore[arg-type]


def test_an_embedding_request_is_refused_by_name() -> None:
    """Dynamo's embedding request (one token list per input) reaches a worker registered for embeddings."""
    embedding = {"token_ids": [[1, 2], [3]], "model": "m", "encoding_format": None, "dimensions": None}
    with pytest.raises(InvalidArgument, match=r"^embeddings are not supported by vLLM gRPC"):
        structure_request(embedding)
    with pytest.raises(InvalidArgument, match=r"^invalid PreprocessedRequest: "):
        structure_request({"token_ids": [[1], 2]})


def test_unknown_keys_ignored_and_null_is_absent() -> None:
    req = structure_request(
        {
            "token_ids": [1],
            "model": "x",
            "mdc_sum": "y",
            "eos_token_ids": [2],
            "annotations": [],
            "stop_conditions": None,
            "sampling_options": {"n": None, "guided_decoding": None},
            "output_options": None,
            "routing": {"backend_instance_id": 5, "priority_jump": 1},
            "router_config_override": None,
            "_HEALTH_CHECK": True,
        }
    )
    assert isinstance(req, PreprocessedRequest)
    assert build_generate_request(req, "r", "served-model", AGG).message.sampling.top_k == 0


def test_attrs_request_is_revalidated() -> None:
    req = PreprocessedRequest(token_ids=[4, 5], routing=RoutingHints(dp_rank=1))
    again = structure_request(req)
    assert again == req
    built = build_generate_request(again, "r", "m", AGG)
    assert list(built.message.token_ids.ids) == [4, 5] and built.dp_rank == 1
    with pytest.raises(InvalidArgument, match=r"expected an integer \(u32\), got str at index 0 @ \$.token_ids"):
        structure_request(PreprocessedRequest(token_ids=["a"]))  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="token_ids must not be empty"):
        build_generate_request(structure_request(PreprocessedRequest(stop_conditions=None)), "r", "m", AGG)  # type: ignore[arg-type]


# ---------------------------------------------------------------- guided decoding (docs/reference/sidecar.md#guided-decoding)


@pytest.mark.parametrize(
    ("guided", "field", "wire"),
    [
        ({"json": {"b": [1, 2], "a": "é"}}, "json", '{"b":[1,2],"a":"é"}'),
        ({"json": "string schema"}, "json", '"string schema"'),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"grammar": "root ::= x"}, "grammar", "root ::= x"),
        ({"structural_tag": "<tag>"}, "structural_tag", "<tag>"),
        ({"structural_tag": {"type": "tag", "n": 1}}, "structural_tag", '{"type":"tag","n":1}'),
    ],
)
def test_single_constraint(guided: dict, field: str, wire: Any) -> None:
    d = build(with_(sampling_options={"guided_decoding": guided})).message.decoding
    assert d.WhichOneof("structured_output") == field
    if field == "choice":
        assert list(d.choice.choices) == wire
    else:
        assert getattr(d, field) == wire
    assert not d.json_object


@pytest.mark.parametrize(
    "guided",
    [{"json": {}, "regex": "a"}, {"choice": ["a"], "grammar": "g"}, {"regex": "a", "structural_tag": "t"}],
)
def test_two_constraints_rejected(guided: dict) -> None:
    rejects(with_(sampling_options={"guided_decoding": guided}), "only one structured output constraint may be set")


@pytest.mark.parametrize("guided", [{"backend": "xgrammar"}, {"whitespace_pattern": " "}, {"json": {}, "backend": "x"}])
def test_backend_and_whitespace_rejected(guided: dict) -> None:
    rejects(
        with_(sampling_options={"guided_decoding": guided}),
        "guided decoding backend and whitespace_pattern are not supported by vLLM gRPC",
    )


def test_no_constraint_leaves_structured_output_unset() -> None:
    d = build(with_(sampling_options={"guided_decoding": {}})).message.decoding
    assert d.WhichOneof("structured_output") is None


# ---------------------------------------------------------------- extra_args (docs/reference/sidecar.md#extra-args)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "extra_args must be a JSON object"),
        ("x", "extra_args must be a JSON object"),
        ({"unknown": 1}, "extra_args.unknown is not supported by vLLM gRPC"),
        ({"messages": []}, "extra_args.messages is not supported by vLLM gRPC"),
        ({"mm_hashes": ["a"]}, "extra_args.mm_hashes is not supported by vLLM gRPC"),
        ({"bypass_prefix_cache": "yes"}, "extra_args.bypass_prefix_cache must be a boolean"),
        ({"skip_reading_prefix_cache": 1}, "extra_args.skip_reading_prefix_cache must be a boolean"),
        ({"nvext": []}, "extra_args.nvext must be a JSON object"),
        ({"nvext": {"token_in": False}}, "extra_args.nvext.token_in must be true when present"),
        ({"nvext": {"token_in": "true"}}, "extra_args.nvext.token_in must be true when present"),
        ({"nvext": {"cache_salt": ""}}, "extra_args.nvext.cache_salt must be a non-empty string"),
        ({"nvext": {"cache_salt": 5}}, "extra_args.nvext.cache_salt must be a non-empty string"),
        ({"nvext": {"cache_salt": "ns"}}, "extra_args.nvext.cache_salt requires routing.cache_namespace"),
    ],
)
def test_extra_args_rejections(extra: Any, message: str) -> None:
    rejects(with_(extra_args=extra), message)


def test_cache_salt_must_match_namespace() -> None:
    rejects(
        with_(extra_args={"nvext": {"cache_salt": "a"}}, routing={"cache_namespace": "b"}),
        "extra_args.nvext.cache_salt `a` does not match routing.cache_namespace `b`",
    )
    # docs/reference/sidecar.md#extra-args: routing.cache_salt satisfies the check too.
    rejects(
        with_(extra_args={"nvext": {"cache_salt": "a"}}, routing={"cache_salt": "c"}),
        "extra_args.nvext.cache_salt `a` does not match routing.cache_namespace `c`",
    )
    m = build(with_(extra_args={"nvext": {"cache_salt": "c"}}, routing={"cache_salt": "c"})).message
    assert m.kv.cache_salt == "dynamo-cache-salt:c"
    m = build(
        with_(extra_args={"nvext": {"cache_salt": "n", "token_in": True}}, routing={"cache_namespace": "n"})
    ).message
    assert m.kv.cache_salt == "dynamo-cache-salt:n"


def test_other_nvext_keys_ignored() -> None:
    m = build(with_(extra_args={"nvext": {"extra_fields": ["worker_id", "timing"], "anything": {"x": 1}}})).message
    assert m.kv.cache_salt == "" and not m.kv.HasField("kv_transfer_params")


@pytest.mark.parametrize(
    ("extra", "bypass"),
    [
        ({}, False),
        ({"bypass_prefix_cache": True}, True),
        ({"skip_reading_prefix_cache": True}, True),
        ({"bypass_prefix_cache": False, "skip_reading_prefix_cache": True}, False),
        ({"bypass_prefix_cache": True, "skip_reading_prefix_cache": False}, True),
        ({"bypass_prefix_cache": None, "skip_reading_prefix_cache": True}, True),
        ({"skip_reading_prefix_cache": False}, False),
    ],
)
def test_bypass_precedence(extra: dict, bypass: bool) -> None:
    assert build(with_(extra_args=extra)).message.kv.bypass_prefix_cache is bypass


def test_bypass_first_present_key_wins_even_when_the_other_is_invalid() -> None:
    assert (
        build(
            with_(extra_args={"bypass_prefix_cache": False, "skip_reading_prefix_cache": "x"})
        ).message.kv.bypass_prefix_cache
        is False
    )


@pytest.mark.parametrize(
    ("routing", "salt"),
    [
        ({}, ""),
        ({"cache_namespace": "tenant-a"}, "dynamo-cache-salt:tenant-a"),
        ({"cache_salt": "tenant-b"}, "dynamo-cache-salt:tenant-b"),
        ({"cache_namespace": "a", "cache_salt": "b"}, "dynamo-cache-salt:a"),
        ({"cache_namespace": "dynamo-cache-salt:x"}, "dynamo-cache-salt:x"),
    ],
)
def test_cache_salt(routing: dict, salt: str) -> None:
    req = with_(routing=routing, mdc_sum="checksum")
    assert build(req).message.kv.cache_salt == salt


# ---------------------------------------------------------------- kv_transfer_params by mode (docs/reference/sidecar.md#kv-transfer-parameters-by-mode)


def test_prefill_mapping() -> None:
    m = build(with_(stop_conditions={"max_tokens": 50, "min_tokens": 3}), PREFILL).message
    assert (m.stopping.max_new_tokens, m.stopping.min_new_tokens) == (1, 1)
    assert struct_to_json(m.kv.kv_transfer_params) == {"do_remote_decode": True}
    m = build(with_(extra_args={"kv_transfer_params": {"x": 1, "do_remote_decode": False}}), PREFILL).message
    assert struct_to_json(m.kv.kv_transfer_params) == {"x": 1, "do_remote_decode": True}
    assert not m.response.prompt_token_ids  # no media, no prompt logprobs


@pytest.mark.parametrize("mode", [PREFILL, AGG])
def test_non_object_kv_transfer_params(mode: DisaggregationMode) -> None:
    with pytest.raises(InvalidArgument, match="kv_transfer_params must be a JSON object"):
        build(with_(extra_args={"kv_transfer_params": [1]}), mode)


def test_prefill_exact_message() -> None:
    rejects(
        with_(extra_args={"kv_transfer_params": "x"}), "extra_args.kv_transfer_params must be a JSON object", PREFILL
    )


HANDOFF = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "127.0.0.1",
    "remote_port": 20097,
    "remote_block_ids": [7, 8],
    "nested": {"flags": [True, None, "opaque"]},
}


def decode_req(params: Any, **kw: Any) -> dict[str, Any]:
    return with_(prefill_result={"disaggregated_params": params, "prompt_tokens_details": None}, **kw)


def test_decode_forwards_the_handoff_verbatim_except_remote_port() -> None:
    for _ in range(2):  # repeatable: the input is not mutated
        params = copy.deepcopy(HANDOFF)
        req = decode_req(
            params, extra_args={"kv_transfer_params": {"caller": "discarded"}}, stop_conditions={"max_tokens": 3}
        )
        m = build(req, DECODE).message
        assert struct_to_json(m.kv.kv_transfer_params) == {**HANDOFF, "remote_port": "20097"}
        assert m.stopping.max_new_tokens == 3
        assert params == HANDOFF


@pytest.mark.parametrize(
    ("port", "wire"),
    [(5600.0, "5600"), (0, "0"), ("5600", "5600"), (5600.5, 5600.5), (-1, -1), (True, True), (None, None)],
)
def test_remote_port(port: Any, wire: Any) -> None:
    m = build(decode_req({"remote_port": port}), DECODE).message
    assert struct_to_json(m.kv.kv_transfer_params) == {"remote_port": wire}


def test_decode_without_prefill_result() -> None:
    rejects(BASE, "decode request is missing the prefill_result KV payload", DECODE)
    rejects(decode_req(None), "decode request is missing the prefill_result KV payload", DECODE)
    rejects(decode_req([1]), "kv_transfer_params must be a JSON object", DECODE)


def test_decode_strips_the_multimodal_key_without_media() -> None:
    m = build(decode_req({"a": 1, "_dynamo_sidecar_multimodal_prompt_token_ids": [1, 2]}), DECODE).message
    assert struct_to_json(m.kv.kv_transfer_params) == {"a": 1}
    assert list(m.token_ids.ids) == [1, 2, 3]


def test_aggregated_kv_transfer_params_verbatim() -> None:
    m = build(with_(extra_args={"kv_transfer_params": {"remote_port": 5600, "x": [1.5]}})).message
    assert struct_to_json(m.kv.kv_transfer_params) == {"remote_port": 5600, "x": [1.5]}


def test_struct_errors_surface_from_conversion() -> None:
    rejects(
        with_(extra_args={"kv_transfer_params": {"big": 2**53 + 1}}),
        f"kv_transfer_params integer {2**53 + 1} cannot be represented exactly by protobuf Struct",
    )
    rejects(
        with_(extra_args={"kv_transfer_params": {"nan": float("nan")}}),
        "kv_transfer_params number nan cannot be represented by protobuf Struct",
    )


# ---------------------------------------------------------------- DP rank (docs/reference/sidecar.md#data-parallel-rank)


@pytest.mark.parametrize(
    ("routing", "mode", "rank"),
    [
        ({"dp_rank": 1}, AGG, 1),
        ({}, AGG, None),
        ({"dp_rank": 0}, AGG, 0),
        ({"prefill_dp_rank": 3}, AGG, None),
        ({"prefill_dp_rank": 3, "dp_rank": 1}, PREFILL, 3),
        ({"dp_rank": 1}, PREFILL, 1),
        ({"prefill_dp_rank": 3, "dp_rank": 1}, DECODE, 1),
    ],
)
def test_dp_rank_metadata(routing: dict, mode: DisaggregationMode, rank: int | None) -> None:
    req = with_(routing=routing)
    if mode is DECODE:
        req = decode_req({}, routing=routing)
    built = build(req, mode)
    assert built.dp_rank == rank
    assert built.metadata == (() if rank is None else (("x-data-parallel-rank", str(rank)),))


def test_wire_message_serializes() -> None:
    built = build(REFERENCE)
    again = inference_pb2.GenerateRequest.FromString(built.message.SerializeToString())
    assert again == built.message
    assert json.loads(again.decoding.json) == REFERENCE["sampling_options"]["guided_decoding"]["json"]


@pytest.mark.parametrize(
    ("req", "detail"),
    [
        ({"token_ids": "abc"}, "expected an array, got str @ $.token_ids"),
        ({"token_ids": [1, 1.5]}, "expected an integer (u32), got float at index 1 @ $.token_ids"),
        ({"token_ids": [True]}, "expected an integer (u32), got bool at index 0 @ $.token_ids"),
        ({"token_ids": [-1]}, "-1 is outside the u32 range at index 0 @ $.token_ids"),
        (
            {"token_ids": [1], "sampling_options": {"top_p": "x"}},
            "expected a number, got str @ $.sampling_options.top_p",
        ),
        ({"token_ids": [1], "stop_conditions": []}, "expected an object, got list @ $.stop_conditions"),
        (
            {"token_ids": [1], "output_options": {"logprobs": 2**32}},
            "4294967296 is outside the u32 range @ $.output_options.logprobs",
        ),
        (
            {"token_ids": [1], "routing": {"priority": 2**40}},
            "1099511627776 is outside the i32 range @ $.routing.priority",
        ),
        (
            {"token_ids": [1], "stop_conditions": {"ignore_eos": "yes"}},
            "expected a boolean, got str @ $.stop_conditions.ignore_eos",
        ),
        ({"token_ids": [1], "routing": {"lora_name": 3}}, "expected a string, got int @ $.routing.lora_name"),
    ],
)
def test_structuring_errors_name_the_field(req: dict, detail: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        structure_request(req)
    assert str(info.value) == "invalid PreprocessedRequest: " + detail
