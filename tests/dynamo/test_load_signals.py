"""Router load signals: what each worker publishes for the KV router, and how the router treats its load.

Two deployments on the NATS event plane (etcd discovery, real etcd and NATS on 127.0.0.1): the native
sidecar (``python -m dynamo.vllm.sidecar``) and ``trio-sidecar run``, each with two workers (two mocks) behind
its own ``--router-mode kv`` frontend (the namespace scopes discovery to one family). A plain NATS client
subscribed to ``namespace.>`` records every event-plane message both families publish
(docs/dynamo.md#router-load-signals):

- the subjects are the same: the KV events and the worker-side prefill completion, nothing else (no
  ``kv_metrics``, which the router also listens to);
- each request yields exactly one ``MarkPrefillCompleted`` event, of the same shape, naming the request, the
  worker that served it and its DP rank;
- with a data-parallel engine, each event names the DP rank the request ran on;
- in a prefill/decode pair, the decode worker publishes the events and the prefill worker none;
- a worker loaded with long requests is avoided by the router in both families.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import msgpack
import pytest
from topology import (
    NatsTap,
    etcd_nats_fixture,  # noqa: F401 - the etcd_nats fixture
    instances,
    make_topology,
    start_native_sidecar,
)

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

SIDES = ("native", "trio")
# Paced so that a long request stays in decode for the whole test (≈ 115 ms per decode step) while a short
# one ends in well under a second.
ENGINE_ARGS = {
    "block_size": 16,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "speedup_ratio": 0.05,
}
PREFILL_COMPLETION = "component.backend.endpoint.generate.active_sequences_events"
KV_EVENTS = "component.backend.endpoint.generate.kv-events"
WAIT = 60.0


@pytest.fixture(scope="module")
def planes(request, etcd_nats):
    tap = NatsTap(etcd_nats.nats, "namespace.>")
    request.addfinalizer(tap.close)
    dep = request.getfixturevalue("deployment_factory")()
    topology = make_topology("etcd-nats", dep.workdir, etcd_nats)
    dep.env = dict(topology.env)
    ports: dict[str, int] = {}
    for side in SIDES:
        namespace = f"{dep.namespace}-{side}"
        dep.frontend(namespace=namespace, router_mode="kv", extra=topology.flags)
        ports[side] = dep.http_port
        for i in range(2):
            mock = dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS)
            name = f"{side}-{i}"
            if side == "native":
                dep.processes.append(
                    start_native_sidecar(dep.workdir, topology, mock.address, namespace=namespace, name=name)
                )
            else:
                dep.trio_sidecar(mock, *topology.flags, namespace=namespace, name=name)
    for side in SIDES:
        local.wait_for_models(ports[side], ["tiny"], timeout=180, watch=dep.processes)
        deadline = time.monotonic() + WAIT
        while len(instances(ports[side], f"{dep.namespace}-{side}")) < 2:
            assert time.monotonic() < deadline, f"{side}: the frontend does not see both workers"
            time.sleep(0.2)
    return dep, ports, tap


@pytest.fixture(scope="module")
def dp_planes(request, etcd_nats, planes):
    """One worker per family on a two-rank mock, each behind its own frontend (the same NATS as ``planes``)."""
    _, _, tap = planes
    dep = request.getfixturevalue("deployment_factory")()
    topology = make_topology("etcd-nats", dep.workdir, etcd_nats)
    dep.env = dict(topology.env)
    ports: dict[str, int] = {}
    mocks = {}
    for side in SIDES:
        namespace = f"{dep.namespace}-{side}"
        dep.frontend(namespace=namespace, router_mode="kv", extra=topology.flags)
        ports[side] = dep.http_port
        mocks[side] = dep.mock(served_model_name="tiny", engine_args={**ENGINE_ARGS, "dp_size": 2})
        name = f"{side}-dp"
        if side == "native":
            dep.processes.append(
                start_native_sidecar(dep.workdir, topology, mocks[side].address, namespace=namespace, name=name)
            )
        else:
            dep.trio_sidecar(mocks[side], *topology.flags, namespace=namespace, name=name)
    for side in SIDES:
        local.wait_for_models(ports[side], ["tiny"], timeout=180, watch=dep.processes)
    return dep, ports, mocks, tap


@pytest.fixture(scope="module")
def pd_planes(request, etcd_nats, planes):
    """A prefill and a decode worker per family (two mocks each), each family behind its own frontend."""
    _, _, tap = planes
    dep = request.getfixturevalue("deployment_factory")()
    topology = make_topology("etcd-nats", dep.workdir, etcd_nats)
    dep.env = dict(topology.env)
    ports: dict[str, int] = {}
    for side in SIDES:
        namespace = f"{dep.namespace}-{side}"
        dep.frontend(namespace=namespace, router_mode="kv", extra=topology.flags)
        ports[side] = dep.http_port
        for mode in ("prefill", "decode"):
            mock = dep.mock(served_model_name="tiny", disaggregation_mode=mode, engine_args=ENGINE_ARGS)
            args = ("--disaggregation-mode", mode)
            name = f"{side}-{mode}"
            if side == "native":
                dep.processes.append(
                    start_native_sidecar(
                        dep.workdir, topology, mock.address, namespace=namespace, extra=args, name=name
                    )
                )
            else:
                dep.trio_sidecar(mock, *topology.flags, *args, namespace=namespace, name=name)
    for side in SIDES:
        local.wait_for_models(ports[side], ["tiny"], timeout=180, watch=dep.processes)
    return dep, ports, tap


def _namespace(dep, side: str) -> str:
    return f"{dep.namespace}-{side}"


def _events(tap: NatsTap, namespace: str, suffix: str) -> list[tuple[dict, dict]]:
    """The (envelope, decoded payload) of every message on ``namespace.{namespace}.{suffix}``."""
    subject = f"namespace.{namespace}.{suffix}"
    out = []
    for _, got, data in tap.messages():
        if got == subject:
            envelope = msgpack.unpackb(data, raw=False)
            out.append((envelope, msgpack.unpackb(envelope["payload"], raw=False)))
    return out


def _subjects(tap: NatsTap, namespace: str) -> set[str]:
    prefix = f"namespace.{namespace}."
    return {subject[len(prefix) :] for _, subject, _ in tap.messages() if subject.startswith(prefix)}


def _complete(
    port: int, prompt: str, *, pin: int | None = None, dp_rank: int | None = None, max_tokens: int = 2
) -> dict:
    nvext: dict = {"extra_fields": ["worker_id"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin
    if dp_rank is not None:
        nvext["dp_rank"] = dp_rank
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "nvext": nvext}
    status, body = local.post_json(port, "/v1/completions", payload)
    assert status == 200, body
    return body


def _request_id(body: dict) -> str:
    return body["id"].split("-", 1)[1]


def test_both_families_publish_the_same_router_signals(planes):
    dep, ports, tap = planes
    served: dict[str, dict[str, int]] = {}  # side -> request id -> the worker that served it
    for side in SIDES:
        served[side] = {}
        for k in range(3):
            body = _complete(ports[side], f"signal probe {k} " * (4 + k))
            served[side][_request_id(body)] = body["nvext"]["worker_id"]["decode_worker_id"]

    completions: dict[str, list[tuple[dict, dict]]] = {}
    deadline = time.monotonic() + WAIT
    for side in SIDES:
        while True:
            events = _events(tap, _namespace(dep, side), PREFILL_COMPLETION)
            mine = [(env, p) for env, p in events if p.get("request_id") in served[side]]
            if len(mine) >= len(served[side]):
                break
            assert time.monotonic() < deadline, (side, "prefill completion events", mine)
            time.sleep(0.1)
        completions[side] = mine

    for side in SIDES:
        mine = completions[side]
        assert Counter(p["request_id"] for _, p in mine) == Counter(list(served[side])), side  # exactly one each
        for envelope, payload in mine:
            assert envelope["topic"] == "active_sequences_events"
            assert payload == {
                "request_id": payload["request_id"],
                "worker": {"worker_id": served[side][payload["request_id"]], "dp_rank": 0},
                "data": "MarkPrefillCompleted",
                "router_id": served[side][payload["request_id"]],
                "lora_name": None,
            }, side
    (native_env, native_payload), (trio_env, trio_payload) = completions["native"][0], completions["trio"][0]
    assert sorted(trio_env) == sorted(native_env)
    assert sorted(trio_payload) == sorted(native_payload)

    native_subjects = _subjects(tap, _namespace(dep, "native"))
    assert native_subjects == {KV_EVENTS, PREFILL_COMPLETION}
    assert _subjects(tap, _namespace(dep, "trio")) == native_subjects


def test_each_prefill_completion_names_the_dp_rank_the_request_ran_on(dp_planes):
    dep, ports, mocks, tap = dp_planes
    ranks: dict[str, dict[str, int]] = {}  # side -> request id -> the rank its vLLM call carried
    for side in SIDES:
        (worker,) = instances(ports[side], _namespace(dep, side))
        ranks[side] = {}
        for rank in (1, 0, 1):
            body = _complete(ports[side], f"rank {rank} probe", pin=worker, dp_rank=rank)
            rid = _request_id(body)
            sent = [dict(md) for _, req, md, _ in mocks[side].recorded() if req.request_id == rid]
            assert len(sent) == 1, (side, sent)
            ranks[side][rid] = int(sent[0]["x-data-parallel-rank"])
        assert sorted(ranks[side].values()) == [0, 1, 1], (side, ranks[side])

    deadline = time.monotonic() + WAIT
    for side in SIDES:
        while True:
            events = _events(tap, _namespace(dep, side), PREFILL_COMPLETION)
            got = {p["request_id"]: p["worker"]["dp_rank"] for _, p in events if p["request_id"] in ranks[side]}
            if len(got) == len(ranks[side]):
                break
            assert time.monotonic() < deadline, (side, got, ranks[side])
            time.sleep(0.1)
        assert got == ranks[side], side


def test_in_a_prefill_decode_pair_the_decode_worker_publishes_each_prefill_completion(pd_planes):
    dep, ports, tap = pd_planes
    served: dict[str, set[str]] = {}
    for side in SIDES:
        served[side] = set()
        for k in range(3):
            body = _complete(ports[side], f"disaggregated probe {k} " * 5, max_tokens=3)
            served[side].add(_request_id(body))

    deadline = time.monotonic() + WAIT
    for side in SIDES:
        namespace = _namespace(dep, side)
        while True:
            events = _events(tap, namespace, PREFILL_COMPLETION)
            mine = [p for _, p in events if p["request_id"] in served[side]]
            if len(mine) >= len(served[side]):
                break
            assert time.monotonic() < deadline, (side, mine)
            time.sleep(0.1)
        assert sorted(p["request_id"] for p in mine) == sorted(served[side]), side
        decode_workers = {p["worker"]["worker_id"] for p in mine}
        assert len(decode_workers) == 1, (side, mine)  # one decode worker; the prefill worker publishes none
        assert decode_workers <= set(instances(ports[side], namespace)), side
        prefill_workers = _prefill_instances(tap, namespace)
        assert prefill_workers and decode_workers.isdisjoint(prefill_workers), (side, prefill_workers)
        # The prefill worker publishes its KV events (on its own component), nothing else.
        assert not _events(tap, namespace, PREFILL_COMPLETION.replace("backend", "prefill"))


def _prefill_instances(tap: NatsTap, namespace: str) -> set[int]:
    """Instance ids named by the prefill component's KV events."""
    out = set()
    for _, payload in _events(tap, namespace, KV_EVENTS.replace("backend", "prefill")):
        for event in payload:
            out.add(event["worker_id"])
    return out


