"""``structure_request`` on the request shapes Dynamo sends and on wrongly typed values.

The usual Dynamo request shapes structure to the expected values (nulls are absent, numbers take their
field's type); a wrongly typed value is an ``InvalidArgument`` with the converter's text (never an
``ExceptionGroup``), or a value the converter accepts; the caller's lists are not aliased.
"""

from __future__ import annotations

import math

import pytest

from trio_sidecar.core.errors import InvalidArgument
from trio_sidecar.core.protocol import PreprocessedRequest, _request_inner, structure_request

DYNAMO = {
    "model": "m",
    "token_ids": [1, 2, 3],
    "stop_conditions": {
        "max_tokens": 32,
        "stop": None,
        "stop_token_ids_hidden": [2],
        "min_tokens": None,
        "ignore_eos": True,
        "max_thinking_tokens": None,
    },
    "sampling_options": {"n": None, "temperature": 0.7, "top_p": 1, "top_k": -1, "seed": -5, "guided_decoding": None},
    "output_options": {
        "logprobs": None,
        "prompt_logprobs": None,
        "skip_special_tokens": True,
        "formatted_prompt": None,
    },
    "eos_token_ids": [2],
    "annotations": [],
    "routing": None,
    "prefill_result": None,
    "extra_args": {"k": [1, None]},
}


def slow(obj: dict) -> PreprocessedRequest:
    """The converter's answer, called directly."""
    return _request_inner({k: v for k, v in obj.items() if v is not None}, PreprocessedRequest)


@pytest.mark.parametrize(
    "obj",
    [
        DYNAMO,
        {"token_ids": [7]},
        {},
        {"token_ids": [0, 2**32 - 1], "routing": {"priority": -(2**31), "dp_rank": 3, "cache_salt": "s"}},
        {"token_ids": [1], "stop_conditions": {"stop": ["a", ""], "stop_token_ids": []}, "sampling_options": {}},
        {"token_ids": [1], "multi_modal_data": {"image_url": [{"Url": "u"}]}, "bootstrap_info": {"x": 1}},
    ],
    ids=["dynamo", "minimal", "empty", "limits", "lists", "opaque"],
)
def test_dynamo_request_shapes_structure_as_the_converter_does(obj: dict) -> None:
    assert repr(structure_request(obj)) == repr(slow(obj))


def test_dynamo_request_values() -> None:
    request = structure_request(DYNAMO)
    assert request.token_ids == [1, 2, 3]
    assert request.stop_conditions.max_tokens == 32 and request.stop_conditions.stop is None
    assert request.stop_conditions.ignore_eos is True
    assert request.sampling_options.temperature == 0.7
    assert type(request.sampling_options.top_p) is float and request.sampling_options.top_p == 1.0
    assert request.sampling_options.seed == -5
    assert request.output_options.skip_special_tokens is True
    assert request.extra_args == {"k": [1, None]}


@pytest.mark.parametrize(
    "obj",
    [
        {"token_ids": [1, True]},
        {"token_ids": (1, 2)},
        {"token_ids": [2**32]},
        {"token_ids": "12"},
        {"token_ids": [1], "stop_conditions": {"max_tokens": 3.0}},
        {"token_ids": [1], "stop_conditions": {"max_tokens": -1}},
        {"token_ids": [1], "stop_conditions": []},
        {"token_ids": [1], "sampling_options": {"temperature": "0.5"}},
        {"token_ids": [1], "sampling_options": {"temperature": False}},
        {"token_ids": [1], "sampling_options": {"top_k": 2**31}},
        {"token_ids": [1], "sampling_options": {"guided_decoding": {"regex": "a"}}},
        {"token_ids": [1], "output_options": {"skip_special_tokens": 1}},
        {"token_ids": [1], "routing": {"lora_name": 5}},
        {"token_ids": [1], "prefill_result": {"disaggregated_params": {}}},
        {"token_ids": [1], "stop_conditions": {"stop": ["a", 1]}},
    ],
)
def test_wrongly_typed_values_are_invalid_arguments_or_the_converters_result(obj: dict) -> None:
    try:
        expected = repr(slow(obj))
    except Exception:  # the converter's error, through structure_request: the exact InvalidArgument text
        with pytest.raises(InvalidArgument, match=r"^invalid PreprocessedRequest: "):
            structure_request(obj)
    else:
        assert repr(structure_request(obj)) == expected


def test_the_callers_lists_are_not_aliased() -> None:
    obj = {"token_ids": [1, 2], "stop_conditions": {"stop": ["x"]}}
    request = structure_request(obj)
    obj["token_ids"].append(3)
    obj["stop_conditions"]["stop"].append("y")
    assert request.token_ids == [1, 2] and request.stop_conditions.stop == ["x"]


def test_nan_is_kept_as_the_converter_does() -> None:
    request = structure_request({"token_ids": [1], "sampling_options": {"temperature": math.nan}})
    assert math.isnan(request.sampling_options.temperature)
