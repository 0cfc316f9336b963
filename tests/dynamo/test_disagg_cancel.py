"""Decode-mode cancellation through Dynamo, end to end (docs/reference/sidecar.md#decode-deferral, docs/reference/sidecar.md#abort-after-abandoning-a-stream,
docs/reference/sidecar.md#cancellation-signals).

One disaggregated deployment on 127.0.0.1: a prefill mock and a decode mock (in-process, :class:`MockThread`),
a ``trio-sidecar run --disaggregation-mode prefill`` worker and a ``--disaggregation-mode decode`` worker (both
with the default ``abort_on_cancel``), and one ``python -m dynamo.frontend``. The frontend sends every request
to the prefill worker first (``max_new_tokens`` 1, handoff in ``kv_transfer_params``), then to the decode
worker with the handoff in ``prefill_result``; the same Dynamo request id reaches both mocks.

Timing (deterministic lower bounds, not races): the decode mock recomputes the prompt like an aggregated
engine (docs/reference/mock.md#prefill-and-decode-emulation), and its ``speedup_ratio`` 0.01 stretches that prefill pass to about
``16.5 ms / 0.01 ≈ 1.65 s`` (timing.py: the pass's constant term dominates for short prompts), so the first
decode token cannot exist before ~1.65 s after the decode request was submitted; ``decode_speedup_ratio``
100 keeps the following tokens at ~6 ms each. The prefill mock runs at speedup 0 (instant).

What the tests observe on the servers, not only on the client:

* the mocks' ``recorded_requests`` (which request reached which mock, with which handoff) and
  ``abort_calls`` (``Control.Abort`` traffic);
* ``active_request_count()`` and the running/waiting metrics (released work);
* the decode mock's per-call record (``MockServer.call_record``): the tokens it handed to the stream and how
  the call ended (the natural finish, an Abort, or a dropped stream), which tells "the stream was dropped
  after the first token" from "dropped before it";
* the decode worker's log line from Dynamo's runtime (``request cancellation received``), which dates the
  arrival of the client's cancellation at the worker.

The mocks move no KV: "the transfer completed" is what docs/reference/sidecar.md#decode-deferral step 2 says, a response with a token or a
``finish_info``. The frontend answers the HTTP request (status and headers) only once the prefill worker has
returned (its pre-commit error peek is off here), so a client that disconnects as soon as it has the
headers leaves during the decode phase; a disconnect during the prefill phase is not covered here.

The tests run in file order on one module-scoped deployment (about 12 s in all); the last one checks that
the deployment still serves normally after the cancellations.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from dynamo_harness import FAST_ENGINE_ARGS

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

SEED = 42
PREFILL_ENGINE_ARGS = FAST_ENGINE_ARGS  # speedup 0: the handoff is immediate
DECODE_ENGINE_ARGS = {**FAST_ENGINE_ARGS, "speedup_ratio": 0.01, "decode_speedup_ratio": 100.0}
# The decode mock's first token comes after one modelled prefill pass: prefill_ms(T) / 0.01 ≥ 16.5 ms / 0.01.
FIRST_TOKEN_AT = 1.65
CANCEL_RECEIVED = "request cancellation received"
# How the decode mock saw a cancelled stream end: the sidecar drops the stream and queues an Abort on another
# connection, so either may reach the mock first (both end the work; "finish" would mean it ran to the end).
ENDED_BY_SIDECAR = ("drop", "abort")


class PD:
    def __init__(self, dep: Any, prefill: Any, decode: Any, prefill_worker: Any, decode_worker: Any) -> None:
        self.dep = dep
        self.prefill = prefill
        self.decode = decode
        self.prefill_worker = prefill_worker
        self.decode_worker = decode_worker

    @property
    def port(self) -> int:
        return self.dep.http_port


@pytest.fixture(scope="module")
def pd(deployment_factory) -> PD:
    dep = deployment_factory()
    prefill = dep.mock(
        served_model_name="tiny", disaggregation_mode="prefill", seed=SEED, engine_args=PREFILL_ENGINE_ARGS
    )
    decode = dep.mock(served_model_name="tiny", disaggregation_mode="decode", seed=SEED, engine_args=DECODE_ENGINE_ARGS)
    # Without the pre-commit error peek (docs/dynamo.md, "Errors before the first output"): with it the
    # frontend holds the HTTP headers until the first decode token (or the window), and these tests
    # disconnect as soon as they have the headers, before that token.
    dep.frontend(env_overrides={"DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS": "0"})
    prefill_worker = dep.trio_sidecar(prefill, "--disaggregation-mode", "prefill", name="prefill-sidecar")
    decode_worker = dep.trio_sidecar(decode, "--disaggregation-mode", "decode", name="decode-sidecar")
    dep.wait_ready("tiny")
    dep.wait_workers("backend", "prefill")
    return PD(dep, prefill, decode, prefill_worker, decode_worker)


# --- helpers -----------------------------------------------------------------------------------------------


def aborted_ids(mock) -> list[str]:
    return [rid for call in mock.call(lambda: list(mock.mock.abort_calls)) for rid in call]


def new_request(mock, before: int, timeout: float = 30.0) -> Any:
    """The one ``GenerateRequest`` recorded after index ``before`` (waits for it)."""
    deadline = time.monotonic() + timeout
    while len(recorded := mock.recorded()) == before:
        assert time.monotonic() < deadline, "no request reached the mock"
        time.sleep(0.005)
    assert len(recorded) == before + 1, [req.request_id for _, req, _, _ in recorded[before:]]
    return recorded[before][1]


def call_state(mock, request_id: str) -> tuple[int, str | None]:
    """``(tokens the decode mock handed to the stream, how the call ended)`` for ``request_id``; the end is
    ``None`` while undecided, else ``"finish"`` (terminal sent), ``"abort"`` (``Control.Abort`` first) or
    ``"drop"`` (stream dropped). Fails if the mock never saw the request."""
    record = mock.call(lambda: mock.mock.call_record(request_id))
    assert record is not None, f"no call {request_id!r} on the mock"
    return record.tokens_sent, record.ended


def wait_released(mock, timeout: float) -> float:
    """Wait until the mock has no request in flight; returns the seconds waited (fails after ``timeout``)."""
    start = time.monotonic()
    while mock.active():
        assert time.monotonic() - start < timeout, f"{mock.active()} request(s) still in flight after {timeout}s"
        time.sleep(0.01)
    return time.monotonic() - start


def wait_idle_metrics(mock, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        metrics = mock.call(mock.mock.metrics)
        if (metrics.running_requests, metrics.waiting_requests, metrics.active_decode_blocks) == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"the mock still holds work: {metrics}"
        time.sleep(0.02)


def wait_aborted(mock, request_id: str, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while request_id not in aborted_ids(mock):
        assert time.monotonic() < deadline, (
            f"no Control.Abort for {request_id} within {timeout}s (abort calls: {aborted_ids(mock)})"
        )
        time.sleep(0.01)


def cancellation_logged(worker, request_id: str) -> bool:
    return any(CANCEL_RECEIVED in line and request_id in line for line in worker.log().splitlines())


def check_handoff(pd: PD, prefill_req: Any, decode_req: Any) -> None:
    """The prefill request completed normally and its handoff is what the decode request carried."""
    from trio_sidecar.mock import request_uuid

    assert prefill_req.request_id == decode_req.request_id
    assert prefill_req.stopping.max_new_tokens == 1
    assert list(prefill_req.token_ids.ids) == list(decode_req.token_ids.ids)
    params = decode_req.kv.kv_transfer_params
    # The prefill mock's terminal handoff (mock handoff.prefill_terminal_params), forwarded verbatim.
    assert params["do_remote_prefill"] is True
    assert params["mocker_request_id"] == prefill_req.request_id
    assert params["remote_engine_id"] == f"mocker-prefill-{request_uuid(SEED, prefill_req.request_id)}"
    assert (
        params["remote_port"] == "0"
    )  # docs/reference/sidecar.md#kv-transfer-parameters-by-mode: the whole-number port becomes a string
    # The prefill stream ended with its terminal: nothing left in flight, no Abort for it.
    assert pd.prefill.active() == 0
    assert prefill_req.request_id not in aborted_ids(pd.prefill)
    wait_idle_metrics(pd.prefill)


def completion_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))


# --- tests -------------------------------------------------------------------------------------------------


def test_disconnect_mid_stream_releases_the_decode_request_and_aborts_it(pd):
    """docs/reference/sidecar.md#decode-deferral step 4: once a token was observed, a client cancellation drops the decode stream at once, and
    docs/reference/sidecar.md#abort-after-abandoning-a-stream queues ``Control.Abort`` for it."""
    assert pd.prefill.active() == 0 and pd.decode.active() == 0
    p0, d0 = len(pd.prefill.recorded()), len(pd.decode.recorded())
    with local.stream_sse(
        pd.port,
        "/v1/completions",
        {"model": "tiny", "prompt": "cancel me mid stream", "max_tokens": 20000, "ignore_eos": True, "stream": True},
        timeout=30,
    ) as events:
        decode_req = new_request(pd.decode, d0)
        rid = decode_req.request_id
        assert call_state(pd.decode, rid)[1] is None  # in flight
        chunks = [next(events) for _ in range(3)]
        assert completion_text(chunks), chunks
        assert pd.decode.active() == 1
        # Leaving the block closes the client connection mid-stream.
    start = time.monotonic()

    released = wait_released(pd.decode, timeout=5.0)
    assert released < 2.0, f"the decode mock released the request after {released:.2f}s"
    sent, ended = call_state(pd.decode, rid)
    assert ended in ENDED_BY_SIDECAR, f"the decode stream ended by {ended!r}, not by the sidecar"
    assert completion_text(chunks).count("<token:") <= sent < 20000  # what the client got, and not all
    wait_aborted(pd.decode, rid, timeout=max(0.1, 2.0 - (time.monotonic() - start)))
    wait_idle_metrics(pd.decode)

    prefill_req = new_request(pd.prefill, p0)
    check_handoff(pd, prefill_req, decode_req)
    assert chunks[0]["id"].split("-", 1)[1] == rid  # the client's request is the one the mocks saw


