"""A hung engine: vLLM (the mock, as a process) is SIGSTOPped by PID with streams in flight.

Nothing closes a socket when a process is stopped, so only the client keepalive (an HTTP/2 PING after the
keepalive time without reads, the connection lost when nothing answers within the keepalive timeout) can tell.
Invariant: every in-flight request ends exactly once, with the typed retryable error (CannotConnect, which
Dynamo's migration retries), within keepalive time + timeout of the stop (plus the socket buffers' drain):
tokens were flowing, so the PING is one a gRPC-core server would accept at once. The prober's Watch streams
are silent, so its connection is PINGed at most once per ``keepalive_min_ping_interval`` (5 minutes by
default, gRPC-core's ping policy); with that lowered to the keepalive time (the mock polices no PINGs) the
prober goes UNREACHABLE within keepalive time + timeout too and new requests fail fast. After SIGCONT the
prober re-checks the identity, admission reopens, the pool reconnects its lost slots and requests complete.
"""

from __future__ import annotations

import json
import logging
import signal

import trio
from reliability_fakes import MockProcess, check_all, drive, mock_request, sidecar_config, sidecar_in_flight, wait_until

from trio_sidecar.core.errors import CannotConnect

SLOW_ARGS = {"block_size": 4, "max_num_seqs": 256, "speedup_ratio": 0.02}  # a decode pass every ~0.3 s
# Scheduling slack on top of the keepalive bound: the stop lands while the socket buffers still hold a
# little output (read after the stop), and the machine running the suite is small and shared.
SLACK = 2.0


def mock_args() -> list[str]:
    return ["--model", "mocker-model", "--max-concurrent-requests", "512", "--extra-engine-args", json.dumps(SLOW_ARGS)]


async def stop_with_streams_in_flight(sidecar, mock: MockProcess, concurrent: int, prefix: str):
    """``concurrent`` long requests streaming, then SIGSTOP; returns (outcomes, end times, stop time)."""
    streaming = 0
    all_streaming = trio.Event()
    ended: list[float] = []
    outcomes = []

    async def count_first(outcome, chunk) -> None:
        nonlocal streaming
        if outcome.tokens and len(outcome.chunks) == 1:
            streaming += 1
            if streaming == concurrent:
                all_streaming.set()

    async def one(i: int) -> None:
        outcome = await drive(sidecar, mock_request(10_000), f"{prefix}-{i}", on_chunk=count_first)
        ended.append(trio.current_time())
        outcomes.append(outcome)

    async with trio.open_nursery() as nursery:
        for i in range(concurrent):
            nursery.start_soon(one, i)
        with trio.fail_after(90):
            await all_streaming.wait()
        mock.process.send_signal(signal.SIGSTOP)
        stopped = trio.current_time()
    return outcomes, ended, stopped


def check_failed_by_keepalive(outcomes, concurrent: int) -> None:
    from trio_sidecar.dynamo.bridge import dynamo_exception

    check_all(outcomes, concurrent)  # each ended exactly once: one terminal or one typed error
    for outcome in outcomes:
        assert outcome.admitted and outcome.tokens, outcome.request_id
        assert isinstance(outcome.error, CannotConnect), (outcome.request_id, outcome.error)
        assert "keepalive PING not acknowledged" in outcome.error.message, outcome.error.message
        assert outcome.error.message.endswith("(Unavailable)")
        # What Dynamo sees: its CannotConnect, which its migration (--migration-limit) retries.
        assert type(dynamo_exception(outcome.error)).__name__ == "CannotConnect"


