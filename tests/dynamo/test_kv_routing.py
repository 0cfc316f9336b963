"""KV events from the mock reach Dynamo's KV router (docs/reference/worker.md#kv-events: by behaviour).

Two aggregated workers (two mocks, two ``trio-sidecar run``) behind a frontend with ``--router-mode kv``.
Each long prompt is first *pinned* to a chosen worker (``nvext.backend_instance_id``), so that worker's mock
caches its blocks and publishes ``BlockStored`` events, which the sidecar's ``KvEventPublisher`` relays to
the router. After the pinned requests have finished (so the router's own active-request tracking no longer
covers them), unpinned requests that share each prefix must be routed to the worker holding it — visible
in that mock's recorded requests. Prefixes are pinned to *different* workers, so a router that ignored the
events (any fixed or random choice) could not pass.

Runs on both topologies (tests/topology.py): file discovery with the TCP request plane and ZMQ
events, and etcd discovery with the NATS request and event planes (real etcd and NATS on 127.0.0.1).
"""

from __future__ import annotations

import time

import pytest
from topology import (
    TOPOLOGIES,
    etcd_nats_fixture,  # noqa: F401 - the etcd_nats fixture
    instances,
    make_topology,
)

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

ENGINE_ARGS = {
    "block_size": 16,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "speedup_ratio": 0.0,
}
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()


@pytest.fixture(scope="module", params=TOPOLOGIES)
def kv(request):
    # etcd and NATS first, so they are torn down after the deployment's processes.
    services = request.getfixturevalue("etcd_nats") if request.param == "etcd-nats" else None
    dep = request.getfixturevalue("deployment_factory")()
    topology = make_topology(request.param, dep.workdir, services)
    dep.env = dict(topology.env)
    mocks = [dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS) for _ in range(2)]
    dep.frontend(router_mode="kv", extra=topology.flags)
    procs = [dep.trio_sidecar(mock, *topology.flags, name=f"sidecar-{i}") for i, mock in enumerate(mocks)]
    dep.wait_ready("tiny")
    # Both workers' instance ids, as the frontend knows them (its /health, whatever the discovery backend).
    ids = _generate_instances(dep)
    deadline = time.monotonic() + 60
    while len(ids) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        ids = _generate_instances(dep)
    assert len(ids) == 2, ids
    if services is not None:  # really registered in etcd, not in a file store
        leases = {
            lease
            for key, (_, lease) in services.etcd.get_prefix(f"v1/instances/{dep.namespace}/").items()
            if "/generate/" in key
        }
        assert leases == set(ids), leases
    return dep, mocks, procs


def _generate_instances(dep) -> list[int]:
    return instances(dep.http_port, dep.namespace)


def _complete(dep, prompt: str, pin: int | None = None) -> dict:
    nvext: dict = {"extra_fields": ["worker_id"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin
    status, body = local.post_json(
        dep.http_port, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2, "nvext": nvext}
    )
    assert status == 200, body
    return body


def _mock_of(mocks, request_id: str) -> int:
    owners = [i for i, m in enumerate(mocks) if any(r.request_id == request_id for _, r, _, _ in m.recorded())]
    assert len(owners) == 1, owners
    return owners[0]


def test_repeated_long_prefixes_are_routed_to_the_worker_that_caches_them(kv):
    dep, mocks, _ = kv
    instances = _generate_instances(dep)
    prefixes = {}
    for k, pin in enumerate(instances):
        prefix = " ".join(WORDS[k * 7 :] + WORDS[: k * 7]) * 8  # ~190 tokens, ~12 blocks of 16
        body = _complete(dep, prefix, pin)
        assert body["nvext"]["worker_id"]["decode_worker_id"] == pin
        prefixes[pin] = (prefix, _mock_of(mocks, body["id"].split("-", 1)[1]))
    assert {holder for _, holder in prefixes.values()} == {0, 1}
    time.sleep(1.0)  # the relayed BlockStored events reach the router's index

    for rep in range(3):
        for pin, (prefix, holder) in prefixes.items():
            body = _complete(dep, f"{prefix} question {rep}")
            assert body["nvext"]["worker_id"]["decode_worker_id"] == pin, (rep, pin)
            assert _mock_of(mocks, body["id"].split("-", 1)[1]) == holder
