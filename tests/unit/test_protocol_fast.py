"""``structure_request``'s fast path (``protocol._structure_fast``) against the cattrs converter.

The fast path takes only plain values of exactly the expected types and answers None for anything else, so
the converter gives the result or the exact error. Here: it is taken for the usual Dynamo request shapes,
it declines the others, and whenever it answers, its result is the converter's, field by field and type by
type (compared through ``repr``: ``1`` vs ``1.0`` vs ``True``).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_sidecar.errors import InvalidArgument
from trio_sidecar.protocol import PreprocessedRequest, _request_inner, _structure_fast, structure_request

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
    """The converter's answer (structure_request without the fast path)."""
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
def test_fast_path_is_taken_and_equals_the_converter(obj: dict) -> None:
    fast = _structure_fast(obj)
    assert fast is not None
    assert repr(fast) == repr(slow(obj)) == repr(structure_request(obj))


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
def test_fast_path_declines_anything_else(obj: dict) -> None:
    assert _structure_fast(obj) is None
    try:
        expected = repr(slow(obj))
    except Exception:  # the converter's error, through structure_request: the exact InvalidArgument text
        with pytest.raises(InvalidArgument, match=r"^invalid PreprocessedRequest: "):
            structure_request(obj)
    else:
        assert repr(structure_request(obj)) == expected


def test_fast_path_does_not_alias_the_callers_lists() -> None:
    obj = {"token_ids": [1, 2], "stop_conditions": {"stop": ["x"]}}
    request = structure_request(obj)
    obj["token_ids"].append(3)
    obj["stop_conditions"]["stop"].append("y")
    assert request.token_ids == [1, 2] and request.stop_conditions.stop == ["x"]


_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False),
    st.text(max_size=3),
)
_value = st.one_of(
    _scalar,
    st.lists(_scalar, max_size=3),
    st.tuples(st.integers(0, 9)),
    st.dictionaries(st.text(max_size=3), _scalar, max_size=2),
)
_FIELDS = {
    "stop_conditions": [
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "stop_token_ids_hidden",
        "stop_token_ids_visible",
        "ignore_eos",
        "max_thinking_tokens",
    ],
    "sampling_options": [
        "n",
        "best_of",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "use_beam_search",
        "length_penalty",
        "seed",
        "include_stop_str_in_output",
        "guided_decoding",
    ],
    "output_options": ["logprobs", "prompt_logprobs", "skip_special_tokens"],
    "routing": ["priority", "cache_namespace", "cache_salt", "lora_name", "dp_rank", "prefill_dp_rank"],
}
_options = {
    name: st.one_of(_value, st.fixed_dictionaries({}, optional={f: _value for f in fields}))
    for name, fields in _FIELDS.items()
}
_request = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": st.one_of(_value, st.lists(st.integers(-1, 2**32), max_size=4)),
        "prompt_embeds": _value,
        "multi_modal_data": _value,
        "extra_args": _value,
        "prefill_result": _value,
        "model": _value,
        **_options,
    },
)


@settings(max_examples=400, deadline=None)
@given(_request)
def test_fast_path_property_equals_the_converter_whenever_it_answers(obj: dict) -> None:
    fast = _structure_fast(obj)
    try:
        expected = slow(obj)
    except Exception:
        assert fast is None  # every request the converter rejects goes to the converter
        return
    if fast is not None:
        assert repr(fast) == repr(expected)


def test_fast_path_keeps_nan_as_the_converter_does() -> None:
    request = structure_request({"token_ids": [1], "sampling_options": {"temperature": math.nan}})
    assert math.isnan(request.sampling_options.temperature)
