"""Property-based tests of the pure conversions (hypothesis).

Random inputs never raise anything but the typed errors, and the JSON <-> Struct round trip is exact
where Struct can represent the value. ``HYPOTHESIS_PROFILE=long`` runs >= 10,000 examples per property.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from hypothesis import event, given, note
from hypothesis import strategies as st

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import ResponseState, build_generate_request
from trio_sidecar.core.convert.batch import END, BatchBuilder, ChunkBatch
from trio_sidecar.core.convert.response import plain_token_fields
from trio_sidecar.core.errors import InvalidArgument, ProtocolError
from trio_sidecar.core.jsonstruct import MAX_EXACT_INT, json_to_struct, struct_to_json
from trio_sidecar.core.multimodal import HANDOFF_KEY
from trio_sidecar.core.protocol import LLMEngineOutput, structure_request

MODES = st.sampled_from(list(DisaggregationMode))

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    # JSON integers have no size limit: beyond u64 and beyond a float (10**5000, beyond the 4300-digit str()
    # limit, is in test_typed_errors.py: hypothesis cannot print it).
    | st.sampled_from([2**64, 10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
# Values Struct represents exactly.
exact_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_EXACT_INT, max_value=MAX_EXACT_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
exact_values = st.recursive(
    exact_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def junk_or(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly well-typed values, sometimes arbitrary JSON."""
    return st.one_of(strategy, strategy, strategy, json_values)


def opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


u32 = st.integers(min_value=0, max_value=2**32 - 1)
small = st.integers(min_value=-3, max_value=5)
floats = st.floats(allow_nan=True, allow_infinity=True)
# A request's float field may be given any JSON number, an integer too large for a float included.
request_floats = floats | st.integers(-5, 5) | st.sampled_from([10**400, -(10**400)])

