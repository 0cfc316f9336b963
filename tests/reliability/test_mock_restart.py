"""vLLM (the mock, as a process) is killed mid-stream under 200 concurrent requests and
restarted on the same port; the sidecar recovers without a restart of its own.

Invariant: every one of the 200 requests ends with exactly one typed error (none hangs, none gets a terminal
after its connection died); the prober leaves SERVING, recovers when the new process serves (same identity,
new instance and new KV-event ports: docs/reference/sidecar.md#recovery, not fatal), and 200 fresh requests complete.
"""

from __future__ import annotations

import json
import socket

import trio
from reliability_fakes import MockProcess, check_all, drive, mock_request, sidecar_config, sidecar_in_flight, wait_until

from trio_sidecar.core.errors import CannotConnect

CONCURRENT = 200
SLOW_ARGS = {
    "block_size": 4,
    "max_num_seqs": 256,
    "speedup_ratio": 0.02,  # ~0.3 s per decode pass: streams are long-lived and the sidecar is not flooded
}
FAST_ARGS = {"block_size": 4, "max_num_seqs": 256, "speedup_ratio": 0.0}


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free at the time of the call (all held open while choosing)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def mock_args(engine_args: dict) -> list[str]:
    return [
        "--model",
        "mocker-model",
        "--max-concurrent-requests",
        "512",
        "--extra-engine-args",
        json.dumps(engine_args),
    ]


async def test_mock_killed_mid_stream_and_restarted(tmp_path):
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.core.health_policy import HealthKind

    first_kv_port, second_kv_port = free_ports(2)
    mock = MockProcess(mock_args({**SLOW_ARGS, "zmq_kv_events_port": first_kv_port}), tmp_path / "mock.log")
    try:
        with trio.fail_after(180):
            port = await mock.start()
            async with open_sidecar(sidecar_config(f"127.0.0.1:{port}", grpc_connections=4)) as sidecar:
                assert [s.endpoint for s in sidecar.kv_event_sources] == [f"tcp://127.0.0.1:{first_kv_port}"]
                streaming = 0
                all_streaming = trio.Event()

                async def count_first(outcome, chunk) -> None:
                    nonlocal streaming
                    if outcome.tokens and len(outcome.chunks) == 1:
                        streaming += 1
                        if streaming == CONCURRENT:
                            all_streaming.set()

                outcomes = []

                async def one(i: int) -> None:
                    outcome = await drive(sidecar, mock_request(10_000), f"crash-{i}", on_chunk=count_first)
                    outcomes.append(outcome)

                async with trio.open_nursery() as nursery:
                    for i in range(CONCURRENT):
                        nursery.start_soon(one, i)
                    with trio.fail_after(90):
                        await all_streaming.wait()
                    await mock.kill()  # SIGKILL by PID: every connection drops mid-stream

                check_all(outcomes, CONCURRENT)
                for outcome in outcomes:
                    assert outcome.admitted and outcome.tokens, outcome.request_id
                    assert isinstance(outcome.error, CannotConnect), (outcome.request_id, outcome.error)
                assert sidecar_in_flight(sidecar) == 0

                # The prober saw the outage; new requests are rejected fast while vLLM is gone.
                with trio.fail_after(30):
                    await sidecar.health.wait_value(lambda s: s.kind is HealthKind.UNREACHABLE)
                rejected = await drive(sidecar, mock_request(3), "during-outage")
                rejected.check_invariant()
                assert not rejected.admitted
                assert rejected.error.message.startswith("vLLM is not serving: ")

                # Same port, same identity, a new process with a new KV-event port.
                mock.args = mock_args({**FAST_ARGS, "zmq_kv_events_port": second_kv_port})
                assert await mock.start() == port
                with trio.fail_after(60):
                    await sidecar.health.wait_value(lambda s: s.kind is HealthKind.SERVING)
                assert [s.endpoint for s in sidecar.kv_event_sources] == [f"tcp://127.0.0.1:{second_kv_port}"]

                after = []

                async def again(i: int) -> None:
                    after.append(await drive(sidecar, mock_request(5), f"after-{i}"))

                async with trio.open_nursery() as nursery:
                    for i in range(CONCURRENT):
                        nursery.start_soon(again, i)
                check_all(after, CONCURRENT)
                for outcome in after:
                    assert outcome.error is None, (outcome.request_id, outcome.error)
                    assert len(outcome.tokens) == 5 and outcome.finish_reason == "length"
                await wait_until(lambda: sidecar_in_flight(sidecar) == 0)
            assert await mock.terminate() == 0
    finally:
        await mock.aclose()
