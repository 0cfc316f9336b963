"""Scripted completions (docs/reference/mock.md#scripted-completions): a matching prompt is answered with the
script's text, tokenized with the model's tokenizer, ended by the model's EOS as vLLM reports it, and the text
of each message is what vLLM's incremental detokenizer sends."""

from __future__ import annotations

from pathlib import Path

import pytest
from mock_helpers import FinishReason, collect, gen, running_mock

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.mock import MockConfig
from trio_sidecar.mock.config import MockConfigError, prepare_config
from trio_sidecar.mock.engine_args import EngineArgsError, engine_args_from_mapping
from trio_sidecar.mock.scripted import load_scripts
from trio_sidecar.mock.tiny_model import make_tiny_model

TOOL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
UNICODE = "<think>héllo 世界</think>done"
SCRIPTS = [{"prompt_contains": "weather", "text": TOOL}, {"text": UNICODE}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers")
    return make_tiny_model(tmp_path_factory.getbasetemp() / "tiny-model")


@pytest.fixture(scope="module")
def scripts(model):
    return load_scripts([(e.get("prompt_contains", ""), e["text"]) for e in SCRIPTS], str(model))


def _prompt(scripts, text: str) -> list[int]:
    return list(scripts.tokenizer.encode(text, add_special_tokens=False).ids)


def _text(out, split: int = 1) -> str:
    """The texts of messages of ``split`` tokens each, then the flush, as the server sends them."""
    detok = out.detokenizer()
    pieces = [detok.step(out.tokens[i : i + split]) for i in range(0, len(out.tokens), split)]
    return "".join(pieces) + detok.finish()


def test_the_first_matching_script_answers_and_ends_with_the_eos(scripts):
    out = scripts.match(_prompt(scripts, "user: the weather\nassistant: "), max_tokens=500)
    assert out.script.text == TOOL
    assert out.finish_reason == FinishReason.STOP and out.eos_token_id == 1 and out.stop_token_id is None
    assert out.tokens[-1] == 1 and all(t != 1 for t in out.tokens[:-1])
    assert _text(out) == TOOL == _text(out, split=7)
    other = scripts.match(_prompt(scripts, "anything else"), max_tokens=500)
    assert other.script.text == UNICODE and _text(other) == UNICODE


def test_a_character_split_across_tokens_is_held_back_until_complete(scripts):
    out = scripts.match([5], max_tokens=500)
    detok = out.detokenizer()
    texts = [detok.step((t,)) for t in out.tokens]
    assert "" in texts[1:-1]  # the pieces of 世 and 界 wait for their last byte
    assert not any("\ufffd" in t for t in texts)
    assert "".join(texts) + detok.finish() == UNICODE


def test_max_tokens_cuts_the_script_with_length_and_flushes_what_is_held_back(scripts):
    full = scripts.match([5], max_tokens=500)
    cut = next(n for n in range(1, len(full.tokens)) if "\ufffd" in scripts.tokenizer.decode(list(full.tokens[:n])))
    out = scripts.match([5], max_tokens=cut)
    assert out.finish_reason == FinishReason.LENGTH and out.tokens == full.tokens[:cut]
    assert _text(out) == scripts.tokenizer.decode(list(full.tokens[:cut]))
    assert _text(out).endswith("\ufffd")


def test_ignore_eos_and_min_tokens_make_the_eos_an_ordinary_token(scripts):
    length = len(scripts.match([5], max_tokens=500).tokens)
    out = scripts.match([5], max_tokens=length + 3, ignore_eos=True)
    assert out.finish_reason == FinishReason.LENGTH and len(out.tokens) == length + 3
    assert out.tokens[length - 1] == 1 and _text(out).startswith(UNICODE)  # the EOS' text is skipped
    kept = scripts.match([5], max_tokens=length + 3, min_tokens=length, skip_special_tokens=False)
    assert _text(kept).startswith(UNICODE + "</s>")
    assert scripts.match([5], max_tokens=length * 3, min_tokens=length).finish_reason == FinishReason.STOP


def test_a_stop_token_id_ends_the_script_without_its_text(scripts):
    full = scripts.match(_prompt(scripts, "weather"), max_tokens=500)
    stop = full.tokens[3]
    out = scripts.match(_prompt(scripts, "weather"), max_tokens=500, stop_token_ids=[stop])
    assert out.finish_reason == FinishReason.STOP and out.stop_token_id == stop and out.tokens == full.tokens[:4]
    assert _text(out) == scripts.tokenizer.decode(list(full.tokens[:3]))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("x", "must be a list of objects with a 'text'"),
        ([{"prompt_contains": "a"}], "entries must be objects with a string 'text'"),
        ([{"text": "a", "when": "b"}], "take 'prompt_contains' and 'text', not 'when'"),
        ([{"text": "a", "prompt_contains": 3}], "'prompt_contains' must be a string"),
    ],
)
def test_bad_scripts_are_engine_arg_errors(value, message):
    with pytest.raises(EngineArgsError, match=message):
        engine_args_from_mapping({"scripted_completions": value})


def test_scripts_need_the_models_tokenizer(tmp_path):
    config = MockConfig(model=str(tmp_path), engine_args={"scripted_completions": [{"text": "a"}]})
    with pytest.raises(MockConfigError, match=r"cannot load .*tokenizer\.json"):
        prepare_config(config)


async def test_the_server_streams_the_script_with_vllms_terminal(model, scripts):
    prompt = _prompt(scripts, "user: the weather\nassistant: ")
    async with running_mock(model=str(model), engine_args={"scripted_completions": SCRIPTS}) as (_, channel):
        messages = await collect(channel, gen("s1", prompt, max_new_tokens=500, stop_token_ids=[1]))
        unary = await channel.unary_unary(
            "/vllm.Inference/Generate", gen("s2", prompt, max_new_tokens=500), pb.GenerateResponse
        )
    outputs = [m.outputs for m in messages if m.HasField("outputs")]
    assert "".join(o.text for o in outputs) == TOOL == unary.outputs.text
    finish = outputs[-1].finish_info
    assert finish.finish_reason == FinishReason.STOP and finish.WhichOneof("stop_reason") == "eos_token_id"
    assert finish.eos_token_id == 1 and finish.num_output_tokens == len(outputs)
    assert list(unary.outputs.token_ids) == [t for o in outputs for t in o.token_ids]
