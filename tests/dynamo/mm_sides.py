"""Helpers for the multimodal differentials (tests/dynamo/test_mm_*differential.py): the tiny Qwen2-VL-shaped
model behind two frontends with the KV router, one per sidecar family, on shared mocks."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from dynamo_harness import Deployment, MockThread, require_dynamo
from google.protobuf.json_format import MessageToDict
from test_mm_kv_routing import png

from trio_sidecar._devtools import local
from trio_sidecar.mock.tiny_vl_model import TOKENS_PER_IMAGE, make_tiny_vl_model

ENGINE_ARGS = {
    "block_size": 4,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "speedup_ratio": 0.0,
    "tokens_per_image": TOKENS_PER_IMAGE,
    "token_seed_source": "prompt",  # the same prompt generates the same tokens for both sidecars
}
SIDES = ("native", "trio")
IMAGE = "data:image/png;base64," + base64.b64encode(png((30, 60, 90))).decode()
VIDEO_URL = "http://127.0.0.1:9/clip.mp4"  # never fetched: neither the frontend nor the mock opens it
VIDEO_DATA = "data:video/mp4;base64,AAAAIGZ0eXBpc29t"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Sides:
    """The mocks, and one frontend port per sidecar family."""

    def __init__(self, dep: Deployment, mocks: list[MockThread]) -> None:
        self.dep = dep
        self.mocks = mocks
        self.ports: dict[str, int] = {}
        self.workers: dict[str, list[local.Process]] = {side: [] for side in SIDES}

    def chat(self, part: dict[str, Any], **extra: Any) -> dict[str, tuple[int, Any, list[list[dict]]]]:
        """The same chat request on both sides: per side the status, the body and what each mock recorded."""
        payload = {
            "model": "tiny",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is in it"}]}],
            **extra,
        }
        out = {}
        for side, port in self.ports.items():
            before = [len(mock.recorded()) for mock in self.mocks]
            status, body = local.post_json(port, "/v1/chat/completions", payload)
            sent = [
                [wire(req) for _, req, _, _ in mock.recorded()[n:]] for mock, n in zip(self.mocks, before, strict=True)
            ]
            out[side] = (status, body, sent)
        return out


def wire(request: Any) -> dict[str, Any]:
    wire = MessageToDict(request, preserving_proto_field_name=True)
    # Different by design for every request (docs/dynamo.md): the id, priority negation, the temperature default.
    for key in ("request_id", "priority", "temperature"):
        wire.pop(key, None)
    return wire


def answer(body: Any) -> Any:
    return {k: v for k, v in body.items() if k not in ("id", "created")} if isinstance(body, dict) else body


def start_sides(dep: Deployment, label: str, mocks: list[MockThread], args: tuple[tuple[str, ...], ...]) -> Sides:
    """Both families on ``mocks`` (each deployment of the module in namespaces of its own)."""
    sides = Sides(dep, mocks)
    for side in SIDES:
        namespace = f"{dep.namespace}-{label}-{side}"
        dep.frontend(namespace=namespace, router_mode="kv")
        sides.ports[side] = dep.http_port
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        for i, (mock, extra) in enumerate(zip(mocks, args, strict=True)):
            sides.workers[side].append(start(mock, *extra, namespace=namespace, name=f"{side}-{i}"))
    for port in sides.ports.values():
        local.wait_for_models(port, ["tiny"], timeout=180, watch=dep.processes)
    # The model is listed once one worker registered; wait for every worker's card (an encode worker's
    # included), then give the frontends' discovery watchers a moment to see the last one.
    deadline = time.monotonic() + 120
    for side in SIDES:
        while len(cards(dep, f"{dep.namespace}-{label}-{side}")) < len(mocks):
            assert time.monotonic() < deadline, f"not every {side} worker registered"
            time.sleep(0.2)
    time.sleep(1.0)
    return sides


@contextmanager
def png_server() -> Iterator[str]:
    """An HTTP server on 127.0.0.1 serving :data:`IMAGE`'s PNG at the URL it yields (the frontend fetches
    image URLs to hash them)."""
    import http.server
    import threading

    body = base64.b64decode(IMAGE.split(",", 1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def cards(dep: Deployment, namespace: str) -> list[dict[str, Any]]:
    """The model-card records registered in ``namespace`` (file discovery)."""
    out = []
    folder = dep.file_kv / "v1" / "mdc"
    for path in folder.iterdir() if folder.is_dir() else ():
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):  # being written or removed
            continue
        if entry.get("namespace") == namespace:
            out.append(entry)
    return out


@contextmanager
def vl_deployment(workdir: Path) -> Iterator[Deployment]:
    """A deployment of the tiny multimodal model in ``workdir``, torn down on exit."""
    require_dynamo()
    pytest.importorskip("tokenizers")
    model = make_tiny_vl_model(workdir / "tiny-vl")
    dep = Deployment(workdir, model)
    try:
        yield dep
    finally:
        dep.close()


def mm_mock(dep: Deployment, **config: Any) -> MockThread:
    return dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS, supports_multimodal=True, **config)


def image_part(url: str = IMAGE, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


_DIRECT_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    from dynamo.runtime import DistributedRuntime

    async def main():
        runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
        client = await runtime.endpoint(sys.argv[1]).client()
        await asyncio.wait_for(client.wait_for_instances(), 60)
        for raw in sys.argv[2:]:
            try:
                stream = await client.generate(json.loads(raw))
                out = {"items": [item.data() async for item in stream]}
            except Exception as exc:
                out = {"error": str(exc)}
            print(json.dumps(out), flush=True)
        runtime.shutdown()

    asyncio.run(main())
    """
)


def direct(sides: Sides, label: str, component: str, requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each request straight to each family's worker of ``component`` (no frontend): what it answered, in order."""
    answers = {}
    for side in SIDES:
        endpoint = f"{sides.dep.namespace}-{label}-{side}.{component}.generate"
        done = subprocess.run(
            [sys.executable, "-c", _DIRECT_CLIENT, endpoint, *map(json.dumps, requests)],
            env=sides.dep.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        answers[side] = [json.loads(line) for line in done.stdout.splitlines()]
    return answers