def test_disconnect_before_the_first_decode_token_is_deferred_until_that_token(pd):
    """docs/reference/sidecar.md#decode-deferral steps 1–3: a cancellation that reaches the decode worker before the first token (before the KV
    transfer completed) is only recorded; the stream is kept until the first token, then dropped, and an
    Abort follows (docs/reference/sidecar.md#abort-after-abandoning-a-stream)."""
    assert pd.prefill.active() == 0 and pd.decode.active() == 0
    p0, d0 = len(pd.prefill.recorded()), len(pd.decode.recorded())
    with local.stream_sse(
        pd.port,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "leave before the first token",
            "max_tokens": 20000,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=30,
    ):
        decode_req = new_request(pd.decode, d0)
        arrived = time.monotonic()
        rid = decode_req.request_id
        assert call_state(pd.decode, rid) == (0, None)
        # Leaving the block closes the client connection before any token exists.
    disconnected = time.monotonic() - arrived
    assert disconnected < 0.5, f"the client disconnected {disconnected:.2f}s after the decode request arrived"

    # The cancellation reaches the decode worker while the decode mock is still computing the prompt ...
    while not cancellation_logged(pd.decode_worker, rid):
        assert time.monotonic() - arrived < 1.0, "the client's cancellation did not reach the decode worker"
        time.sleep(0.01)
    assert call_state(pd.decode, rid) == (0, None)
    assert pd.decode.active() == 1
    # ... and the worker keeps the stream open: it is not dropped before the first token.
    time.sleep(max(0.0, FIRST_TOKEN_AT - 0.45 - (time.monotonic() - arrived)))
    assert pd.decode.active() == 1, "the decode stream was dropped before the first token (KV transfer cut)"
    assert call_state(pd.decode, rid) == (0, None)
    assert rid not in aborted_ids(pd.decode)

    # Then the first token completes the transfer, and the stream is dropped right after it.
    wait_released(pd.decode, timeout=FIRST_TOKEN_AT + 2.0)
    held = time.monotonic() - arrived
    sent, ended = call_state(pd.decode, rid)
    assert ended in ENDED_BY_SIDECAR, f"the decode stream ended by {ended!r}, not by the sidecar"
    assert sent >= 1, "the decode mock produced no token before the stream was dropped"
    assert sent < 20000
    assert held < FIRST_TOKEN_AT + 2.0, f"released {held:.2f}s after arrival: over 2 s after the first token was due"
    wait_aborted(pd.decode, rid)
    wait_idle_metrics(pd.decode)

    prefill_req = new_request(pd.prefill, p0)
    check_handoff(pd, prefill_req, decode_req)


