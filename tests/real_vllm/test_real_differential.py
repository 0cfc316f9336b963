"""Native sidecar vs ``trio-sidecar run`` through ``dynamo.frontend``, both on the real vLLM 0.32 server.

Each sidecar runs behind its own ``python -m dynamo.frontend`` (file discovery in a private directory, one
namespace each, everything on 127.0.0.1), and both serve the shared real server (``real_server``). Every
row of ``ROWS`` goes to both frontends; compared are the HTTP status and what a client reads: the text
(byte for byte), finish reasons, usage and logprobs. Chunk boundaries and error wording may differ, so a
stream is folded first and an error body is compared by status only. For greedy rows the text must also
equal vLLM's own OpenAI server's (the real server's HTTP port). Rows with ``temperature > 0`` and no
``seed`` are deliberately random: only their status is compared, and the form of each answer checked.

Stop strings and stop token ids come from the greedy continuation of ``STOP_PROMPT`` on vLLM's server (the
tiny model's text is random bytes), so the rows stop inside the output whatever the weights are.

The whole module shares one pair of workers and frontends (module scope); every request has a socket
timeout, so no row can hang.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from real_vllm_server import MAX_MODEL_LEN, SERVED_MODEL_NAME

from trio_sidecar._devtools import local

HTTP_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 300.0
STOP_PROMPT = "hello world"
SIDES = ("native", "trio")


@attrs.frozen
class Row:
    name: str
    path: str
    body: dict[str, Any]
    stream: bool = False
    kind: str = "greedy"  # "greedy", "seeded", "random" (text exempt), "error" (status only)


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
TOO_LONG = "a " * (MAX_MODEL_LEN + 40)


def both(name: str, path: str, body: dict[str, Any], kind: str = "greedy") -> list[Row]:
    """The row unary and streamed (with usage in the stream)."""
    streamed = {**body, "stream_options": {"include_usage": True}}
    return [Row(name, path, body, False, kind), Row(f"{name} (stream)", path, streamed, True, kind)]


GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "seed": 1234, "top_p": 0.95, "top_k": 40}

ROWS: list[Row] = [
    # completions
    *both("greedy", COMPLETIONS, {"prompt": STOP_PROMPT, "max_tokens": 24, **GREEDY}),
    *both("greedy long", COMPLETIONS, {"prompt": "The quick brown fox", "max_tokens": 64, **GREEDY}),
    *both("greedy ignore_eos", COMPLETIONS, {"prompt": "abc", "max_tokens": 32, "ignore_eos": True, **GREEDY}),
    *both("seeded", COMPLETIONS, {"prompt": "once upon a time", "max_tokens": 24, **SEEDED}, "seeded"),
    *both(
        "seeded penalties",
        COMPLETIONS,
        {
            "prompt": "once upon a time",
            "max_tokens": 24,
            "temperature": 1.0,
            "seed": 7,
            "min_p": 0.05,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
            "repetition_penalty": 1.2,
        },
        "seeded",
    ),
    *both("stop string", COMPLETIONS, {"prompt": STOP_PROMPT, "max_tokens": 24, "stop": ["{STOP_STRING}"], **GREEDY}),
    *both(
        "stop token id",
        COMPLETIONS,
        {"prompt": STOP_PROMPT, "max_tokens": 24, "stop_token_ids": ["{STOP_ID}"], **GREEDY},
    ),
    *both("logprobs", COMPLETIONS, {"prompt": STOP_PROMPT, "max_tokens": 8, "logprobs": 2, **GREEDY}),
    Row("max_tokens 1", COMPLETIONS, {"prompt": "x", "max_tokens": 1, **GREEDY}),
    Row("random", COMPLETIONS, {"prompt": "once upon a time", "max_tokens": 16, "temperature": 1.0}, kind="random"),
    # chat
    *both("chat greedy", CHAT, {"messages": HELLO, "max_tokens": 24, **GREEDY}),
    *both("chat seeded", CHAT, {"messages": HELLO, "max_tokens": 24, **SEEDED}, "seeded"),
    *both("chat logprobs", CHAT, {"messages": HELLO, "max_tokens": 8, "logprobs": True, "top_logprobs": 3, **GREEDY}),
    *both("chat stop string", CHAT, {"messages": HELLO, "max_tokens": 24, "stop": ["{CHAT_STOP_STRING}"], **GREEDY}),
    *both(
        "chat json_schema",
        CHAT,
        {
            "messages": HELLO,
            "max_tokens": 32,
            **GREEDY,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": JSON_SCHEMA}},
        },
    ),
    Row(
        "chat json_object",
        CHAT,
        {"messages": HELLO, "max_tokens": 32, "response_format": {"type": "json_object"}, **GREEDY},
    ),
    Row("chat random", CHAT, {"messages": HELLO, "max_tokens": 16, "temperature": 1.0}, kind="random"),
    # rejected before any output: the status must be native's, streamed or not
    *both("n=2", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "n": 2}, "error"),
    *both("best_of=2", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "best_of": 2}, "error"),
    *both("min_tokens > max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "min_tokens": 10}, "error"),
    *both(
        "stop_token_ids outside the vocabulary",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [100000]},
        "error",
    ),
    *both("prompt longer than max_model_len", COMPLETIONS, {"prompt": TOO_LONG, "max_tokens": 4}, "error"),
    *both(
        "chat prompt longer than max_model_len",
        CHAT,
        {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 4},
        "error",
    ),
    *both("temperature 2.5", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "temperature": 2.5}, "error"),
    *both("temperature -1", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "temperature": -1}, "error"),
    Row(
        "temperature 1e39 (inf as f32)",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "temperature": 1e39},
        kind="error",
    ),
    Row(
        "temperature NaN (not JSON)",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "temperature": float("nan")},
        kind="error",
    ),
    *both("top_p 1.5", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "top_p": 1.5}, "error"),
    Row("min_p -1", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "min_p": -1}, kind="error"),
    Row("presence_penalty 3", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "presence_penalty": 3}, kind="error"),
    Row("frequency_penalty -3", COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "frequency_penalty": -3}, kind="error"),
    *both("repetition_penalty -1", CHAT, {"messages": HELLO, "max_tokens": 4, "repetition_penalty": -1}, "error"),
]


# ----------------------------------------------------------------------------------------------- plumbing


@attrs.frozen
class Answer:
    """What a client got: the status, and the body (JSON) or the folded stream."""

    status: int
    body: Any


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(local.LOOPBACK, port, timeout=HTTP_TIMEOUT_S)
    try:
        # allow_nan: the NaN row sends the non-JSON literal on purpose.
        conn.request("POST", path, body=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _events(raw: bytes) -> Iterator[Any]:
    for line in raw.splitlines():
        line = line.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data != b"[DONE]":
                yield json.loads(data)


def _fold(events: list[Any]) -> dict[str, Any]:
    """What a client reads from a stream, independent of chunk boundaries."""
    text: list[str] = []
    finishes, usage, errors, roles = [], [], [], []
    logprobs: dict[str, list] = {}
    for event in events:
        if "error" in event:
            errors.append(event["error"].get("code"))
            continue
        if event.get("usage"):
            usage.append(event["usage"])
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text.append(choice.get("text") or delta.get("content") or "")
            if delta.get("role"):
                roles.append(delta["role"])
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
            for key, value in (choice.get("logprobs") or {}).items():
                if isinstance(value, list):
                    logprobs.setdefault(key, []).extend(value)
    return {
        "text": "".join(text),
        "finish_reasons": finishes,
        "usage": usage,
        "logprobs": logprobs,
        "errors": errors,
        "roles": roles,
    }


def ask(port: int, row: Row, body: dict[str, Any]) -> Answer:
    status, raw = _post(port, row.path, {"model": SERVED_MODEL_NAME, **body, "stream": row.stream})
    if status == 200 and row.stream:
        return Answer(status, _fold(list(_events(raw))))
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    if isinstance(parsed, dict):
        parsed = {k: v for k, v in parsed.items() if k not in ("id", "created")}
    return Answer(status, parsed)


def text_of(answer: Answer, row: Row) -> str:
    if row.stream:
        return answer.body["text"]
    choice = answer.body["choices"][0]
    return choice["text"] if row.path == COMPLETIONS else choice["message"]["content"]


def finish_of(answer: Answer, row: Row) -> list[str]:
    if row.stream:
        return answer.body["finish_reasons"]
    return [choice["finish_reason"] for choice in answer.body["choices"]]


def usage_of(answer: Answer, row: Row) -> Any:
    return answer.body["usage"]


@attrs.frozen
class Pair:
    ports: dict[str, int]
    vllm_http_port: int | None
    substitutions: dict[str, Any]

    def resolve(self, body: Any) -> Any:
        """The row's body with ``{STOP_STRING}``-style placeholders replaced."""
        if isinstance(body, dict):
            return {k: self.resolve(v) for k, v in body.items()}
        if isinstance(body, list):
            return [self.resolve(v) for v in body]
        if isinstance(body, str) and re.fullmatch(r"\{[A-Z_]+\}", body):
            return self.substitutions[body[1:-1]]
        return body