stop_conditions = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": junk_or(opt(u32)),
        "min_tokens": junk_or(opt(u32)),
        "stop": junk_or(opt(st.lists(st.text(max_size=4), max_size=3))),
        "stop_token_ids": junk_or(opt(st.lists(u32, max_size=4))),
        "stop_token_ids_hidden": junk_or(opt(st.lists(u32, max_size=4))),
        "stop_token_ids_visible": junk_or(opt(st.lists(u32, max_size=2))),
        "ignore_eos": junk_or(opt(st.booleans())),
        "max_thinking_tokens": opt(small),
    },
)
guided = st.fixed_dictionaries(
    {},
    optional={
        "json": opt(json_values),
        "regex": junk_or(opt(st.text(max_size=4))),
        "choice": junk_or(opt(st.lists(st.text(max_size=3), max_size=3))),
        "grammar": junk_or(opt(st.text(max_size=4))),
        "structural_tag": opt(json_values),
        "backend": opt(st.just("xgrammar")),
        "whitespace_pattern": opt(st.just(" ")),
    },
)
sampling_options = st.fixed_dictionaries(
    {},
    optional={
        "n": junk_or(opt(small)),
        "best_of": junk_or(opt(small)),
        "presence_penalty": junk_or(opt(request_floats)),
        "frequency_penalty": junk_or(opt(request_floats)),
        "repetition_penalty": junk_or(opt(request_floats)),
        "temperature": junk_or(opt(request_floats)),
        "top_p": junk_or(opt(request_floats)),
        "top_k": junk_or(opt(st.integers(min_value=-(2**31), max_value=2**31 - 1))),
        "min_p": junk_or(opt(request_floats)),
        "use_beam_search": junk_or(opt(st.booleans())),
        "length_penalty": junk_or(opt(st.sampled_from([1.0, 2.0, math.nan]))),
        "seed": junk_or(opt(st.integers(min_value=-(2**63), max_value=2**63 - 1))),
        "include_stop_str_in_output": junk_or(opt(st.booleans())),
        "guided_decoding": junk_or(opt(guided)),
    },
)
output_options = st.fixed_dictionaries(
    {},
    optional={
        "logprobs": junk_or(opt(u32)),
        "prompt_logprobs": junk_or(opt(u32)),
        "skip_special_tokens": junk_or(opt(st.booleans())),
    },
)
routing = st.fixed_dictionaries(
    {},
    optional={
        "priority": junk_or(opt(st.integers(min_value=-(2**31), max_value=2**31 - 1))),
        "cache_namespace": junk_or(opt(st.sampled_from(["a", "b", "dynamo-cache-salt:a"]))),
        "cache_salt": junk_or(opt(st.sampled_from(["a", "c"]))),
        "lora_name": opt(st.sampled_from(["", "lora"])),
        "dp_rank": junk_or(opt(st.integers(min_value=0, max_value=7))),
        "prefill_dp_rank": junk_or(opt(st.integers(min_value=0, max_value=7))),
    },
)
media_item = st.one_of(
    st.sampled_from(["https://x/a.png", "data:image/png;base64,AA==", "ftp://x"]),
    st.fixed_dictionaries({"Url": st.sampled_from(["http://x/a.png", "data:,", "nope"])}),
    st.fixed_dictionaries({"Decoded": json_values}),
    st.fixed_dictionaries({"UuidOnly": st.text(max_size=3)}),
    json_values,
)
extra_args = st.fixed_dictionaries(
    {},
    optional={
        "bypass_prefix_cache": junk_or(opt(st.booleans())),
        "skip_reading_prefix_cache": junk_or(opt(st.booleans())),
        "kv_transfer_params": opt(json_values),
        "nvext": junk_or(
            opt(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "token_in": opt(json_scalars),
                        "cache_salt": opt(st.sampled_from(["a", "c", "", 3])),
                        "extra_fields": json_values,
                    },
                )
            )
        ),
        "mm_hashes": junk_or(opt(st.lists(st.sampled_from(["0123456789abcdef", "", "x"]), max_size=3))),
        "messages": json_values,
        "unknown": st.just(1),
    },
)
prefill_result = st.fixed_dictionaries(
    {},
    optional={
        "disaggregated_params": junk_or(
            opt(
                st.dictionaries(
                    st.sampled_from(["remote_port", "remote_host", HANDOFF_KEY, "x"]),
                    st.one_of(json_values, st.lists(u32, max_size=3), st.sampled_from([5600, 5600.0, -1, True])),
                    max_size=4,
                )
            )
        ),
        "prompt_tokens_details": json_values,
    },
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": junk_or(st.lists(u32, max_size=5)),
        "prompt_embeds": opt(st.just("AAAA")),
        "multi_modal_data": junk_or(
            opt(
                st.dictionaries(
                    st.sampled_from(["image_url", "video_url"]), st.lists(media_item, max_size=2), max_size=2
                )
            )
        ),
        "multi_modal_uuids": junk_or(
            opt(st.fixed_dictionaries({"image_url": st.lists(st.text(max_size=3), max_size=2)}))
        ),
        "mm_processor_kwargs": opt(st.just({})),
        "bootstrap_info": opt(st.just({})),
        "extra_args": junk_or(opt(extra_args)),
        "prefill_result": junk_or(opt(prefill_result)),
        "stop_conditions": junk_or(opt(stop_conditions)),
        "sampling_options": junk_or(opt(sampling_options)),
        "output_options": junk_or(opt(output_options)),
        "routing": junk_or(opt(routing)),
        "mdc_sum": st.text(max_size=4),
    },
)