def test_several_early_disconnects_at_once_are_all_deferred_released_and_aborted(pd):
    """Four concurrent disaggregated requests whose clients leave before the first token: each decode stream
    is kept to its first token, then dropped and aborted; nothing leaks on either mock."""
    import contextlib

    n = 4
    p0, d0 = len(pd.prefill.recorded()), len(pd.decode.recorded())
    with contextlib.ExitStack() as stack:
        for i in range(n):
            stack.enter_context(
                local.stream_sse(
                    pd.port,
                    "/v1/completions",
                    {
                        "model": "tiny",
                        "prompt": f"early leaver number {i}",
                        "max_tokens": 20000,
                        "ignore_eos": True,
                        "stream": True,
                    },
                    timeout=30,
                )
            )
        deadline = time.monotonic() + 30
        while len(pd.decode.recorded()) < d0 + n:
            assert time.monotonic() < deadline, "not every request reached the decode mock"
            time.sleep(0.005)
        arrived = time.monotonic()
        decode_reqs = [req for _, req, _, _ in pd.decode.recorded()[d0:]]
        rids = [req.request_id for req in decode_reqs]
        states = {rid: call_state(pd.decode, rid) for rid in rids}
        assert set(states.values()) == {(0, None)}, f"a decode token existed before the disconnect: {states}"
    assert time.monotonic() - arrived < 0.5

    wait_released(pd.decode, timeout=2 * FIRST_TOKEN_AT + 2.0)  # later arrivals wait out the first pass
    for rid in rids:
        sent, ended = call_state(pd.decode, rid)
        assert ended in ENDED_BY_SIDECAR and sent >= 1, (rid, sent, ended)
        wait_aborted(pd.decode, rid)
    wait_idle_metrics(pd.decode)

    prefill_reqs = {req.request_id: req for _, req, _, _ in pd.prefill.recorded()[p0:]}
    assert set(prefill_reqs) == set(rids)
    for req in decode_reqs:
        check_handoff(pd, prefill_reqs[req.request_id], req)


