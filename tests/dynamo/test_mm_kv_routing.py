"""Exact multimodal KV routing, native 1.6.1 against trio-sidecar (docs/reference/worker.md#multimodal-kv-routing).

One side per sidecar family, each behind its own frontend with ``--router-mode kv`` (its namespace scopes
discovery) and two workers on two mocks of their own. The model is the tiny Qwen2-VL-shaped one
(:mod:`trio_sidecar.mock.tiny_vl_model`): the frontend replaces each image's placeholder in the routing tokens
by a value derived from the image's hash and forwards the hash, the sidecar passes it to vLLM as the media
uuid, and the mock reports it in ``BlockStored.extra_keys`` of the blocks the image covers, as vLLM does.
Only a KV publisher that knows the image placeholder rewrites those blocks the way the frontend did.

- The relayed KV events of the same image request are identical on both sides (block hashes, the router's
  token hashes and the multimodal object), read off the event plane.
- Two images behind identical text are pinned to different workers; unpinned requests with either image
  must then go to the worker holding it, on both sides. A router blind to the image sees the same text on
  both workers and cannot send both images right every round.
- Both sidecars log the same resolved placeholder, the model's ``image_token_id``.
"""

from __future__ import annotations

import base64
import json
import re
import struct
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
import zmq
from dynamo_harness import Deployment, require_dynamo
from topology import instances

from trio_sidecar._devtools import local
from trio_sidecar.mock.tiny_vl_model import IMAGE_SIDE, IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, make_tiny_vl_model

pytestmark = pytest.mark.dynamo

BLOCK_SIZE = 4
ENGINE_ARGS = {
    "block_size": BLOCK_SIZE,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "speedup_ratio": 0.0,
    "tokens_per_image": TOKENS_PER_IMAGE,
    "token_seed_source": "prompt",  # the same prompt generates the same tokens on every mock
}
TEXT = "hello world the quick brown fox jumps over a lazy dog tiny model serves tokens"
SIDES = ("native", "trio")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def png(rgb: tuple[int, int, int], side: int = IMAGE_SIDE) -> bytes:
    """A solid ``side`` × ``side`` RGB PNG (no imaging library needed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(rgb) * side for _ in range(side))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def image_chat(rgb: tuple[int, int, int], question: str = "", pin: int | None = None) -> dict[str, Any]:
    """A chat request whose user message starts with the image, then the same text for every image."""
    url = "data:image/png;base64," + base64.b64encode(png(rgb)).decode()
    nvext: dict[str, Any] = {"extra_fields": ["worker_id"]}
    if pin is not None:
        nvext["backend_instance_id"] = pin
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT + question}]
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}], "nvext": nvext}


class KvEventSniffer:
    """Subscribes to every ``kv-events`` channel of one namespace on Dynamo's event plane (ZMQ, file discovery).

    Dynamo 1.6.1 frames each message as ``[topic, publisher id, sequence, body]``; the body is one version
    byte, a 4-byte length, then a MessagePack envelope whose ``payload`` is the MessagePack list of router
    events (``{"worker_id", "event": {"data": {"stored": {"blocks": [...]}}}}``).
    """

    def __init__(self, file_kv: Path, namespace: str) -> None:
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.stored: list[tuple[int, dict[str, Any]]] = []  # (worker_id, block) in arrival order
        for path in (file_kv / "v1" / "event_channels").iterdir():
            name = urllib.parse.unquote(path.name)
            if f"namespace/{namespace}/" not in name or "/topic/kv-events/" not in name:
                continue
            endpoint = json.loads(path.read_text())["transport"]["config"]["endpoint"]
            sock = self.context.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.sockets.append(sock)
        assert self.sockets, f"no kv-events channel of {namespace} in {file_kv}"

    def poll(self, timeout: float) -> None:
        """Receive what arrives within ``timeout`` seconds into :attr:`stored`."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = zmq.select(self.sockets, [], [], left)[0]
            for sock in ready:
                while sock.poll(0):
                    self._take(sock.recv_multipart()[-1])

    def _take(self, body: bytes) -> None:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(body[5:])
        envelope = next(unpacker)
        for event in msgpack.unpackb(envelope["payload"], raw=False, strict_map_key=False):
            stored = event["event"]["data"].get("stored")
            if stored:
                self.stored.extend((event["worker_id"], block) for block in stored["blocks"])

    def blocks_of(self, worker: int) -> list[dict[str, Any]]:
        return [block for owner, block in self.stored if owner == worker]

    def wait_blocks(self, worker: int, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The first ``count`` blocks ``worker`` stored, waiting for them up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.blocks_of(worker)) < count:
            assert time.monotonic() < deadline, f"worker {worker} stored {self.blocks_of(worker)}, expected {count}"
            self.poll(0.2)
        return self.blocks_of(worker)[:count]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.context.term()


