"""Multimodal requests through Dynamo's frontend, native 1.6.1 against trio-sidecar (docs/reference/sidecar.md#multimodal-requests).

Each deployment puts the same mocks (the tiny Qwen2-VL-shaped model, ``--supports-multimodal``) behind two
frontends with the KV router, one per sidecar family (its namespace scopes discovery). Every case sends the
same request to both and compares the client's status and output and the ``GenerateRequest``s the mocks
recorded (minus the request id and the fields that differ by design everywhere, docs/dynamo.md).

- Aggregated: images and videos by URL and by data URI reach vLLM with their modality and uuid; a media uuid
  that could act as a path (``../etc``, ``a/b``, ``.``, a backslash) is refused with HTTP 400 and never reaches
  the engine, while ``a..b`` is an ordinary id.
- Prefill/decode: the prefill request carries the media and asks for the expanded prompt ids; the decode
  request carries the *original* prompt ids and the media again (the KV transfer does not carry the
  multimodal position metadata), and no sidecar-private key in its handoff.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

import pytest
from dynamo_harness import Deployment, MockThread, require_dynamo
from google.protobuf.json_format import MessageToDict
from test_mm_kv_routing import png

from trio_sidecar._devtools import local
from trio_sidecar.mock.tiny_vl_model import TOKENS_PER_IMAGE, make_tiny_vl_model
from trio_sidecar.multimodal import HANDOFF_KEY, UNSAFE_UUID

pytestmark = pytest.mark.dynamo

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
                [_wire(req) for _, req, _, _ in mock.recorded()[n:]] for mock, n in zip(self.mocks, before, strict=True)
            ]
            out[side] = (status, body, sent)
        return out


def _wire(request: Any) -> dict[str, Any]:
    wire = MessageToDict(request, preserving_proto_field_name=True)
    # Different by design for every request (docs/dynamo.md): the id, priority negation, the temperature default.
    for key in ("request_id", "priority", "temperature"):
        wire.pop(key, None)
    return wire


def _answer(body: Any) -> Any:
    return {k: v for k, v in body.items() if k not in ("id", "created")} if isinstance(body, dict) else body


def _start(dep: Deployment, label: str, mocks: list[MockThread], args: tuple[tuple[str, ...], ...]) -> Sides:
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
    return sides


@pytest.fixture(scope="module")
def vl_dep(tmp_path_factory) -> Iterator[Deployment]:
    require_dynamo()
    pytest.importorskip("tokenizers")
    model = make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-vl")
    dep = Deployment(tmp_path_factory.mktemp("dynamo-mm-diff"), model)
    try:
        yield dep
    finally:
        dep.close()


def _mock(dep: Deployment, **config: Any) -> MockThread:
    return dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS, supports_multimodal=True, **config)


@pytest.fixture(scope="module")
def agg(vl_dep) -> Sides:
    return _start(vl_dep, "agg", [_mock(vl_dep)], ((),))


@pytest.fixture(scope="module")
def pd(vl_dep) -> Sides:
    mocks = [_mock(vl_dep, disaggregation_mode="prefill"), _mock(vl_dep, disaggregation_mode="decode")]
    return _start(vl_dep, "pd", mocks, (("--disaggregation-mode", "prefill"), ("--disaggregation-mode", "decode")))


def image_part(url: str = IMAGE, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


# --- aggregated ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [image_part(), image_part(uuid="cat-1"), image_part(uuid="a..b"), video_part(VIDEO_URL), video_part(VIDEO_DATA)],
    ids=["image-data-uri", "image-uuid", "image-dotted-uuid", "video-url", "video-data-uri"],
)
def test_aggregated_media_requests_are_identical_to_natives(agg, part):
    results = agg.chat(part)
    (n_status, n_body, n_sent), (t_status, t_body, t_sent) = results["native"], results["trio"]
    assert n_status == 200, n_body
    assert (t_status, _answer(t_body)) == (n_status, _answer(n_body))
    assert t_sent == n_sent
    (request,) = n_sent[0]
    (item,) = request["media"]
    kind = part["type"]
    assert item["modality"] == ("MODALITY_IMAGE" if kind == "image_url" else "MODALITY_VIDEO")
    assert item.get("url", item.get("data_uri")) == part[kind]["url"]
    if "uuid" in part:
        assert item["uuid"] == part["uuid"]


@pytest.mark.parametrize("uuid", ["../etc", "a/b", ".", "..", "a\\b"])
def test_a_path_like_media_uuid_is_refused_before_vllm_like_native(agg, uuid):
    results = agg.chat(image_part(uuid=uuid))
    (n_status, _, n_sent), (t_status, t_body, t_sent) = results["native"], results["trio"]
    assert n_status == t_status == 400
    assert n_sent == t_sent == [[]]  # nothing reached the engine
    # Native's frontend answer is generic; the worker's error carries the same text on both sides.
    assert t_body["message"] == UNSAFE_UUID
    native_log = ANSI.sub("", "".join(proc.log() for proc in agg.workers["native"]))
    assert f"InvalidRequest: {UNSAFE_UUID}" in native_log


# --- prefill / decode ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "part", [image_part(), image_part(uuid="cat-2"), video_part(VIDEO_URL)], ids=["image", "image-uuid", "video"]
)
def test_prefill_decode_media_requests_are_identical_to_natives(pd, part):
    results = pd.chat(part)
    (n_status, n_body, n_sent), (t_status, t_body, t_sent) = results["native"], results["trio"]
    assert n_status == 200, n_body
    assert (t_status, _answer(t_body)) == (n_status, _answer(n_body))

    def shape(sent: list[list[dict]]) -> list[list[dict]]:
        # The prefill handoff carries per-request ids: compare its keys, not their values.
        out = []
        for requests in sent:
            out.append([])
            for request in requests:
                kv = request.get("kv", {}).get("kv_transfer_params")
                if isinstance(kv, dict):
                    request = {**request, "kv": {**request["kv"], "kv_transfer_params": sorted(kv)}}
                out[-1].append(request)
        return out

    assert shape(t_sent) == shape(n_sent)
    assert [len(requests) for requests in n_sent] == [1, 1], n_sent
    (prefill,), (decode,) = n_sent
    assert prefill["response"].get("prompt_token_ids") is True
    assert prefill["stopping"]["max_new_tokens"] == 1
    # Decode: the original prompt ids (one placeholder) and the media again; the expanded ids stay private.
    assert decode["token_ids"] == prefill["token_ids"]
    assert decode["media"] == prefill["media"]
    assert HANDOFF_KEY not in decode["kv"]["kv_transfer_params"]
    assert n_body["usage"]["prompt_tokens"] == len(prefill["token_ids"]["ids"]) - 1 + TOKENS_PER_IMAGE
