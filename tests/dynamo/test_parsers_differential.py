"""Dynamo's tool-call and reasoning parsers through ``dynamo.frontend``: trio-sidecar against the native 1.6.1
sidecar, both started with ``--dyn-tool-call-parser hermes --dyn-reasoning-parser deepseek_r1``.

One mock answers both sides with scripted completions (docs/reference/mock.md#scripted-completions): a prompt
about the weather gets a Hermes ``<tool_call>`` block after a ``<think>`` block, a prompt asking for a list
gets the JSON array Dynamo expects for ``tool_choice: required``, any other prompt a ``<think>`` block and an
answer. Each side has its own frontend (``--namespace``). For each request we compare what a client reads
(``choices[0].message`` with ``tool_calls`` and ``reasoning_content``, finish reasons, usage; the streamed
deltas folded), the ``GenerateRequest`` each sidecar sent to the mock, and the model cards. The markers are
single added tokens there, as in real tool-calling models; a second deployment serves the stock tiny model
(markers spelled byte by byte) with the tool-call parser alone.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.parse
from pathlib import Path

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, start_pair

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

PARSERS = ("--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "deepseek_r1")
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
SCRIPTS = [
    {"prompt_contains": "weather", "text": f"<think>The user wants the weather.</think>\n{TOOL_CALL}"},
    {"prompt_contains": "list", "text": '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'},
    {"text": "<think>Two and two make four.</think>The answer is 4."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# Ids the frontend makes up per request (response ids, tool-call ids).
_RANDOM_ID = re.compile(r"^(chatcmpl-|call-|call_).*")


MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def marker_model(tiny_model: Path, directory: Path) -> Path:
    """The tiny model with the parsers' markers as single, non-special added tokens, as in the models these
    parsers are made for (Qwen, Hermes, DeepSeek-R1). The tiny model itself spells them with several
    byte-level tokens, and the frontend's reasoning parser does not find a ``</think>`` cut across the
    chunks of one token each that both sidecars send (docs/reference/worker.md#parsers)."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(tiny_model, directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="module")
def parser_pair(deployment_factory, tiny_model, tmp_path_factory):
    dep = deployment_factory()
    model = marker_model(tiny_model, tmp_path_factory.mktemp("markers") / "tiny-markers")
    mock = dep.mock(
        model=str(model), served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "scripted_completions": SCRIPTS}
    )
    return start_pair(dep, {"native": (PARSERS,), "trio": (PARSERS,)}, [mock])


def _without_ids(value):
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("created",) and not _is_random_id(k, v)}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _is_random_id(key: str, value: object) -> bool:
    return key == "id" and isinstance(value, str) and bool(_RANDOM_ID.match(value))


def _sent(mock, body_id: str) -> dict:
    from google.protobuf.json_format import MessageToDict

    request_id = body_id.split("-", 1)[1]
    found = [req for _, req, _, _ in mock.recorded() if req.request_id == request_id]
    assert len(found) == 1, f"{len(found)} requests recorded for {request_id}"
    sent = MessageToDict(found[0], preserving_proto_field_name=True)
    # Native 1.6.1 negates priority and defaults temperature (post-stack upstream changes; docs/dynamo.md).
    for key in ("request_id", "priority", "temperature"):
        sent.pop(key, None)
    return sent


def _chat(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 200, **extra}


def _both(pair, payload: dict) -> tuple[dict, dict]:
    results = pair.post("/v1/chat/completions", payload)
    (n_status, native), (t_status, trio) = results["native"], results["trio"]
    assert n_status == 200, native
    assert t_status == 200, trio
    return native, trio


def test_a_tool_call_comes_back_as_tool_calls_as_with_the_native_sidecar(parser_pair):
    (mock,) = parser_pair.mocks
    native, trio = _both(parser_pair, _chat("what is the weather in Paris?", tools=TOOLS, tool_choice="auto"))
    assert _without_ids(trio) == _without_ids(native)
    assert _sent(mock, trio["id"]) == _sent(mock, native["id"])
    choice = trio["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert choice["message"]["reasoning_content"] == "The user wants the weather."
    assert choice["finish_reason"] == "tool_calls"
    assert "<tool_call>" not in (choice["message"].get("content") or "")


def test_reasoning_content_is_split_from_the_answer_as_with_the_native_sidecar(parser_pair):
    (mock,) = parser_pair.mocks
    native, trio = _both(parser_pair, _chat("what is two and two?"))
    assert _without_ids(trio) == _without_ids(native)
    assert _sent(mock, trio["id"]) == _sent(mock, native["id"])
    message = trio["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two make four."
    assert message["content"] == "The answer is 4."
    assert trio["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("content", "tool_choice"),
    [
        ("give me the list", "required"),
        ("what is the weather in Paris?", {"type": "function", "function": {"name": "get_weather"}}),
        ("what is the weather in Paris?", "none"),
    ],
    ids=["required", "named", "none"],
)
def test_tool_choice_is_forwarded_and_answered_as_by_the_native_sidecar(parser_pair, content, tool_choice):
    """``required`` and a named function become guided decoding (a JSON schema) in the vLLM request."""
    (mock,) = parser_pair.mocks
    native, trio = _both(parser_pair, _chat(content, tools=TOOLS, tool_choice=tool_choice))
    assert _without_ids(trio) == _without_ids(native)
    sent = _sent(mock, trio["id"])
    assert sent == _sent(mock, native["id"])
    assert ("json" in sent.get("decoding", {})) == (tool_choice != "none")


def _fold(chunks: list[dict]) -> dict:
    """What a streaming client assembles: content, reasoning, tool calls by index, finish reasons, usage."""
    content, reasoning, calls, finishes, usage = [], [], {}, [], []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
            for call in delta.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], {"name": "", "arguments": "", "type": None})
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
                entry["type"] = call.get("type") or entry["type"]
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
        if chunk.get("usage"):
            usage.append(chunk["usage"])
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "calls": calls,
        "finishes": finishes,
        "usage": usage,
    }