@attrs.define
class Side:
    port: int
    namespace: str
    workers: list[int]
    logs: list[local.Process]
    sniffer: KvEventSniffer | None = None

    def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        status, body = local.post_json(self.port, "/v1/chat/completions", payload)
        assert status == 200, body
        return body


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> Iterator[dict[str, Side]]:
    require_dynamo()
    pytest.importorskip("tokenizers")
    model = make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-vl")
    dep = Deployment(tmp_path_factory.mktemp("dynamo-mm"), model)
    out: dict[str, Side] = {}
    try:
        for side in SIDES:
            namespace = f"{dep.namespace}-{side}"
            dep.frontend(namespace=namespace, router_mode="kv")
            port = dep.http_port
            start = dep.native_sidecar if side == "native" else dep.trio_sidecar
            mocks = [
                dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS, supports_multimodal=True) for _ in "ab"
            ]
            procs = [start(mock, namespace=namespace, name=f"{side}-{i}") for i, mock in enumerate(mocks)]
            out[side] = Side(port, namespace, [], procs)
        for side in out.values():
            local.wait_for_models(side.port, ["tiny"], timeout=180, watch=dep.processes)
            deadline = time.monotonic() + 60
            while len(side.workers) < 2 and time.monotonic() < deadline:
                side.workers = instances(side.port, side.namespace)
                time.sleep(0.2)
            assert len(side.workers) == 2, side.workers
            side.sniffer = KvEventSniffer(dep.file_kv, side.namespace)
        yield out
    finally:
        for side in out.values():
            if side.sniffer is not None:
                side.sniffer.close()
        dep.close()


def _subscribed(side: Side, worker: int) -> None:
    """Prove the sniffer's subscription is live: a pinned text request's blocks arrive (ZMQ SUB joins late)."""
    assert side.sniffer is not None
    deadline = time.monotonic() + 60
    attempt = 0
    while not side.sniffer.blocks_of(worker):
        assert time.monotonic() < deadline, "no KV event reached the sniffer"
        attempt += 1
        body = {"model": "tiny", "max_tokens": 1, "nvext": {"backend_instance_id": worker}}
        # Another role: its first block differs from every image prompt's, so none of their blocks is cached.
        body["messages"] = [{"role": "system", "content": f"warm up {attempt}"}]
        side.chat(body)
        side.sniffer.poll(0.5)
    side.sniffer.stored.clear()