def _router_load(port: int) -> dict[tuple[str, int], float]:
    """``(gauge, worker id) -> value`` of the frontend's per-worker load gauges (its ``/metrics``)."""
    conn = local._connection(port, 10.0)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        for gauge in ("worker_active_decode_blocks", "worker_active_prefill_tokens"):
            if line.startswith(f"dynamo_frontend_{gauge}{{"):
                labels, value = line.rsplit(" ", 1)
                worker = int(labels.split('worker_id="', 1)[1].split('"', 1)[0])
                out[(gauge, worker)] = float(value)
    return out


class _LongStreams:
    """Streaming requests pinned to one worker, kept open until :meth:`stop` (then disconnected)."""

    def __init__(self, port: int, pin: int, count: int) -> None:
        self.first_tokens = threading.Semaphore(0)
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(port, pin, f"long load {k} " * 24), daemon=True)
            for k in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, port: int, pin: int, prompt: str) -> None:
        payload = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 1000,
            "stream": True,
            "nvext": {"backend_instance_id": pin},
        }
        try:
            with local.stream_sse(port, "/v1/completions", payload, timeout=WAIT) as events:
                first = True
                for _ in events:
                    if first:
                        first = False
                        self.first_tokens.release()
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
            self.first_tokens.release()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(WAIT)


