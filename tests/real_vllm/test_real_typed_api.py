"""The typed API against the real vLLM 0.32 CPU server (docs/embedded.md): a text prompt and a token-id prompt
through ``Sidecar.complete`` and ``Sidecar.stream`` give exactly the text, token ids, finish reason and usage
of vLLM's own OpenAI server (the same engine's ``/v1/completions``) for the same greedy request.

The real server advertises ``supports_text_input``, so a text prompt is sent as text; the last test makes
the sidecar take the other path (tokenize locally with the model directory's tokenizer, ``model_id``) and
gets the same answer, so the local tokenization is vLLM's. ``StructuredOutputs`` constrain the engine's
output (a choice, a regular expression).
"""

from __future__ import annotations

import http.client
import json
import re
from typing import Any

import pytest
import trio
from real_vllm_server import SERVED_MODEL_NAME

from trio_sidecar import SamplingParams, SidecarConfig, StructuredOutputs, open_sidecar

PROMPTS = ["The quick brown fox jumps over", "Structured concurrency means"]
MAX_TOKENS = 12
TIMEOUT_S = 120.0


def openai_completion(port: int, prompt: str | list[int]) -> dict[str, Any]:
    """vLLM's own answer: greedy ``/v1/completions`` with the output tokens as ids."""
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    assert response.status == 200, raw[:500]
    answer = json.loads(raw)
    choice = answer["choices"][0]
    return {
        "text": choice["text"],
        "token_ids": tuple(int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]),
        "finish_reason": choice["finish_reason"],
        "usage": (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]),
    }


def typed(completion) -> dict[str, Any]:
    return {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "usage": (completion.usage.prompt_tokens, completion.usage.completion_tokens),
    }


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def sidecar_config(server) -> SidecarConfig:
    return SidecarConfig(grpc_endpoint=server.endpoint, grpc_connections=2, startup_deadline=120.0)


async def reference(server, prompt: str | list[int]) -> dict[str, Any]:
    http_port = getattr(server, "http_port", None)
    assert http_port is not None, "vLLM's HTTP port is unknown (attach with PORT,HTTP_PORT:LOG_PATH)"
    return await trio.to_thread.run_sync(openai_completion, http_port, prompt)


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_a_text_prompt_gives_exactly_vllms_openai_completion(real_server, prompt):
    expected = await reference(real_server, prompt)
    with trio.fail_after(TIMEOUT_S):
        async with open_sidecar(sidecar_config(real_server)) as sidecar:
            assert sidecar.model.model_info.supports_text_input
            completion = await sidecar.complete(prompt, GREEDY)
            async with sidecar.stream(prompt, GREEDY) as stream:
                deltas = [delta async for delta in stream]
    assert expected["token_ids"], expected
    assert typed(completion) == expected
    assert typed(stream.completion) == expected
    assert "".join(d.text for d in deltas) == expected["text"]
    assert tuple(t for d in deltas for t in d.token_ids) == expected["token_ids"]


async def test_a_token_id_prompt_gives_exactly_vllms_openai_completion(real_server):
    prompt = [0, 55, 75, 72, 328, 317, 224]  # (the tiny model has 366 tokens)
    expected = await reference(real_server, prompt)
    with trio.fail_after(TIMEOUT_S):
        async with open_sidecar(sidecar_config(real_server)) as sidecar:
            completion = await sidecar.complete(prompt, GREEDY)
    assert typed(completion) == expected
    assert completion.prompt_token_ids == tuple(prompt)


async def test_a_text_prompt_tokenized_locally_gives_the_same_completion(real_server):
    prompt = PROMPTS[0]
    expected = await reference(real_server, prompt)
    with trio.fail_after(TIMEOUT_S):
        async with open_sidecar(sidecar_config(real_server)) as sidecar:
            # As a server without text input: the sidecar tokenizes with the model's tokenizer (model_id).
            sidecar.model.model_info.supports_text_input = False
            completion = await sidecar.complete(prompt, GREEDY)
    assert completion.prompt_token_ids is not None and len(completion.prompt_token_ids) == expected["usage"][0]
    assert typed(completion) == expected


async def test_structured_outputs_constrain_the_real_engines_output(real_server):
    # Without ignore_eos: once the constraint is satisfied only EOS is allowed and vLLM stops.
    choice = SamplingParams(
        max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputs(choice=["alpha", "beta"])
    )
    regex = SamplingParams(
        max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputs(regex="(yes|no)[0-9]{3}")
    )
    with trio.fail_after(TIMEOUT_S):
        async with open_sidecar(sidecar_config(real_server)) as sidecar:
            chosen = await sidecar.complete(PROMPTS[0], choice)
            matched = await sidecar.complete(PROMPTS[1], regex)
    assert chosen.text in ("alpha", "beta") and chosen.finish_reason == "stop"
    assert re.fullmatch("(yes|no)[0-9]{3}", matched.text) and matched.finish_reason == "stop"
