"""vLLM's health flaps SERVING ↔ NOT_SERVING every 100 ms for 5 s under load.

While not serving, new requests fail fast with the typed `vLLM is not serving` error; admitted requests are
never cancelled by the prober (the mock keeps generating), so each of them ends with exactly one terminal.
Afterwards admission reopens and every live counter is back to zero.
"""

from __future__ import annotations

import trio
from reliability_fakes import (
    check_all,
    drive,
    mock_config,
    mock_idle,
    mock_request,
    sidecar_config,
    sidecar_in_flight,
    wait_until,
)

from trio_sidecar.core.errors import CannotConnect

SERVING = 1
NOT_SERVING = 2
HEALTH_NAMES = ("", "vllm.Control", "vllm.Inference")
FLAP_PERIOD = 0.1
FLAP_FOR = 5.0
WORKERS = 16


def set_all(mock, status: int) -> None:
    for name in HEALTH_NAMES:
        mock.set_serving_status(name, status)


async def test_health_flaps_under_load_lose_nothing():
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.core.health_policy import HealthKind
    from trio_sidecar.mock import open_mock_server

    engine_args = {
        "block_size": 4,
        "enable_prefix_caching": False,
        "max_num_seqs": 64,
        "speedup_ratio": 1.0,  # ~6 ms passes: streams of 20 tokens span several flaps
    }
    outcomes = []
    kinds_seen: set[HealthKind] = set()
    with trio.fail_after(120):
        async with open_mock_server(mock_config(engine_args=engine_args)) as mock:
            async with open_sidecar(sidecar_config(mock.address)) as sidecar:
                stop = trio.Event()

                async def worker(w: int) -> None:
                    n = 0
                    while not stop.is_set():
                        outcomes.append(await drive(sidecar, mock_request(20), f"flap-{w}-{n}"))
                        n += 1
                        await trio.sleep(0.005)

                async def watch_health() -> None:
                    async for state in sidecar.health.eventual_values():
                        kinds_seen.add(state.kind)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_health)
                    async with trio.open_nursery() as load:
                        for w in range(WORKERS):
                            load.start_soon(worker, w)
                        deadline = trio.current_time() + FLAP_FOR
                        status = NOT_SERVING
                        while trio.current_time() < deadline:
                            set_all(mock, status)
                            status = SERVING if status == NOT_SERVING else NOT_SERVING
                            await trio.sleep(FLAP_PERIOD)
                        set_all(mock, SERVING)
                        with trio.fail_after(30):
                            await sidecar.health.wait_value(lambda s: s.kind is HealthKind.SERVING)
                        # However loaded the machine, some requests get through once vLLM serves again.
                        await wait_until(lambda: any(o.admitted for o in outcomes))
                        stop.set()
                    nursery.cancel_scope.cancel()

                check_all(outcomes, len(outcomes))
                admitted = [o for o in outcomes if o.admitted]
                rejected = [o for o in outcomes if not o.admitted]
                # The prober really gated admission, and requests really ran between the flaps.
                assert rejected, "no request was rejected while vLLM was not serving"
                assert admitted, "no request was admitted"
                for outcome in rejected:
                    assert isinstance(outcome.error, CannotConnect), outcome.error
                    assert outcome.error.message.startswith("vLLM is not serving: "), outcome.error.message
                for outcome in admitted:  # in-flight requests are never cancelled by the prober
                    assert outcome.error is None, (outcome.request_id, outcome.error)
                    assert len(outcome.tokens) == 20 and outcome.finish_reason == "length"
                assert {HealthKind.NOT_SERVING, HealthKind.SERVING} <= kinds_seen

                # Admission is open again, and nothing is left behind.
                final = await drive(sidecar, mock_request(3), "flap-final")
                final.check_invariant()
                assert final.error is None and len(final.tokens) == 3
                await wait_until(lambda: mock_idle(mock) and sidecar_in_flight(sidecar) == 0)
                print(
                    f"\nflaps: {len(admitted)} admitted, {len(rejected)} rejected, states {sorted(k.name for k in kinds_seen)}"
                )
