"""The services Dynamo's runtime needs at startup, checked from Trio before the runtime is created
(trio_sidecar/dynamo/prerequisites.py): which ones, where (Dynamo's own variables), and the wait."""

from __future__ import annotations

import re

import pytest
import trio

from trio_sidecar.core.config import WorkerOptions
from trio_sidecar.dynamo.prerequisites import PrerequisiteUnreachable, prerequisites, wait_reachable
from trio_sidecar.shell.progress import StartupProgress, tracking


def test_the_default_etcd_backend_needs_etcd_at_dynamos_default_address():
    [etcd] = prerequisites(WorkerOptions(), environ={})
    assert (etcd.name, etcd.setting, etcd.urls, etcd.addresses, etcd.timeout) == (
        "etcd",
        "ETCD_ENDPOINTS",
        ("http://localhost:2379",),
        (("localhost", 2379),),
        120.0,
    )


def test_endpoints_and_timeout_come_from_dynamos_variables():
    environ = {
        "ETCD_ENDPOINTS": "http://10.0.0.5:2379, https://[::1]:23790,etcd.local",
        "ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS": "7",
        "NATS_SERVER": "nats://127.0.0.1:4333",
    }
    etcd, nats = prerequisites(WorkerOptions(request_plane="nats"), environ=environ)
    assert etcd.addresses == (("10.0.0.5", 2379), ("::1", 23790), ("etcd.local", 2379))
    assert etcd.timeout == 7.0
    assert (nats.name, nats.addresses) == ("NATS", (("127.0.0.1", 4333),))


@pytest.mark.parametrize(
    "options",
    [
        WorkerOptions(discovery_backend="file"),
        WorkerOptions(discovery_backend="mem"),
        WorkerOptions(discovery_backend="kubernetes"),
    ],
)
def test_other_backends_with_tcp_planes_need_nothing(options):
    assert prerequisites(options, environ={}) == []


def test_a_nats_event_plane_needs_nats():
    [nats] = prerequisites(WorkerOptions(discovery_backend="file", event_plane="nats"), environ={})
    assert nats.addresses == (("localhost", 4222),)


async def test_the_wait_returns_once_a_listener_accepts():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    [etcd] = prerequisites(WorkerOptions(), environ={"ETCD_ENDPOINTS": f"http://127.0.0.1:{port}"})
    with trio.fail_after(10):
        await wait_reachable(etcd)
    for listener in listeners:
        await listener.aclose()


async def test_the_wait_fails_after_the_timeout_with_the_cause_and_records_attempts(autojump_clock):
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening
        [etcd] = prerequisites(
            WorkerOptions(),
            environ={"ETCD_ENDPOINTS": f"http://127.0.0.1:{port}", "ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS": "1.5"},
        )
        progress = StartupProgress()
        with tracking(progress), trio.fail_after(10), pytest.raises(PrerequisiteUnreachable) as info:
            await wait_reachable(etcd)
    assert re.fullmatch(
        rf"etcd at http://127\.0\.0\.1:{port} \(ETCD_ENDPOINTS\) is not reachable after \d+(\.\d)?s: all "
        rf"attempts to connect to 127\.0\.0\.1:{port} failed: connection refused",
        str(info.value),
    ), info.value
    assert progress.attempts >= 2 and progress.last_cause == "connection refused"
