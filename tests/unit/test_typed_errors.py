"""Every bad number in a request is an ``InvalidArgument``, never an ``OverflowError`` or ``ValueError``.

JSON puts no limit on an integer's length: one too large for a float (``10**400``) used to raise a plain
``OverflowError`` from the float fields, and one too long for Python to print (``10**5000``) a
``ValueError`` from the error messages themselves.
"""

from __future__ import annotations

import copy

import pytest

from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import build_generate_request
from trio_sidecar.core.errors import InvalidArgument
from trio_sidecar.core.protocol import structure_request

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
]


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_an_int_beyond_the_float_range_is_a_typed_error(field, sign):
    body = {"token_ids": [1], "sampling_options": {field: sign * 10**400}}
    expected = f"invalid PreprocessedRequest: integer too large to convert to a float @ $.sampling_options.{field}"
    with pytest.raises(InvalidArgument) as info:
        structure_request(body)
    assert str(info.value) == expected
    # The same through an attrs request built by an embedded caller.
    request = structure_request({"token_ids": [1]})
    bad = copy.deepcopy(request)
    setattr(bad.sampling_options, field, sign * 10**400)
    with pytest.raises(InvalidArgument) as info:
        structure_request(bad)
    assert str(info.value) == expected


def test_the_largest_int_a_float_holds_is_still_a_float():
    largest = int(1.7976931348623157e308)
    assert (
        structure_request({"token_ids": [1], "sampling_options": {"temperature": largest}}).sampling_options.temperature
        == 1.7976931348623157e308
    )


HUGE = 10**5000  # beyond Python's default 4300-digit limit for int -> str


@pytest.mark.parametrize(
    ("body", "mode", "message"),
    [
        (
            {"token_ids": [HUGE]},
            DisaggregationMode.AGG,
            "invalid PreprocessedRequest: <16610-bit integer> is outside the u32 range at index 0 @ $.token_ids",
        ),
        (
            {"token_ids": [1], "stop_conditions": {"max_tokens": -HUGE}},
            DisaggregationMode.AGG,
            "invalid PreprocessedRequest: <16610-bit integer> is outside the u32 range @ $.stop_conditions.max_tokens",
        ),
        (
            {"token_ids": [1], "extra_args": {"kv_transfer_params": {"a": HUGE}}},
            DisaggregationMode.AGG,
            "kv_transfer_params integer <16610-bit integer> cannot be represented exactly by protobuf Struct",
        ),
        (
            {"token_ids": [1], "prefill_result": {"disaggregated_params": {"remote_port": HUGE}}},
            DisaggregationMode.DECODE,
            "kv_transfer_params integer <16610-bit integer> cannot be represented exactly by protobuf Struct",
        ),
    ],
    ids=["token-id", "max-tokens", "kv-params", "remote-port"],
)
def test_an_int_too_long_to_print_is_a_typed_error(body, mode, message):
    with pytest.raises(InvalidArgument) as info:
        build_generate_request(structure_request(body), "r", "m", mode)
    assert str(info.value) == message