def test_both_sidecars_relay_the_same_kv_events_for_an_image_prompt(sides):
    relayed = {}
    for name, side in sides.items():
        assert side.sniffer is not None
        worker = side.workers[0]
        _subscribed(side, worker)
        body = side.chat(image_chat((200, 10, 10), pin=worker))
        assert body["nvext"]["worker_id"]["decode_worker_id"] == worker
        relayed[name] = side.sniffer.wait_blocks(worker, body["usage"]["prompt_tokens"] // BLOCK_SIZE)
    assert relayed["native"] == relayed["trio"]
    # The image blocks carry the frontend's hash of the image (exact routing is on for this model).
    image_blocks = [block for block in relayed["native"] if block["mm_extra_info"]]
    assert len(image_blocks) >= TOKENS_PER_IMAGE // BLOCK_SIZE
    assert {obj["mm_hash"] for block in image_blocks for obj in block["mm_extra_info"]["mm_objects"]} != set()


def test_an_image_prompt_is_routed_to_the_worker_holding_its_blocks_on_both_sidecars(sides):
    images = [(10, 10, 200), (200, 200, 10)]
    for side in sides.values():
        assert side.sniffer is not None
        for rgb, worker in zip(images, side.workers, strict=True):
            _subscribed(side, worker)
            body = side.chat(image_chat(rgb, pin=worker))
            assert body["nvext"]["worker_id"]["decode_worker_id"] == worker
            # Every prompt block but the first ("user:", cached by the previous test on worker 0) is new.
            side.sniffer.wait_blocks(worker, body["usage"]["prompt_tokens"] // BLOCK_SIZE - 1)
    time.sleep(1.0)  # the relayed events reach the router's index (the sniffer is not the router)

    routed = {name: [] for name in sides}
    for rnd in range(3):
        for name, side in sides.items():
            for rgb in images:
                body = side.chat(image_chat(rgb, question=f" question {rnd}"))
                routed[name].append(side.workers.index(body["nvext"]["worker_id"]["decode_worker_id"]))
    assert routed["native"] == [0, 1] * 3
    assert routed["trio"] == routed["native"]


def test_both_sidecars_resolve_the_models_image_token_id(sides):
    pattern = re.compile(r"Resolved image placeholder token for multimodal KV routing.*?image_token_id\W*(\d+)")
    for name, side in sides.items():
        for proc in side.logs:
            found = pattern.findall(ANSI.sub("", proc.log()))
            assert found == [str(IMAGE_TOKEN_ID)], (name, proc.name, found)


# --- the worker's resolution step on its own (DynamoSide.resolve_image_token_id) -------------------------------


def _resolve(model: str, supports_multimodal: bool) -> tuple[int | None, int | None]:
    """Run the step on a fresh asyncio loop (as on the worker's asyncio thread); the id and what it kept."""
    import asyncio

    from trio_sidecar.core.config import WorkerOptions
    from trio_sidecar.dynamo.runtime import DynamoSide

    side = DynamoSide(WorkerOptions())
    side.image_token_id = 7  # a stale value: every call starts over
    token = asyncio.run(side.resolve_image_token_id(model, supports_multimodal))
    return token, side.image_token_id


def test_the_worker_resolves_a_local_multimodal_models_placeholder_and_keeps_it(tmp_path, caplog):
    require_dynamo()
    model = str(make_tiny_vl_model(tmp_path / "tiny-vl"))
    with caplog.at_level("INFO", logger="trio_sidecar.dynamo.runtime"):
        assert _resolve(model, True) == (IMAGE_TOKEN_ID, IMAGE_TOKEN_ID)
    assert f"Resolved image placeholder token for multimodal KV routing (model={model}, image_token_id=31999)" in (
        caplog.text
    )


def test_a_model_without_multimodal_support_is_not_looked_at(tmp_path, caplog):
    require_dynamo()
    model = str(make_tiny_vl_model(tmp_path / "tiny-vl"))
    with caplog.at_level("DEBUG", logger="trio_sidecar.dynamo.runtime"):
        assert _resolve(model, False) == (None, None)
    assert caplog.text == ""


def test_a_model_whose_configuration_cannot_be_fetched_only_disables_exact_routing(monkeypatch, caplog):
    require_dynamo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a cache lookup only: no network
    with caplog.at_level("WARNING", logger="trio_sidecar.dynamo.runtime"):
        assert _resolve("acme/missing-vl", True) == (None, None)
    assert (
        "Unable to fetch model configuration; exact multimodal KV routing is disabled "
        "(model=acme/missing-vl, fetch_timeout_secs=30, error=" in caplog.text
    )
    assert "acme/missing-vl" in caplog.text.split("error=", 1)[1]
