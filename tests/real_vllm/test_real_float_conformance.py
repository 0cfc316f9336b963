"""The real vLLM 0.32 server still answers bad float sampling values as measured (docs/conformance.md).

The table (``tests/vllm_float_table.py``) is what the sidecar and the mock reproduce
(``trio_sidecar/core/sampling_checks.py``, checked by ``tests/unit/test_sampling_checks.py``); these tests send
each row to the real server over the binary protocol (which carries NaN and ±inf, unlike JSON) and fail
when vLLM answers differently.
"""

from __future__ import annotations

import pytest
from real_vllm_client import open_direct_channel
from real_vllm_helpers import collect, generate_request, unique_id
from real_vllm_server import MAX_MODEL_LEN
from vllm_float_table import BAD, LOGIT_BIASES, ORDER, TABLE

from trio_sidecar.core.sampling_checks import sampling_error
from trio_sidecar.core.status import StatusCode


def set_field(message, field: str, value: float) -> None:
    if field == "temperature":
        message.temperature = value
    elif field in ("top_p", "min_p"):
        setattr(message.sampling, field, value)
    else:
        setattr(message.decoding, field, value)


@pytest.fixture
async def channel(real_server):
    async with open_direct_channel(real_server.host, real_server.grpc_port) as channel:
        yield channel


async def answer(channel, message) -> str | None:
    """The server's rejection text (asserting INVALID_ARGUMENT), or None when it generated the tokens."""
    outcome = await collect(channel, message)
    if outcome.error is None:
        assert len(outcome.tokens()) == message.stopping.max_new_tokens
        return None
    assert outcome.code == StatusCode.INVALID_ARGUMENT, (outcome.code, outcome.message)
    assert outcome.phase == "open" and outcome.messages == []
    return outcome.message


@pytest.mark.parametrize(("field", "value", "expected"), TABLE, ids=[f"{f}={v!r}" for f, v, _ in TABLE])
async def test_real_server_answers_each_float_value_as_measured(channel, field, value, expected):
    message = generate_request(unique_id("float"), max_new_tokens=2)
    set_field(message, field, value)
    assert await answer(channel, message) == expected
    assert sampling_error(message) == expected  # what the sidecar and the mock answer


@pytest.mark.parametrize("first", range(len(ORDER)), ids=ORDER)
async def test_real_server_reports_the_first_bad_float_in_the_measured_order(channel, first):
    message = generate_request(unique_id("order"), max_new_tokens=2)
    for field in ORDER[first:]:
        set_field(message, field, BAD[field])
    got = await answer(channel, message)
    assert got is not None and got.startswith(f"{ORDER[first]} must be")
    assert sampling_error(message) == got


async def test_real_server_never_checks_logit_bias_values(channel):
    message = generate_request(unique_id("bias"), max_new_tokens=2)
    for token, bias in enumerate(LOGIT_BIASES, start=10):
        message.decoding.logit_bias[token] = bias
    assert await answer(channel, message) is None
    assert sampling_error(message) is None


# Checks vLLM runs before the float ones (the mock keeps this order; its texts for the first two differ by
# design, docs/conformance.md).
EARLIER = {
    "empty stop string": (lambda m: m.stopping.stop_strings.append(""), "stop strings cannot be empty"),
    "min_tokens above max_tokens": (lambda m: setattr(m.stopping, "min_new_tokens", 5), "`min_tokens` must be"),
    "prompt too long": (lambda m: m.token_ids.ids.extend([5] * MAX_MODEL_LEN), "this model's maximum context length"),
}


@pytest.mark.parametrize("earlier", list(EARLIER))
async def test_real_server_runs_the_float_checks_after_stopping_and_context_checks(channel, earlier):
    make_bad, text = EARLIER[earlier]
    message = generate_request(unique_id("earlier"), max_new_tokens=2)
    message.temperature = float("nan")
    make_bad(message)
    got = await answer(channel, message)
    assert got is not None and text in got, got