def _vllm_greedy(http_port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, raw = _post(http_port, path, {"model": SERVED_MODEL_NAME, **body, **GREEDY})
    assert status == 200, raw[:500]
    return json.loads(raw)


def _stop_material(http_port: int | None) -> dict[str, Any]:
    """A stop string and a stop token id that occur inside the greedy continuations, from vLLM's server."""
    assert http_port is not None, "vLLM's HTTP port is unknown (attach with PORT,HTTP_PORT:LOG_PATH)"
    completion = _vllm_greedy(
        http_port,
        COMPLETIONS,
        {"prompt": STOP_PROMPT, "max_tokens": 24, "logprobs": 0, "return_tokens_as_token_ids": True},
    )
    choice = completion["choices"][0]
    ids = [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]
    chat = _vllm_greedy(http_port, CHAT, {"messages": HELLO, "max_tokens": 24})
    return {
        "STOP_STRING": _inner_substring(choice["text"]),
        # A token after the third, first seen there (so the stop is inside the output, not at its end).
        "STOP_ID": next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i]),
        "CHAT_STOP_STRING": _inner_substring(chat["choices"][0]["message"]["content"]),
    }


def _inner_substring(text: str) -> str:
    """Two printable ASCII characters at position 3 or later of ``text``."""
    for i in range(3, len(text) - 1):
        pair = text[i : i + 2]
        if all(32 < ord(c) < 127 for c in pair):
            return pair
    raise AssertionError(f"no printable pair in the greedy text {text!r}")


