"""The mock's byte-level text mode (engine argument ``text_mode: "bytes"``): tokens are pieces of UTF-8 and
each message carries what vLLM's incremental detokenizer would send, ``""`` while a character is incomplete.
Over real sockets on 127.0.0.1 port 0.
"""

from __future__ import annotations

import pytest
from mock_helpers import GENERATE, FinishReason, collect, gen, running_mock, stream_tokens

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.mock.engine_args import EngineArgsError, TextMode, parse_engine_args
from trio_sidecar.mock.generation import ByteDetokenizer, prompt_token_seed, token_at, token_bytes

BYTES = {"text_mode": "bytes", "token_seed_source": "prompt"}


def test_text_mode_is_an_engine_argument_defaulting_to_tags():
    assert parse_engine_args(None).text_mode is TextMode.TAGS
    assert parse_engine_args('{"text_mode": "Bytes"}').text_mode is TextMode.BYTES
    with pytest.raises(EngineArgsError, match="engine arg 'text_mode' must be one of: tags, bytes"):
        parse_engine_args('{"text_mode": "utf8"}')


def test_the_detokenizer_holds_back_incomplete_characters_and_flushes_them_at_the_finish():
    lead, cont, cjk = 3, 5 + (0x24 << 3), 4  # b"\xc3", b"\xa4", b"\xe4\xb8"
    assert (token_bytes(lead), token_bytes(cont), token_bytes(cjk)) == (b"\xc3", b"\xa4", b"\xe4\xb8")
    detok = ByteDetokenizer()
    assert detok.step([lead]) == ""  # held back: "\xc3" alone is an incomplete character
    assert detok.step([cont]) == "\u00e4"  # completed: "ä"
    assert detok.step([cjk]) == ""
    assert detok.step([cjk]) == ""  # still ends with U+FFFD: held back
    assert detok.step([cont]) == "\ufffd\u4e24"  # the first sequence was invalid, the second completes
    assert detok.step([cont]) == ""  # a stray continuation byte: held back, more bytes could follow
    assert detok.step([0]) == "\ufffda"
    assert detok.step([lead]) == "" and detok.finish() == "\ufffd"  # the finish flushes the incomplete tail
    assert detok.finish() == ""


def _prompt_with_held_back_text(n: int) -> list[int]:
    """A prompt whose n output tokens (``token_seed_source: "prompt"``, seed 42) start a character that a
    later token completes, so some message carries "" and a later one the whole character."""
    for first in range(1, 500):
        prompt = [first, 2, 3]
        seed = prompt_token_seed(42, prompt)
        tokens = [token_at(seed, p) for p in range(n)]
        detok = ByteDetokenizer()
        texts = [detok.step([t]) for t in tokens[:-1]]
        if "" in texts[:-1] and any(ord(c) > 0x7F and c != "\ufffd" for c in "".join(texts)):
            return prompt
    raise AssertionError("no such prompt")


async def test_streamed_texts_are_the_detokenizers_and_concatenate_to_the_bytes_decoded():
    prompt = _prompt_with_held_back_text(16)
    async with running_mock(engine_args=BYTES) as (_mock, ch):
        messages = [m for m in await collect(ch, gen("b", prompt=prompt, max_new_tokens=16)) if m.HasField("outputs")]
        tokens = [t for m in messages for t in m.outputs.token_ids]
        texts = [m.outputs.text for m in messages]
        assert len(tokens) == 16 and len(messages) == 16
        assert "" in texts[:-1]  # a message whose character is incomplete carries no text
        held = texts.index("")
        assert any(texts[held + 1 :])  # a later one carries the completed character
        whole = b"".join(token_bytes(t) for t in tokens).decode("utf-8", "replace")
        assert "".join(texts) == whole
        assert any(ord(c) > 0x7F and c != "\ufffd" for c in whole)
        assert messages[-1].outputs.finish_info.finish_reason == FinishReason.LENGTH
        # Deterministic: the same prompt under another request id gives the same texts.
        again = [
            m.outputs.text
            for m in await collect(ch, gen("c", prompt=prompt, max_new_tokens=16))
            if m.HasField("outputs")
        ]
        assert again == texts
        unary = await ch.unary_unary(GENERATE, gen("u", prompt=prompt, max_new_tokens=16), pb.GenerateResponse)
        assert unary.outputs.text == whole


async def test_the_default_text_mode_keeps_the_token_tags():
    async with running_mock(engine_args={"token_seed_source": "prompt"}) as (_mock, ch):
        messages = [m for m in await collect(ch, gen("t", max_new_tokens=3)) if m.HasField("outputs")]
        assert [m.outputs.text for m in messages] == [f"<token:{t}>" for m in messages for t in m.outputs.token_ids]


async def test_words_text_mode_gives_each_token_its_tiny_model_word():
    from trio_sidecar.mock.tiny_model import word_text

    async with running_mock(engine_args={"text_mode": "words"}) as (_mock, channel):
        messages = await collect(
            channel, gen("w", max_new_tokens=5, response=pb.ResponseOptions(output_token_ids=True))
        )
        tokens = stream_tokens(messages)
        assert len(tokens) == 5
        texts = [m.outputs.text for m in messages if m.HasField("outputs")]
        assert texts == [word_text(t) for t in tokens]
        unary = await channel.unary_unary(GENERATE, gen("w", max_new_tokens=5), pb.GenerateResponse)
        assert unary.outputs.text == "".join(word_text(t) for t in tokens)