def test_a_loaded_worker_is_avoided_by_the_kv_router_like_a_loaded_native_one(planes):
    dep, ports, _ = planes
    outcome: dict[str, list] = {}
    loads: dict[str, dict] = {}  # the router's gauges when the probes started (shown on failure)
    for side in SIDES:
        port = ports[side]
        loaded, idle = instances(port, _namespace(dep, side))
        streams = _LongStreams(port, loaded, 2)
        try:
            for _ in range(2):
                assert streams.first_tokens.acquire(timeout=WAIT), f"{side}: no first token"
            assert not streams.errors, streams.errors
            # The router counts the long requests' blocks on the loaded worker (its own bookkeeping).
            deadline = time.monotonic() + WAIT
            while (load := _router_load(port)).get(("worker_active_decode_blocks", loaded), 0) <= 0:
                assert time.monotonic() < deadline, (side, load)
                time.sleep(0.1)
            chosen = [
                _complete(port, f"fresh {word} prompt", max_tokens=1)["nvext"]["worker_id"]["decode_worker_id"]
                for word in ("amber", "birch", "cedar", "delta")
            ]
        finally:
            streams.stop()
        outcome[side] = ["idle" if c == idle else "loaded" if c == loaded else c for c in chosen]
        loads[side] = load
    assert outcome["native"] == ["idle"] * 4, (outcome, loads)
    assert outcome["trio"] == outcome["native"], (outcome, loads)
