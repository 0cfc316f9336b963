"""Malformed vLLM responses fail only their own request, with the typed protocol error.

A scripted fake vLLM answers each request id with one docs/reference/sidecar.md#per-message-checks and docs/reference/sidecar.md#stream-level-rules violation (plus NaN in a Struct and an
unknown finish reason) while well-formed streams share the same pooled connections. Invariant: every request
ends with exactly one terminal chunk or exactly one typed error; nothing leaks on the server.
"""

from __future__ import annotations

import trio
from reliability_fakes import (
    MALFORMED,
    PREFILL_MALFORMED,
    ScriptedInference,
    check_all,
    drive,
    request_for,
    sidecar_config,
    sidecar_in_flight,
    wait_until,
)

from trio_sidecar.core.config import DisaggregationMode, SidecarConfig
from trio_sidecar.core.errors import PROTOCOL_ERROR_PREFIX, ProtocolError


def config_for(port: int, **overrides) -> SidecarConfig:
    return sidecar_config(f"127.0.0.1:{port}", **overrides)


async def test_each_malformed_response_fails_only_its_request(nursery):
    from trio_sidecar.api import open_sidecar

    fake = ScriptedInference()
    port = await fake.serve(nursery)
    outcomes = []
    with trio.fail_after(120):
        async with open_sidecar(config_for(port)) as sidecar:

            async def one(kind: str, request_id: str) -> None:
                outcomes.append(await drive(sidecar, request_for(kind), request_id))

            async with trio.open_nursery() as requests:
                # Long well-formed streams that span every failure on the same connections.
                for i in range(2):
                    requests.start_soon(one, "slow", f"slow/40/{i}")
                await wait_until(lambda: len(fake.requests) == 2)
                for copy in range(2):
                    for kind in MALFORMED:
                        requests.start_soon(one, kind, f"{kind}/{copy}")
                    requests.start_soon(one, "good", f"good/{copy}")

            check_all(outcomes, 2 + 2 * (len(MALFORMED) + 1))
            for outcome in outcomes:
                kind = outcome.request_id.split("/")[0]
                if kind in MALFORMED:
                    detail = MALFORMED[kind][1]
                    assert isinstance(outcome.error, ProtocolError), (outcome.request_id, outcome.error)
                    assert outcome.error.message.startswith(PROTOCOL_ERROR_PREFIX)
                    if kind == "nan-struct":
                        assert detail in outcome.error.message
                    else:
                        assert outcome.error.message == PROTOCOL_ERROR_PREFIX + detail
                else:
                    assert outcome.error is None, (outcome.request_id, outcome.error)
                    expected = list(range(100, 140)) if kind == "slow" else [100, 101, 102]
                    assert outcome.tokens == expected
                    assert outcome.finish_reason == "stop"

            # Nothing leaks: every stream the sidecar abandoned was dropped, nothing is left in flight.
            await wait_until(lambda: fake.active == 0)
            assert sidecar_in_flight(sidecar) == 0
            assert set(fake.ended) == set(fake.requests)

            # Conversion errors abandon a live stream, so each is followed by an Abort (docs/reference/sidecar.md#abort-after-abandoning-a-stream); a stream the
            # server ended itself (EOF) is not.
            abandoned = {f"{kind}/{copy}" for kind in MALFORMED if kind != "early-eof" for copy in range(2)}
            await wait_until(lambda: abandoned <= {rid for batch in fake.control.aborts for rid in batch})
            aborted = {rid for batch in fake.control.aborts for rid in batch}
            assert not aborted & {"early-eof/0", "early-eof/1", "good/0", "good/1", "slow/40/0", "slow/40/1"}

            # The sidecar keeps serving afterwards.
            after = await drive(sidecar, request_for("good"), "good/after")
            after.check_invariant()
            assert after.error is None and after.tokens == [100, 101, 102]
        # Leaving the block closes every connection (pool and prober).
        await wait_until(lambda: fake.server.open_connections == 0)


async def test_prefill_violations_fail_only_their_request(nursery):
    """Prefill mode: a terminal without ``kv_transfer_params`` (docs/reference/sidecar.md#per-message-checks) and the multimodal handoff checks
    (docs/reference/sidecar.md#multimodal-requests), next to a request that succeeds."""
    from trio_sidecar.api import open_sidecar

    fake = ScriptedInference()
    port = await fake.serve(nursery)
    outcomes = []
    with trio.fail_after(60):
        async with open_sidecar(config_for(port, disaggregation_mode=DisaggregationMode.PREFILL)) as sidecar:

            async def one(kind: str) -> None:
                outcomes.append(await drive(sidecar, request_for(kind, max_tokens=1), f"{kind}/0"))

            async with trio.open_nursery() as requests:
                for kind in PREFILL_MALFORMED:
                    requests.start_soon(one, kind)
            check_all(outcomes, len(PREFILL_MALFORMED))
            for outcome in outcomes:
                kind = outcome.request_id.split("/")[0]
                assert isinstance(outcome.error, ProtocolError), (outcome.request_id, outcome.error)
                assert outcome.error.message == PROTOCOL_ERROR_PREFIX + PREFILL_MALFORMED[kind][1]
            # The multimodal requests carried their media; the sidecar asked for the expanded prompt ids.
            for kind in ("mm-no-ids", "mm-bad-ids"):
                sent = fake.requests[f"{kind}/0"]
                assert len(sent.media) == 1 and sent.response.prompt_token_ids
            await wait_until(lambda: fake.active == 0)
            assert sidecar_in_flight(sidecar) == 0
        await wait_until(lambda: fake.server.open_connections == 0)
