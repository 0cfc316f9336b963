"""The typed request API against the real mock over TCP (docs/embedded.md): text and token-id prompts,
``complete`` and ``stream`` with typed deltas and completions, logprobs, stopping, local tokenization when
the server does not take text, and the error that names the extra when it cannot.

The mock serves a tiny model directory with a tokenizer and seeds its tokens from the prompt
(``token_seed_source = "prompt"``), so a text prompt and its token ids give the same output exactly when
both sides tokenized the text alike.
"""

from __future__ import annotations

import sys

import pytest
import trio
from sidecar_fakes import FAST_ENGINE_ARGS, sidecar_config

from trio_sidecar import Completion, Delta, InvalidArgument, SamplingParams, StructuredOutputs, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server
from trio_sidecar.mock import config as mock_config_module
from trio_sidecar.mock.tiny_model import make_tiny_model
from trio_sidecar.shell.tokenizer import local_tokenizer

PROMPT = "Hello world, the quick fox"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def mock_config(model: str, **engine_args) -> MockConfig:
    args = {**FAST_ENGINE_ARGS, "token_seed_source": "prompt", **engine_args}
    return MockConfig(listen="127.0.0.1:0", model=model, served_model_name="tiny", engine_args=args)


async def wait_mock_idle(mock) -> None:
    with trio.fail_after(10):
        while mock.active_request_count():
            await trio.sleep(0.01)


async def test_a_text_prompt_is_sent_as_text_and_matches_its_token_ids(tiny_model):
    ids = local_tokenizer(tiny_model).encode(PROMPT)
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            assert sidecar.model.model_info.supports_text_input
            by_text = await sidecar.complete(PROMPT, GREEDY, request_id="by-text")
            by_ids = await sidecar.complete(ids, GREEDY, request_id="by-ids")
        sent = [request.WhichOneof("prompt") for _rpc, request, _m, _p in mock.recorded_requests]
        text_request = mock.recorded_requests[0][1]
    assert sent == ["text", "token_ids"]
    assert text_request.text == PROMPT
    assert isinstance(by_text, Completion)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 6
    assert by_text.text == by_ids.text and by_text.text
    assert (by_text.finish_reason, by_text.stop_reason) == ("length", None)
    assert (by_text.usage.prompt_tokens, by_text.usage.completion_tokens) == (len(ids), 6)
    assert by_text.usage.total_tokens == len(ids) + 6
    assert (by_text.prompt_token_ids, by_ids.prompt_token_ids) == (None, tuple(ids))
    assert (by_text.request_id, by_ids.request_id) == ("by-text", "by-ids")


async def test_stream_yields_typed_deltas_that_add_up_to_the_completion(tiny_model):
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            whole = await sidecar.complete(PROMPT, GREEDY)
            async with sidecar.stream(PROMPT, GREEDY) as stream:
                assert stream.completion is None
                deltas = [delta async for delta in stream]
                assert stream.completion is not None
                assert await stream.final() == stream.completion
    assert all(isinstance(d, Delta) for d in deltas)
    assert "".join(d.text for d in deltas) == stream.completion.text == whole.text
    assert tuple(t for d in deltas for t in d.token_ids) == stream.completion.token_ids == whole.token_ids
    assert all(d.logprobs is None for d in deltas)


async def test_logprobs_come_as_one_dict_per_token_when_asked(tiny_model):
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1)
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            completion = await sidecar.complete([11, 22, 33], params)
            plain = await sidecar.complete([11, 22, 33], SamplingParams(max_tokens=3, temperature=0.0))
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in position
        assert len(position) >= 2
        assert all(isinstance(lp.logprob, float) and lp.logprob <= 0.0 for lp in position.values())
    assert completion.prompt_logprobs is not None
    assert len(completion.prompt_logprobs) == 3 and completion.prompt_logprobs[0] is None
    assert 22 in completion.prompt_logprobs[1]


async def test_stop_ends_the_stream_with_abort_and_the_usage_taken(tiny_model):
    slow = mock_config(tiny_model, speedup_ratio=0.05)
    async with open_mock_server(slow) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            async with sidecar.stream([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True)) as stream:
                first = await stream.__anext__()
                stream.stop()
                rest = [delta async for delta in stream]
            completion = stream.completion
        await wait_mock_idle(mock)
    assert completion is not None and completion.finish_reason == "abort"
    taken = len(first.token_ids) + sum(len(d.token_ids) for d in rest)
    assert completion.usage.completion_tokens == taken < 500


async def test_a_text_prompt_is_tokenized_locally_when_the_server_does_not_take_text(tiny_model, monkeypatch):
    monkeypatch.setattr(mock_config_module, "_text_tokenizer", lambda model: None)  # a server without text input
    ids = local_tokenizer(tiny_model).encode(PROMPT)
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            assert not sidecar.model.model_info.supports_text_input
            by_text = await sidecar.complete(PROMPT, GREEDY)
            by_ids = await sidecar.complete(ids, GREEDY)
        [(_, first, _, _), _] = mock.recorded_requests
    assert first.WhichOneof("prompt") == "token_ids" and list(first.token_ids.ids) == ids
    assert (by_text.token_ids, by_text.text) == (by_ids.token_ids, by_ids.text)
    assert by_text.prompt_token_ids == tuple(ids)


async def test_without_text_input_or_tokenizers_a_text_prompt_fails_naming_the_extra(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            assert not sidecar.model.model_info.supports_text_input
            with pytest.raises(InvalidArgument, match=r"pip install 'trio-sidecar\[text\]'"):
                await sidecar.complete(PROMPT, GREEDY)
            assert (await sidecar.complete([1, 2, 3], GREEDY)).usage.prompt_tokens == 3
        assert len(mock.recorded_requests) == 1


async def test_a_model_without_a_local_tokenizer_fails_with_the_loaders_reason(monkeypatch):
    monkeypatch.setattr(mock_config_module, "_text_tokenizer", lambda model: None)
    config = MockConfig(listen="127.0.0.1:0", model="/nonexistent/model-dir", engine_args=FAST_ENGINE_ARGS)
    async with open_mock_server(config) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with pytest.raises(InvalidArgument, match="cannot load the tokenizer of model '/nonexistent/model-dir'"):
                await sidecar.complete(PROMPT, GREEDY)
        assert mock.recorded_requests == []


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "token_ids must not be empty"),
        ([1, -2], "invalid PreprocessedRequest: "),
        ([1, 2**32], "invalid PreprocessedRequest: "),
        (b"hello", "a prompt is a str or token ids, not bytes"),
    ],
)
async def test_bad_token_id_prompts_are_refused_before_sending(prompt, message, tiny_model):
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with pytest.raises(InvalidArgument, match=message):
                await sidecar.complete(prompt, GREEDY)
        assert mock.recorded_requests == []


async def test_vllm_refusals_reach_the_caller_with_vllms_text(tiny_model):
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with pytest.raises(InvalidArgument, match="stop strings cannot be empty"):
                await sidecar.complete([1, 2, 3], SamplingParams(stop=[""]))
            assert sidecar.engine.in_flight == 0


async def test_the_mock_accepts_structured_outputs_and_receives_the_constraint(tiny_model):
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    async with open_mock_server(mock_config(tiny_model)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            completion = await sidecar.complete([1, 2, 3], params)
        [(_, request, _, _)] = mock.recorded_requests
    assert list(request.decoding.choice.choices) == ["yes", "no"]
    assert len(completion.token_ids) == 3  # (the mock ignores the constraint)