@pytest.mark.parametrize(
    "payload",
    [
        _chat("what is the weather in Paris?", tools=TOOLS, tool_choice="auto"),
        _chat("what is two and two?"),
    ],
    ids=["tool call", "reasoning"],
)
def test_streamed_tool_calls_and_reasoning_match_the_native_sidecar(parser_pair, payload):
    streams = parser_pair.stream(
        "/v1/chat/completions", {**payload, "stream": True, "stream_options": {"include_usage": True}}
    )
    native, trio = _fold(streams["native"]), _fold(streams["trio"])
    assert trio == native
    if "tools" in payload:
        assert trio["calls"][0]["name"] == "get_weather"
        assert json.loads(trio["calls"][0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
        assert trio["finishes"] == ["tool_calls"]
    else:
        assert (trio["reasoning"], trio["content"]) == ("Two and two make four.", "The answer is 4.")


def test_the_configured_parsers_are_registered_like_the_native_sidecar(parser_pair):
    dep = parser_pair.dep
    cards = {}
    for path in (dep.file_kv / "v1" / "mdc").glob("*"):
        name = urllib.parse.unquote(path.name)
        side = "native" if f"{dep.namespace}-native/" in name else "trio"
        cards[side] = json.loads(path.read_text())["card_json"]["runtime_config"]
    assert cards["trio"] == cards["native"]
    assert (cards["trio"]["tool_call_parser"], cards["trio"]["reasoning_parser"]) == ("hermes", "deepseek_r1")


def test_the_markers_survive_vllms_special_token_skipping(parser_pair):
    """The markers are added tokens that are not special (as in the models the parsers are made for), so the
    text vLLM sends with its default ``skip_special_tokens`` keeps them; neither sidecar asks otherwise."""
    (mock,) = parser_pair.mocks
    payload = {"model": "tiny", "prompt": "the weather", "max_tokens": 200}
    status, body = local.post_json(parser_pair.ports["trio"], "/v1/completions", payload)
    assert status == 200, body
    assert body["choices"][0]["text"] == f"<think>The user wants the weather.</think>\n{TOOL_CALL}"
    sent = _sent(mock, body["id"])
    assert sent.get("response", {}).get("skip_special_tokens") is None


@pytest.fixture(scope="module")
def hermes_pair(deployment_factory):
    """The stock tiny model (``<tool_call>`` spelled byte by byte) and a tool-call parser only."""
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "scripted_completions": SCRIPTS})
    args = ("--dyn-tool-call-parser", "hermes")
    return start_pair(dep, {"native": (args,), "trio": (args,)}, [mock])


def test_a_marker_spelled_with_many_tokens_still_gives_tool_calls_as_with_the_native_sidecar(hermes_pair):
    (mock,) = hermes_pair.mocks
    payload = _chat("what is the weather in Paris?", tools=TOOLS, tool_choice="auto")
    native, trio = _both(hermes_pair, payload)
    assert _without_ids(trio) == _without_ids(native)
    assert _sent(mock, trio["id"]) == _sent(mock, native["id"])
    message = trio["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["content"] == "<think>The user wants the weather.</think>\n"  # no reasoning parser
    streams = hermes_pair.stream("/v1/chat/completions", {**payload, "stream": True})
    assert _fold(streams["trio"]) == _fold(streams["native"])
    assert _fold(streams["trio"])["finishes"] == ["tool_calls"]


def test_an_unknown_tool_call_parser_fails_the_registration_as_with_the_native_sidecar(deployment_factory):
    """Dynamo's registration rejects the name (exit 1 after discovery); an unknown reasoning parser is kept."""
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args=FAST_ENGINE_ARGS)
    procs = {
        "native": dep.native_sidecar(mock, "--dyn-tool-call-parser", "nonsense", name="native-bad-parser"),
        "trio": dep.trio_sidecar(mock, "--dyn-tool-call-parser", "nonsense", name="trio-bad-parser"),
    }
    for side, proc in procs.items():
        assert proc.wait(120) == 1, f"{side}: {proc.log()[-2000:]}"
        assert "tool_call_parser 'nonsense' is not supported; available parsers:" in proc.log(), side
