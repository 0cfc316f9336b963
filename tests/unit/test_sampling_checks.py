"""vLLM 0.32's float sampling checks, as the sidecar and the mock apply them (docs/conformance.md).

One table, measured on the real vLLM 0.32 server and asserted against it by
``tests/real_vllm/test_real_float_conformance.py``: field, value, and vLLM's answer (``None`` = accepted).
It is checked three ways here: the shared check on a wire message, the sidecar's conversion of a Dynamo
request (``InvalidArgument`` before any RPC), and the mock's validation (``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from vllm_float_table import BAD, INF, LOGIT_BIASES, NAN, ORDER, TABLE

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import build_generate_request
from trio_sidecar.core.errors import InvalidArgument
from trio_sidecar.core.protocol import PreprocessedRequest, SamplingOptions, structure_request
from trio_sidecar.core.sampling_checks import format_f32, sampling_error
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.generation import RequestRejected
from trio_sidecar.mock.validation import RequestPolicy, prepare_request

TABLE_IDS = [f"{field}={value!r}" for field, value, _ in TABLE]


def set_field(message: pb.GenerateRequest, field: str, value: float) -> None:
    if field == "temperature":
        message.temperature = value
    elif field in ("top_p", "min_p"):
        setattr(message.sampling, field, value)
    else:
        setattr(message.decoding, field, value)


def wire(field: str, value: float) -> pb.GenerateRequest:
    """A greedy request with one float field set on the wire."""
    message = pb.GenerateRequest(
        request_id="r",
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        temperature=0.0,
        stopping=pb.StoppingCriteria(max_new_tokens=4),
    )
    set_field(message, field, value)
    return message


def dynamo(field: str, value: float, **stop: Any) -> dict[str, Any]:
    return {"token_ids": [1, 2, 3], "sampling_options": {field: value}, "stop_conditions": {"max_tokens": 4, **stop}}


def convert(body: dict[str, Any]) -> pb.GenerateRequest:
    return build_generate_request(structure_request(body), "r", "m", DisaggregationMode.AGG).message


@pytest.mark.parametrize(("field", "value", "message"), TABLE, ids=TABLE_IDS)
def test_shared_check_gives_vllms_answer(field, value, message):
    assert sampling_error(wire(field, value)) == message


@pytest.mark.parametrize(("field", "value", "message"), TABLE, ids=TABLE_IDS)
def test_sidecar_rejects_like_vllm_or_forwards_the_value(field, value, message):
    body = dynamo(field, value)
    if message is None:
        sent = convert(body)
        expected = wire(field, value)
        assert sent.temperature == expected.temperature
        assert sent.sampling.top_p == expected.sampling.top_p and sent.sampling.min_p == expected.sampling.min_p
        assert sent.decoding == expected.decoding
    else:
        with pytest.raises(InvalidArgument) as info:
            convert(body)
        assert str(info.value) == message


@pytest.mark.parametrize(("field", "value", "message"), TABLE, ids=TABLE_IDS)
def test_mock_rejects_like_vllm_or_accepts(field, value, message):
    policy = RequestPolicy(served_model_name="m")
    request = wire(field, value)
    if message is None:
        assert prepare_request(request, policy).prompt == (1, 2, 3)
    else:
        with pytest.raises(RequestRejected) as info:
            prepare_request(request, policy)
        assert (info.value.code, info.value.message) == (StatusCode.INVALID_ARGUMENT, message)


def test_unset_temperature_is_never_checked():
    message = wire("top_p", 0.5)
    message.ClearField("temperature")
    assert sampling_error(message) is None


def test_logit_bias_values_are_never_checked():
    message = wire("top_p", 0.5)
    for token, bias in enumerate(LOGIT_BIASES):
        message.decoding.logit_bias[token] = bias
    assert sampling_error(message) is None


@pytest.mark.parametrize("first", range(len(ORDER)), ids=ORDER)
def test_the_first_bad_field_in_vllms_order_is_reported(first):
    message = wire(ORDER[first], BAD[ORDER[first]])
    body = dynamo(ORDER[first], BAD[ORDER[first]])
    for later in ORDER[first + 1 :]:
        set_field(message, later, BAD[later])
        body["sampling_options"][later] = BAD[later]
    expected = sampling_error(wire(ORDER[first], BAD[ORDER[first]]))
    assert expected is not None and expected.startswith(ORDER[first])
    assert sampling_error(message) == expected
    with pytest.raises(InvalidArgument) as info:
        convert(body)
    assert str(info.value) == expected


@pytest.mark.parametrize(
    "stop",
    [{"stop": ["a", ""]}, {"min_tokens": 5}, {"max_tokens": None, "min_tokens": 1}],
    ids=["empty-stop-string", "min-above-max", "min-without-max"],
)
def test_sidecar_sends_the_request_when_vllm_may_reject_its_stopping_criteria_first(stop):
    # vLLM checks these before the float fields; the sidecar lets vLLM report whichever comes first.
    sent = convert(dynamo("temperature", NAN, **stop))
    assert math.isnan(sent.temperature)


def test_attrs_request_with_a_bad_float_is_rejected_too():
    request = PreprocessedRequest(token_ids=[1], sampling_options=SamplingOptions(min_p=-1.0))
    with pytest.raises(InvalidArgument) as info:
        build_generate_request(structure_request(request), "r", "m", DisaggregationMode.AGG)
    assert str(info.value) == "min_p must be in [0, 1], got -1"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (2.0, "2"),
        (1.5, "1.5"),
        (1.1, "1.1"),
        (NAN, "NaN"),
        (INF, "inf"),
        (-INF, "-inf"),
        (-0.0, "-0"),
        (1e38, "100000000000000000000000000000000000000"),
        (-3.4028235e38, "-340282350000000000000000000000000000000"),
        (1e-7, "0.0000001"),
        (100.0, "100"),
        (1e39, "inf"),
        (3.4028235e38, "340282350000000000000000000000000000000"),
    ],
)
def test_format_f32_like_rust_display(value, text):
    assert format_f32(value) == text


# vLLM runs these checks before the float ones (measured; the real-server test asserts it too).
EARLIER = {
    "empty stop string": (lambda m: m.stopping.stop_strings.append(""), "stop strings cannot be empty"),
    "min_tokens above max_tokens": (
        lambda m: setattr(m.stopping, "min_new_tokens", 5),
        "min_new_tokens (5) must not exceed effective max_new_tokens (4)",
    ),
    "prompt too long": (
        lambda m: m.token_ids.ids.extend([7] * 20),
        "this model's maximum context length is 16 tokens, but the prompt contains 23 input tokens",
    ),
}


@pytest.mark.parametrize("earlier", list(EARLIER))
def test_mock_reports_vllms_earlier_checks_before_the_float_ones(earlier):
    make_bad, message = EARLIER[earlier]
    request = wire("temperature", NAN)
    make_bad(request)
    with pytest.raises(RequestRejected) as info:
        prepare_request(request, RequestPolicy(served_model_name="m", max_model_len=16))
    assert (info.value.code, info.value.message) == (StatusCode.INVALID_ARGUMENT, message)