# Well-typed requests that pass validation more often, so the mapping invariants get exercised.
valid_requests = st.fixed_dictionaries(
    {"token_ids": st.lists(u32, min_size=1, max_size=5)},
    optional={
        "stop_conditions": st.fixed_dictionaries(
            {},
            optional={
                "max_tokens": opt(u32),
                "min_tokens": opt(u32),
                "stop": opt(st.lists(st.text(max_size=4), max_size=3)),
                "stop_token_ids": opt(st.lists(u32, max_size=4)),
                "stop_token_ids_hidden": opt(st.lists(u32, max_size=4)),
                "ignore_eos": opt(st.booleans()),
            },
        ),
        "sampling_options": st.fixed_dictionaries(
            {},
            optional={
                "n": st.sampled_from([None, 1]),
                "temperature": opt(floats),
                "top_p": opt(floats),
                "top_k": opt(st.integers(min_value=-1, max_value=2**31 - 1)),
                "seed": opt(st.integers(min_value=-(2**63), max_value=2**63 - 1)),
                "length_penalty": st.sampled_from([None, 1.0]),
                "guided_decoding": opt(
                    st.one_of(
                        st.fixed_dictionaries({"json": exact_values}),
                        st.fixed_dictionaries({"regex": st.text(max_size=4)}),
                        st.fixed_dictionaries({"choice": st.lists(st.text(max_size=3), max_size=3)}),
                        st.fixed_dictionaries({"structural_tag": exact_values}),
                    )
                ),
            },
        ),
        "output_options": st.fixed_dictionaries(
            {},
            optional={
                "logprobs": opt(st.integers(0, 2**31 - 1)),
                "prompt_logprobs": opt(st.integers(0, 2**31 - 1)),
                "skip_special_tokens": opt(st.booleans()),
            },
        ),
        "routing": st.fixed_dictionaries(
            {},
            optional={
                "priority": opt(st.integers(min_value=-(2**31), max_value=2**31 - 1)),
                "cache_namespace": opt(st.text(max_size=4)),
                "dp_rank": opt(st.integers(0, 7)),
                "prefill_dp_rank": opt(st.integers(0, 7)),
            },
        ),
        "extra_args": opt(
            st.fixed_dictionaries(
                {},
                optional={
                    "bypass_prefix_cache": opt(st.booleans()),
                    "kv_transfer_params": opt(st.dictionaries(st.text(max_size=4), exact_values, max_size=3)),
                },
            )
        ),
        "prefill_result": st.fixed_dictionaries(
            {"disaggregated_params": st.dictionaries(st.text(max_size=4), exact_values, max_size=3)}
        ),
        "multi_modal_data": st.fixed_dictionaries(
            {"image_url": st.lists(st.sampled_from(["https://x/a.png", "data:,x"]), max_size=2)}
        ),
    },
)


@given(req=requests | valid_requests | json_values, mode=MODES, request_id=st.sampled_from(["", "req-1"]))
def test_property_request_conversion_raises_only_invalid_argument(
    req: Any, mode: DisaggregationMode, request_id: str
) -> None:
    try:
        request = structure_request(req)
        built = build_generate_request(request, request_id, "served-model", mode)
    except InvalidArgument as exc:
        note(str(exc))
        event("rejected")
        assert str(exc)
        return
    event("converted")
    m = built.message
    if mode is DisaggregationMode.ENCODE:  # an encode request carries media and asks for one token
        assert len(m.media) > 0 and built.dp_rank is None
        assert (m.stopping.max_new_tokens, m.stopping.min_new_tokens) == (1, 1)
    assert m.model == "served-model" and m.sampling.num_sequences == 1
    assert m.request_id == (request_id or m.request_id) and m.request_id
    ids = list(m.stopping.stop_token_ids)
    assert ids == sorted(set(ids))
    assert m.HasField("kv") and m.lora_name == ""
    assert m.kv.cache_salt == "" or m.kv.cache_salt.startswith("dynamo-cache-salt:")
    assert built.prompt_tokens == len(m.token_ids.ids) > 0
    if mode is DisaggregationMode.PREFILL:
        assert (m.stopping.max_new_tokens, m.stopping.min_new_tokens) == (1, 1)
        assert struct_to_json(m.kv.kv_transfer_params)["do_remote_decode"] is True
    if mode is DisaggregationMode.DECODE:  # the original prompt and the media again, the expanded ids stripped
        assert len(m.media) == sum(len(items or ()) for items in (req.get("multi_modal_data") or {}).values())
        assert HANDOFF_KEY not in struct_to_json(m.kv.kv_transfer_params)
    rank = built.dp_rank
    assert built.metadata == (() if rank is None else (("x-data-parallel-rank", str(rank)),))
    # The wire message always serializes.
    assert pb.GenerateRequest.FromString(m.SerializeToString()) == m


