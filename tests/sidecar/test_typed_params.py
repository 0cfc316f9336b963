"""``SamplingParams`` and the completion assembly, without a server (docs/embedded.md).

``SamplingParams`` has vLLM's names and defaults, is frozen, and refuses at construction exactly what the
conversion refuses, with the conversion's text: each case below builds the Dynamo-shaped request the same
value makes and compares the two errors. The mapping sends what the parameters say.
"""

from __future__ import annotations

import attrs
import pytest

from trio_sidecar import InvalidArgument, SamplingParams, StructuredOutputs
from trio_sidecar.core.completions import CompletionBuilder, Logprob
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert.request import build_generate_request
from trio_sidecar.core.protocol import CompletionUsage, LLMEngineOutput, TopLogprob, structure_request

# (SamplingParams keywords, the same value in Dynamo's request shape)
REJECTED = [
    ({"n": 2}, {"sampling_options": {"n": 2}}),
    ({"best_of": 3}, {"sampling_options": {"best_of": 3}}),
    ({"top_k": -2}, {"sampling_options": {"top_k": -2}}),
    ({"temperature": 2.5}, {"sampling_options": {"temperature": 2.5}}),
    ({"temperature": float("nan")}, {"sampling_options": {"temperature": float("nan")}}),
    ({"top_p": 1.5}, {"sampling_options": {"top_p": 1.5}}),
    ({"min_p": -0.1}, {"sampling_options": {"min_p": -0.1}}),
    ({"presence_penalty": 3.0}, {"sampling_options": {"presence_penalty": 3.0}}),
    ({"frequency_penalty": -2.5}, {"sampling_options": {"frequency_penalty": -2.5}}),
    ({"repetition_penalty": -1.0}, {"sampling_options": {"repetition_penalty": -1.0}}),
    ({"logprobs": 2**31}, {"output_options": {"logprobs": 2**31}}),
    ({"max_tokens": -1}, {"stop_conditions": {"max_tokens": -1}}),
    ({"seed": 2**63}, {"sampling_options": {"seed": 2**63}}),
]


def conversion_error(dynamo: dict) -> str:
    with pytest.raises(InvalidArgument) as caught:
        build_generate_request(structure_request({"token_ids": [0], **dynamo}), "", "", DisaggregationMode.AGG)
    return str(caught.value)


@pytest.mark.parametrize(("kwargs", "dynamo"), REJECTED, ids=[next(iter(k)) for k, _ in REJECTED])
def test_sampling_params_refuse_what_the_conversion_refuses_with_its_text(kwargs, dynamo):
    expected = conversion_error(dynamo)
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(**kwargs)
    assert str(caught.value) == expected


def test_sampling_params_have_vllms_defaults_and_are_frozen():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.max_tokens, params.min_tokens, params.repetition_penalty) == (16, 0, 1.0)
    assert (params.logprobs, params.prompt_logprobs, params.skip_special_tokens) == (None, None, True)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # type: ignore[misc]  # keyword-only, as vLLM's


def test_sampling_params_map_to_the_request_vllm_receives():
    params = SamplingParams(
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        seed=7,
        stop="END",
        stop_token_ids=[9],
        max_tokens=4,
        min_tokens=2,
        logprobs=3,
        skip_special_tokens=False,
    )
    message = build_generate_request(params.request([1, 2]), "r", "m", DisaggregationMode.AGG).message
    assert list(message.token_ids.ids) == [1, 2]
    assert (message.temperature, message.sampling.top_k, message.sampling.top_p, message.sampling.seed) == (
        0.0,
        5,
        0.5,
        7,
    )
    assert (list(message.stopping.stop_strings), list(message.stopping.stop_token_ids)) == (["END"], [9])
    assert (message.stopping.max_new_tokens, message.stopping.min_new_tokens) == (4, 2)
    assert message.response.output_candidates.top_n == 3
    assert message.response.skip_special_tokens is False
    assert params.stop == ("END",) and params.stop_token_ids == (9,)


def test_a_text_prompt_is_sent_as_text():
    built = build_generate_request(SamplingParams().request([]), "r", "m", DisaggregationMode.AGG, text="Hi")
    assert built.message.WhichOneof("prompt") == "text" and built.message.text == "Hi"
    assert built.prompt_tokens == 0


def test_the_builder_joins_deltas_into_the_completion_with_vllms_names():
    builder = CompletionBuilder("r-1", [1, 2])
    first = builder.add(LLMEngineOutput(token_ids=[10], text="a", log_probs=[-0.5], top_logprobs=[[]]))
    assert builder.add(LLMEngineOutput(token_ids=[], text="")) is None  # nothing new: no delta
    final = LLMEngineOutput(
        token_ids=[11],
        text="b",
        log_probs=[-1.0],
        top_logprobs=[[TopLogprob(rank=1, token_id=12, logprob=-0.25)]],
        finish_reason="cancelled",
        completion_usage=CompletionUsage.of(2, 2),
    )
    last = builder.add(final)
    assert first is not None and last is not None
    assert (first.text, first.token_ids, last.token_ids) == ("a", (10,), (11,))
    completion = builder.completion
    assert completion is not None
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("ab", (10, 11), "abort")
    assert completion.logprobs == ({10: Logprob(-0.5)}, {11: Logprob(-1.0), 12: Logprob(-0.25, 1)})
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (2, 2)
    assert completion.prompt_token_ids == (1, 2)


def test_structured_outputs_map_to_vllms_constraint_and_refuse_two_with_the_conversions_text():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for constraint, field, value in [
        (StructuredOutputs(json=schema), "json", '{"type":"object","properties":{"a":{"type":"integer"}}}'),
        (StructuredOutputs(json='{"type": "object"}'), "json", '{"type":"object"}'),
        (StructuredOutputs(regex="[0-9]+"), "regex", "[0-9]+"),
        (StructuredOutputs(grammar="root ::= 'x'"), "grammar", "root ::= 'x'"),
    ]:
        params = SamplingParams(structured_outputs=constraint)
        message = build_generate_request(params.request([1]), "r", "m", DisaggregationMode.AGG).message
        assert getattr(message.decoding, field) == value
    params = SamplingParams(structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    message = build_generate_request(params.request([1]), "r", "m", DisaggregationMode.AGG).message
    assert list(message.decoding.choice.choices) == ["yes", "no"]
    expected = conversion_error({"sampling_options": {"guided_decoding": {"regex": "x", "choice": ["a"]}}})
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(structured_outputs=StructuredOutputs(regex="x", choice=["a"]))
    assert str(caught.value) == expected == "only one structured output constraint may be set"
    with pytest.raises(InvalidArgument, match="structured_outputs.json must be a JSON schema"):
        SamplingParams(structured_outputs=StructuredOutputs(json="{not json"))