def test_early_disconnect_when_the_first_token_is_the_last_sends_no_abort(pd):
    """docs/reference/sidecar.md#decode-deferral + docs/reference/sidecar.md#abort-after-abandoning-a-stream: with ``max_tokens`` 1 the token that completes the transfer is also the terminal, so
    the server ended the stream itself: the request finishes on the decode mock and no Abort is sent."""
    p0, d0 = len(pd.prefill.recorded()), len(pd.decode.recorded())
    with local.stream_sse(
        pd.port,
        "/v1/completions",
        {"model": "tiny", "prompt": "one token then gone", "max_tokens": 1, "ignore_eos": True, "stream": True},
        timeout=30,
    ):
        decode_req = new_request(pd.decode, d0)
        arrived = time.monotonic()
        rid = decode_req.request_id
        assert call_state(pd.decode, rid) == (0, None)
    assert time.monotonic() - arrived < 0.5
    while not cancellation_logged(pd.decode_worker, rid):
        assert time.monotonic() - arrived < 1.0, "the client's cancellation did not reach the decode worker"
        time.sleep(0.01)
    assert call_state(pd.decode, rid) == (0, None)

    wait_released(pd.decode, timeout=FIRST_TOKEN_AT + 2.0)
    assert call_state(pd.decode, rid) == (1, "finish")
    time.sleep(0.5)  # an Abort would have been sent at once
    assert rid not in aborted_ids(pd.decode)
    wait_idle_metrics(pd.decode)
    check_handoff(pd, new_request(pd.prefill, p0), decode_req)


def test_after_the_cancellations_a_disaggregated_request_still_completes(pd):
    """Nothing broke: the same deployment serves a normal disaggregated request with the decode mock's tokens."""
    from trio_sidecar.mock import planned_tokens

    assert pd.prefill.active() == 0 and pd.decode.active() == 0
    p0, d0 = len(pd.prefill.recorded()), len(pd.decode.recorded())
    aborts_before = (aborted_ids(pd.prefill), aborted_ids(pd.decode))
    with local.stream_sse(
        pd.port,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "and now a normal one",
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=30,
    ) as events:
        chunks = list(events)
    decode_req = new_request(pd.decode, d0, timeout=0)
    rid = decode_req.request_id
    assert chunks[0]["id"].split("-", 1)[1] == rid
    # The decode mock seeds its tokens with the request id (docs/reference/mock.md#text-logprobs-and-candidates).
    assert completion_text(chunks) == "".join(f"<token:{t}>" for t in planned_tokens(SEED, rid, 8))
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert finishes[-1] == "length"
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 8

    check_handoff(pd, new_request(pd.prefill, p0, timeout=0), decode_req)
    assert pd.decode.active() == 0
    wait_idle_metrics(pd.decode)
    assert (aborted_ids(pd.prefill), aborted_ids(pd.decode)) == aborts_before  # a finished request: no Abort
    assert pd.prefill_worker.alive() and pd.decode_worker.alive()