@given(value=json_values)
def test_property_json_to_struct_raises_only_invalid_argument(value: Any) -> None:
    try:
        struct = json_to_struct(value)
    except InvalidArgument as exc:
        assert "kv_transfer_params" in str(exc)
        return
    assert isinstance(value, dict)
    struct_to_json(struct)  # what was accepted always decodes


def _expected(value: Any) -> Any:
    """What the Struct round trip returns: whole doubles within 2**53 come back as ints."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) <= MAX_EXACT_INT else value
    if isinstance(value, list):
        return [_expected(v) for v in value]
    return {k: _expected(v) for k, v in value.items()}


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@given(value=st.dictionaries(st.text(max_size=6), exact_values, max_size=5))
def test_property_struct_round_trip_is_exact(value: dict[str, Any]) -> None:
    back = struct_to_json(json_to_struct(value))
    assert _same(back, _expected(value))
    # And a second trip is the identity.
    assert _same(struct_to_json(json_to_struct(back)), back)


@st.composite
def struct_values(draw: st.DrawFn, depth: int = 0) -> struct_pb2.Value:
    value = struct_pb2.Value()
    kind = draw(
        st.sampled_from(
            ["unset", "null", "bool", "num", "str", "list", "struct"] if depth < 2 else ["num", "str", "unset"]
        )
    )
    if kind == "null":
        value.null_value = struct_pb2.NULL_VALUE
    elif kind == "bool":
        value.bool_value = draw(st.booleans())
    elif kind == "num":
        value.number_value = draw(floats)
    elif kind == "str":
        value.string_value = draw(st.text(max_size=4))
    elif kind == "list":
        value.list_value.SetInParent()
        for item in draw(st.lists(struct_values(depth + 1), max_size=3)):
            value.list_value.values.add().CopyFrom(item)
    elif kind == "struct":
        value.struct_value.SetInParent()
        for key, item in draw(st.dictionaries(st.text(max_size=3), struct_values(depth + 1), max_size=3)).items():
            value.struct_value.fields[key].CopyFrom(item)
    return value


@given(fields=st.dictionaries(st.text(max_size=4), struct_values(), max_size=4))
def test_property_struct_to_json_raises_only_protocol_error(fields: dict[str, struct_pb2.Value]) -> None:
    struct = struct_pb2.Struct()
    for key, item in fields.items():
        struct.fields[key].CopyFrom(item)
    try:
        result = struct_to_json(struct)
    except ProtocolError as exc:
        assert "NaN or infinity" in str(exc)
        return
    assert set(result) == set(fields)


# ---------------------------------------------------------------------------- responses


@st.composite
def candidate_infos(draw: st.DrawFn) -> pb.CandidateTokenInfo:
    tokens = draw(st.lists(st.tuples(st.integers(0, 50), floats, st.integers(0, 5)), max_size=3))
    return pb.CandidateTokenInfo(
        tokens=[pb.CandidateTokenInfo.TokenInfo(id=i, logprob=lp, rank=r) for i, lp, r in tokens]
    )


@st.composite
def responses(draw: st.DrawFn) -> pb.GenerateResponse:
    resp = pb.GenerateResponse()
    if draw(st.integers(0, 3)) == 0:
        n = draw(st.integers(0, 4))
        size = st.integers(max(0, n - 1), n + 1) if draw(st.booleans()) else st.just(n)
        resp.prompt_info.CopyFrom(
            pb.PromptInfo(
                num_prompt_tokens=n,
                token_ids=draw(st.lists(st.integers(0, 50), min_size=draw(size), max_size=n + 1)),
                logprobs=draw(st.lists(floats, min_size=draw(size), max_size=n + 1)),
                ranks=draw(st.lists(st.integers(0, 5), min_size=draw(size), max_size=n + 1)),
                candidate_tokens=draw(st.lists(candidate_infos(), min_size=draw(size), max_size=n + 1)),
            )
        )
    if draw(st.integers(0, 5)) > 0:
        k = draw(st.integers(0, 3))
        size = st.integers(max(0, k - 1), k + 1) if draw(st.integers(0, 4)) == 0 else st.just(k)
        seq = pb.SequenceOutput(
            index=draw(st.sampled_from([0, 0, 0, 0, 1])),
            text=draw(st.sampled_from(["", "a", " tok"])),
            num_tokens=draw(st.sampled_from([k, k, k, k + 1])),
            token_ids=draw(st.lists(st.integers(0, 50), min_size=k, max_size=k)),
            logprobs=draw(st.lists(floats, min_size=draw(size), max_size=k + 1)),
            ranks=draw(st.lists(st.integers(0, 5), min_size=draw(size), max_size=k + 1)),
            candidate_tokens=draw(st.lists(candidate_infos(), min_size=draw(size), max_size=k + 1)),
        )
        if draw(st.integers(0, 3)) == 0:
            finish = pb.FinishInfo(
                num_output_tokens=draw(st.integers(0, 8)),
                finish_reason=draw(st.sampled_from([0, 1, 2, 2, 3, 7])),
            )
            which = draw(st.sampled_from(["none", "stop_token_id", "eos_token_id", "stop_string"]))
            if which == "stop_string":
                finish.stop_string = draw(st.text(max_size=3))
            elif which != "none":
                setattr(finish, which, draw(st.integers(0, 9)))
            if draw(st.booleans()):
                params = draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3))
                try:
                    finish.kv_transfer_params.CopyFrom(json_to_struct(params))
                except InvalidArgument:
                    finish.kv_transfer_params.fields["bad"].number_value = math.nan
            seq.finish_info.CopyFrom(finish)
        resp.outputs.CopyFrom(seq)
    return resp


@given(
    mode=st.sampled_from([DisaggregationMode.AGG, DisaggregationMode.PREFILL, DisaggregationMode.DECODE]),
    logprobs=opt(st.integers(0, 3)),
    prompt_logprobs=opt(st.integers(0, 2)),
    media=st.booleans(),
    stream=st.lists(responses(), max_size=8),
)
def test_property_response_conversion_raises_only_protocol_error(
    mode: DisaggregationMode,
    logprobs: int | None,
    prompt_logprobs: int | None,
    media: bool,
    stream: list[pb.GenerateResponse],
) -> None:
    req: dict[str, Any] = {
        "token_ids": [1, 2, 3],
        "output_options": {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs},
    }
    if mode is DisaggregationMode.DECODE:
        req["prefill_result"] = {"disaggregated_params": {HANDOFF_KEY: [1, 2, 3, 4]}}
    if media:
        req["multi_modal_data"] = {"image_url": ["https://x/a.png"]}
    request = structure_request(req)
    built = build_generate_request(request, "r", "m", mode)
    state = ResponseState(request, built, mode)
    streamed = 0
    for resp in stream:
        was_finished = state.finished
        try:
            chunk = state.convert(resp)
        except ProtocolError as exc:
            assert str(exc).startswith("invalid vLLM gRPC response: ")
            assert not state.finished
            return  # the engine drops the stream here
        if was_finished:
            assert chunk is None
            continue
        if resp.HasField("outputs"):
            streamed += resp.outputs.num_tokens
        assert state.completion_tokens == streamed
        if chunk is None:
            continue
        assert isinstance(chunk, LLMEngineOutput)
        d = chunk.to_dict()
        assert d["index"] == 0 and isinstance(d["token_ids"], list)
        if mode is DisaggregationMode.PREFILL:
            assert d["token_ids"] == [] and "text" not in d
        for value in d.get("log_probs", []):
            assert math.isfinite(value) and value >= -9999.0
        for i, position in enumerate(d.get("top_logprobs", [])):
            # docs/reference/sidecar.md#per-message-checks: the sampled token is listed once, first unless the server listed it.
            sampled = resp.outputs.token_ids[i]
            listed = [c.id for c in resp.outputs.candidate_tokens[i].tokens]
            ids = [entry["token_id"] for entry in position]
            assert ids == (listed if sampled in listed else [sampled, *listed])
            assert all(math.isfinite(e["logprob"]) for e in position)
        if "finish_reason" in d:
            assert state.finished
            assert d["finish_reason"] in ("stop", "length", "cancelled")
            usage = d["completion_usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert usage["completion_tokens"] == (0 if mode is DisaggregationMode.PREFILL else streamed)
        else:
            assert not state.finished
    cancelled = state.cancelled_chunk().to_dict()
    assert cancelled["finish_reason"] == "cancelled" and cancelled["token_ids"] == []


@st.composite
def token_responses(draw: st.DrawFn) -> pb.GenerateResponse:
    """The common message: tokens and text only (``ResponseState.convert_plain``'s fast path)."""
    k = draw(st.integers(1, 3))
    seq = pb.SequenceOutput(
        text=draw(st.sampled_from(["", "a", " tok", "é"])),
        num_tokens=k,
        token_ids=draw(st.lists(u32, min_size=k, max_size=k)),
    )
    return pb.GenerateResponse(outputs=seq)


@given(
    mode=st.sampled_from([DisaggregationMode.AGG, DisaggregationMode.PREFILL, DisaggregationMode.DECODE]),
    logprobs=opt(st.integers(0, 2)),
    request_cancelled=st.booleans(),
    stream=st.lists(st.one_of(token_responses(), token_responses(), responses()), max_size=12),
    flushes=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_property_batch_builder_matches_one_message_at_a_time(
    mode: DisaggregationMode,
    logprobs: int | None,
    request_cancelled: bool,
    stream: list[pb.GenerateResponse],
    flushes: list[bool],
) -> None:
    """``BatchBuilder`` (fast path, compact batches) yields what converting each message on its own does."""
    decode = mode is DisaggregationMode.DECODE
    cancelled = request_cancelled and decode  # the engine records a deferred cancellation only in decode mode
    req: dict[str, Any] = {"token_ids": [1, 2, 3], "output_options": {"logprobs": logprobs}}
    if decode:
        req["prefill_result"] = {"disaggregated_params": {HANDOFF_KEY: [1, 2, 3, 4]}}
    request = structure_request(req)

    def new_state() -> ResponseState:
        return ResponseState(request, build_generate_request(request, "r", "m", mode), mode)

    # The reference: one message at a time (docs/reference/sidecar.md#per-message-checks, docs/reference/sidecar.md#decode-deferral).
    ref = new_state()
    expected: list[dict[str, Any]] = []
    expected_end: tuple[Any, ...] = ("eof",)
    completed = False
    for resp in stream:
        try:
            chunk = ref.convert(resp)
        except ProtocolError as exc:
            expected_end = ("cancelled",) if cancelled else ("error", str(exc))
            break
        completing = decode and not completed and ResponseState.completes_transfer(resp)
        completed = completed or completing
        if chunk is None:
            continue
        if completing and cancelled:
            expected_end = ("cancelled",)
            break
        if ref.finished:
            expected_end = ("final", chunk.to_dict())
            break
        expected.append(chunk.to_dict())

    state = new_state()
    builder = BatchBuilder(state, decode=decode)
    got: list[dict[str, Any]] = []
    got_end: tuple[Any, ...] = ("eof",)

    def hand_over() -> None:
        items = builder.take_items()
        if items is not None:
            batch = ChunkBatch(items)
            while (chunk := batch.take()) is not None:
                got.append(chunk.to_dict())

    # (flushes: a flag for each of the stream's at most 12 messages; those past its end are unused)
    for resp, flush in zip(stream, flushes, strict=False):
        if builder.add(resp.SerializeToString(), cancelled) is END:
            hand_over()
            ending = builder.ending
            assert ending is not None
            if ending.error is not None:
                got_end = ("error", str(ending.error))
            else:
                assert ending.final is not None
                is_cancelled = ending.final.finish_reason == "cancelled" and ending.final.token_ids == []
                got_end = ("cancelled",) if is_cancelled and cancelled else ("final", ending.final.to_dict())
            break
        if flush:
            hand_over()
    else:
        hand_over()
    note(f"expected {expected} {expected_end}; got {got} {got_end}")
    assert got == expected
    assert got_end == expected_end
    assert state.completion_tokens == ref.completion_tokens


def plain_values(resp: pb.GenerateResponse) -> tuple[Any, ...] | None:
    """What ``plain_token_fields`` must read from a message: its ids and text when it carries only those."""
    if resp.HasField("prompt_info") or not resp.HasField("outputs"):
        return None
    seq = resp.outputs
    if seq.index or seq.HasField("finish_info") or seq.logprobs or seq.ranks or seq.candidate_tokens:
        return None
    if not 0 < seq.num_tokens == len(seq.token_ids):
        return None
    ids = list(seq.token_ids)
    return (ids[0] if len(ids) == 1 else ids), seq.text


@given(resp=st.one_of(token_responses(), responses()))
def test_property_plain_token_fields_reads_what_protobuf_parses(resp: pb.GenerateResponse) -> None:
    data = resp.SerializeToString()
    # Both ways: every tokens-and-text message (within the fast path's sizes, as all here) is read, the
    # same values as protobuf's; every other message is left to protobuf.
    assert plain_token_fields(data) == plain_values(pb.GenerateResponse.FromString(data))


def varint(value: int, extra: int = 0) -> bytes:
    """``value`` as a varint, with ``extra`` redundant continuation bytes (an overlong encoding)."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    if extra:
        out.append(value | 0x80)
        out.extend([0x80] * (extra - 1))
        out.append(0)
    else:
        out.append(value)
    return bytes(out)


@st.composite
def near_plain_bytes(draw: st.DrawFn) -> bytes:
    """A tokens-and-text ``GenerateResponse`` encoded by hand, now and then departing from the canonical form."""

    def odd() -> bool:  # depart from the canonical encoding here (each site ~1 in 16)
        return draw(st.integers(0, 15)) == 0

    def length(n: int) -> bytes:
        return varint(max(0, n + draw(st.sampled_from([-1, 1]))) if odd() else n, 1 if odd() else 0)

    ids = draw(
        st.lists(st.integers(2**32, 2**35) if odd() else st.one_of(st.integers(0, 2**21), u32), min_size=1, max_size=4)
    )
    packed = b"".join(varint(i, draw(st.sampled_from([1, 5, 6, 10])) if odd() else 0) for i in ids)
    count = len(ids) + (draw(st.sampled_from([-1, 1])) if odd() else 0)
    text = draw(st.sampled_from([b"", b"a", b"tok", "é".encode()]))
    if odd():
        text = draw(st.sampled_from([b"\xc3", b"\xed\xa0\x80", b"\xff", b"a\x00"]))
    inner = b"\x08" + varint(draw(st.sampled_from([0, 1]))) if odd() else b""  # index
    if text or odd():
        inner += b"\x12" + length(len(text)) + text
    if not odd():
        inner += b"\x18" + varint(count, 1 if odd() else 0)
    tag = draw(st.sampled_from([b"\x20", b"\x2a"])) if odd() else b"\x22"  # unpacked / wrong wire type
    inner += tag + length(len(packed)) + packed
    if odd():
        inner += draw(st.sampled_from([b"\x2d\x00\x00\x80\xbf", b"\x42\x00", b"\x18\x01", b"\x00"]))
    head = draw(st.sampled_from([b"\x0a", b"\x1a"])) if odd() else b"\x12"
    data = head + length(len(inner)) + inner
    if odd():
        data = data[: draw(st.integers(0, len(data)))]
    return data


@given(data=st.one_of(near_plain_bytes(), st.binary(max_size=24).map(lambda b: b"\x12" + b)))
def test_property_plain_token_fields_never_reads_bytes_protobuf_reads_otherwise(data: bytes) -> None:
    got = plain_token_fields(data)
    event("read" if got is not None else "left to protobuf")
    try:
        parsed = pb.GenerateResponse.FromString(data)
    except DecodeError:
        assert got is None, f"read {got!r} from bytes protobuf rejects: {data!r}"
        return
    if got is not None:
        assert got == plain_values(parsed)