async def test_sigstopped_engine_is_detected_and_serving_resumes_after_sigcont(tmp_path, caplog):
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.core.health_policy import HealthKind

    caplog.set_level(logging.INFO, logger="trio_sidecar.prober")
    keepalive_time, keepalive_timeout = 1.0, 0.5
    concurrent = 100
    mock = MockProcess(mock_args(), tmp_path / "mock.log")
    try:
        with trio.fail_after(240):
            port = await mock.start()
            config = sidecar_config(
                f"127.0.0.1:{port}",
                grpc_connections=4,
                keepalive_time=keepalive_time,
                keepalive_timeout=keepalive_timeout,
                # The mock has no ping policy: the prober's silent connection may be PINGed every keepalive time.
                keepalive_min_ping_interval=keepalive_time,
            )
            async with open_sidecar(config) as sidecar:
                pool = sidecar.engine._pool
                outcomes, ended, stopped = await stop_with_streams_in_flight(sidecar, mock, concurrent, "hung")
                check_failed_by_keepalive(outcomes, concurrent)
                detected = max(ended) - stopped
                print(f"\nall {concurrent} in-flight requests failed {detected:.2f} s after SIGSTOP")
                assert detected <= keepalive_time + keepalive_timeout + SLACK, detected
                assert sidecar_in_flight(sidecar) == 0

                # The prober's connection is silent by nature (Watch sends only changes): its keepalive
                # notices too (PINGs allowed every keepalive time here), and admission closes.
                with trio.fail_after(keepalive_time + keepalive_timeout + SLACK):
                    await sidecar.health.wait_value(lambda s: s.kind is HealthKind.UNREACHABLE)
                print(f"prober UNREACHABLE {trio.current_time() - stopped:.2f} s after SIGSTOP")
                assert "keepalive PING not acknowledged" in sidecar.health.value.reason, sidecar.health.value
                started = trio.current_time()
                rejected = await drive(sidecar, mock_request(3), "while-stopped")
                fail_fast = trio.current_time() - started
                rejected.check_invariant()
                assert not rejected.admitted and isinstance(rejected.error, CannotConnect)
                assert rejected.error.message.startswith("vLLM is not serving: "), rejected.error.message
                print(f"a new request rejected in {fail_fast * 1000:.1f} ms")
                assert fail_fast < 0.5, fail_fast

                # The process resumes: the prober reconnects, re-checks the identity, and reopens admission.
                reconnects_before = pool.reconnects
                caplog.clear()
                mock.process.send_signal(signal.SIGCONT)
                resumed = trio.current_time()
                with trio.fail_after(60):
                    await sidecar.health.wait_value(lambda s: s.kind is HealthKind.SERVING)
                print(f"SERVING again {trio.current_time() - resumed:.2f} s after SIGCONT")
                assert any("vLLM is serving again" in r.getMessage() for r in caplog.records)

                after = []

                async def again(i: int) -> None:
                    after.append(await drive(sidecar, mock_request(5), f"after-{i}"))

                async with trio.open_nursery() as nursery:
                    for i in range(20):
                        nursery.start_soon(again, i)
                check_all(after, 20)
                for outcome in after:
                    assert outcome.error is None, (outcome.request_id, outcome.error)
                    assert len(outcome.tokens) == 5 and outcome.finish_reason == "length"
                # Every slot carried streams when the engine hung, so every one was lost and reconnected.
                assert pool.reconnects - reconnects_before == len(pool)
                assert not any(ch.broken for ch in pool.channels)
                await wait_until(lambda: sidecar_in_flight(sidecar) == 0)
            assert await mock.terminate() == 0
    finally:
        if mock.process is not None:
            mock.process.send_signal(signal.SIGCONT)
        await mock.aclose()


async def test_default_keepalive_detects_a_sigstopped_engine_within_15_seconds(tmp_path):
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.core.config import SidecarConfig
    from trio_sidecar.core.health_policy import HealthKind

    defaults = SidecarConfig(grpc_endpoint="127.0.0.1:1")
    bound = defaults.keepalive_time + defaults.keepalive_timeout
    assert bound <= 15.0  # a hung engine is noticed within 15 s with the defaults
    concurrent = 20
    mock = MockProcess(mock_args(), tmp_path / "mock.log")
    try:
        with trio.fail_after(240):
            port = await mock.start()
            async with open_sidecar(sidecar_config(f"127.0.0.1:{port}", grpc_connections=2)) as sidecar:
                assert (
                    sidecar.engine._pool._config.keepalive_time,
                    sidecar.engine._pool._config.keepalive_timeout,
                ) == (
                    defaults.keepalive_time,
                    defaults.keepalive_timeout,
                )
                outcomes, ended, stopped = await stop_with_streams_in_flight(sidecar, mock, concurrent, "default")
                check_failed_by_keepalive(outcomes, concurrent)
                detected = max(ended) - stopped
                print(f"\nall {concurrent} in-flight requests failed {detected:.2f} s after SIGSTOP (defaults)")
                assert bound - 1.0 <= detected <= 15.0, detected
                # (The prober's silent connection is PINGed at most every 5 minutes with the defaults, so it
                # need not have noticed yet; the in-flight requests did, within the keepalive bound.)
                mock.process.send_signal(signal.SIGCONT)
                with trio.fail_after(60):
                    await sidecar.health.wait_value(lambda s: s.kind is HealthKind.SERVING)
                outcome = await drive(sidecar, mock_request(3), "after-default")
                assert outcome.error is None and len(outcome.tokens) == 3, outcome
            assert await mock.terminate() == 0
    finally:
        if mock.process is not None:
            mock.process.send_signal(signal.SIGCONT)
        await mock.aclose()