@pytest.fixture(scope="module")
def pair(real_server, tmp_path_factory) -> Iterator[Pair]:
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo 1.6.1 (frontend) is not installed")
    workdir = Path(tmp_path_factory.mktemp("real-differential"))
    env = local.dynamo_env(workdir / "file-kv")
    (workdir / "file-kv").mkdir()
    endpoint = f"{real_server.host}:{real_server.grpc_port}"
    processes: list[local.Process] = []
    ports: dict[str, int] = {}
    try:
        for side in SIDES:
            namespace = f"realdiff-{side}"
            frontend, ports[side] = local.start_frontend(workdir, env, namespace=namespace)
            processes.append(frontend)
            start = local.start_native_sidecar if side == "native" else local.start_trio_sidecar
            processes.append(start(workdir, env, endpoint, namespace=namespace, name=f"{side}-sidecar"))
        for port in ports.values():
            local.wait_for_models(port, [SERVED_MODEL_NAME], timeout=READY_TIMEOUT_S, watch=processes)
        http_port = getattr(real_server, "http_port", None)
        yield Pair(ports, http_port, _stop_material(http_port))
    finally:
        for proc in processes:
            proc.stop(grace=5.0)
        shutil.rmtree(workdir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- the rows


def test_the_matrix_is_large_enough():
    assert len(ROWS) >= 40
    assert len({row.name for row in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_trio_sidecar_answers_like_the_native_sidecar(pair, row):
    body = pair.resolve(row.body)
    answers = {side: ask(port, row, body) for side, port in pair.ports.items()}
    native, trio = answers["native"], answers["trio"]
    assert trio.status == native.status, (native, trio)
    if row.kind == "error":
        assert 400 <= native.status < 500, native
        return
    assert native.status == 200, native
    if row.kind == "random":  # exempt from comparison: only the answer's form is checked
        for answer in (native, trio):
            assert finish_of(answer, row) in (["stop"], ["length"]), answer
            usage = usage_of(answer, row)
            usage = usage[-1] if isinstance(usage, list) else usage
            assert 1 <= usage["completion_tokens"] <= row.body["max_tokens"], answer
        return
    assert finish_of(trio, row) == finish_of(native, row)
    assert usage_of(trio, row) == usage_of(native, row)
    assert text_of(trio, row).encode() == text_of(native, row).encode()
    assert trio.body == native.body  # logprobs, roles, errors in the stream, every other field
    if row.kind == "greedy":
        assert pair.vllm_http_port is not None, "vLLM's HTTP port is unknown"
        vllm = ask(pair.vllm_http_port, row, body)
        assert vllm.status == 200, vllm
        assert text_of(trio, row).encode() == text_of(vllm, row).encode()
        assert finish_of(trio, row) == finish_of(vllm, row)
