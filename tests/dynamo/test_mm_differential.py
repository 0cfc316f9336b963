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

from collections.abc import Iterator
from typing import Any

import pytest
from mm_sides import (
    ANSI,
    IMAGE,
    VIDEO_DATA,
    VIDEO_URL,
    Sides,
    answer,
    direct,
    image_part,
    mm_mock,
    png_server,
    start_sides,
    video_part,
    vl_deployment,
)

from trio_sidecar.core.multimodal import HANDOFF_KEY, UNSAFE_UUID
from trio_sidecar.mock.tiny_vl_model import TOKENS_PER_IMAGE

pytestmark = pytest.mark.dynamo


@pytest.fixture(scope="module")
def vl_dep(tmp_path_factory) -> Iterator:
    with vl_deployment(tmp_path_factory.mktemp("dynamo-mm-diff")) as dep:
        yield dep


@pytest.fixture(scope="module")
def agg(vl_dep) -> Sides:
    return start_sides(vl_dep, "agg", [mm_mock(vl_dep)], ((),))


@pytest.fixture(scope="module")
def pd(vl_dep) -> Sides:
    mocks = [mm_mock(vl_dep, disaggregation_mode="prefill"), mm_mock(vl_dep, disaggregation_mode="decode")]
    return start_sides(vl_dep, "pd", mocks, (("--disaggregation-mode", "prefill"), ("--disaggregation-mode", "decode")))


# --- aggregated ------------------------------------------------------------------------------------------------


def test_an_image_url_on_a_loopback_address_is_refused_by_the_frontend_for_both(agg):
    # The frontend fetches image URLs itself (to hash them) and its media fetcher refuses direct and private
    # IPs unless the card configures one (neither sidecar does): both sides answer 400 and nothing is sent.
    # Image URLs that the fetcher allows are forwarded as `url` items (tests/unit/test_multimodal.py).
    with png_server() as url:
        results = agg.chat(image_part(url))
    (n_status, _, n_sent), (t_status, _, t_sent) = results["native"], results["trio"]
    assert n_status == t_status == 400
    assert n_sent == t_sent == [[]]


@pytest.mark.parametrize(
    "part",
    [image_part(), image_part(uuid="cat-1"), image_part(uuid="a..b"), video_part(VIDEO_URL), video_part(VIDEO_DATA)],
    ids=["image-data-uri", "image-uuid", "image-dotted-uuid", "video-url", "video-data-uri"],
)
def test_aggregated_media_requests_are_identical_to_natives(agg, part):
    results = agg.chat(part)
    (n_status, n_body, n_sent), (t_status, t_body, t_sent) = results["native"], results["trio"]
    assert n_status == 200, n_body
    assert (t_status, answer(t_body)) == (n_status, answer(n_body))
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
    assert (t_status, answer(t_body)) == (n_status, answer(n_body))

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


# --- the workers' own texts, through Dynamo's request plane ------------------------------------------------------


def _media_request(**fields: Any) -> dict[str, Any]:
    return {
        "token_ids": [87, 85, 31999, 28],
        "stop_conditions": {"max_tokens": 1},
        "sampling_options": {},
        "output_options": {},
        "eos_token_ids": [1],
        "annotations": [],
        **fields,
    }


MEDIA_ERRORS = [
    _media_request(multi_modal_data={"image_url": [{"Url": "ftp://host/cat.png"}]}),
    _media_request(multi_modal_data={"video_url": [{"Url": "file:///v.mp4"}]}),
    _media_request(multi_modal_data={"pdf_url": [{"Url": "https://host/a.pdf"}]}),
    _media_request(multi_modal_data={"image_url": [{"Url": IMAGE}]}, extra_args={"mm_hashes": "abc"}),
    _media_request(multi_modal_data={"image_url": [{"Url": IMAGE}]}, extra_args={"mm_hashes": [""]}),
    _media_request(multi_modal_data={"image_url": [{"Url": IMAGE}]}, extra_args={"mm_hashes": ["a", "b"]}),
    _media_request(multi_modal_data={"image_url": [{"Url": IMAGE}]}, multi_modal_uuids={"image_url": ["a", "b"]}),
    _media_request(multi_modal_data={"image_url": [{"Url": IMAGE}]}, multi_modal_uuids={"image_url": ["../etc"]}),
    _media_request(multi_modal_data={"image_url": [{"Url": IMAGE}]}, extra_args={"mm_hashes": ["a/b"]}),
    _media_request(multi_modal_uuids={"image_url": ["a"]}),
    _media_request(mm_processor_kwargs={"max_pixels": 3136}),
    # (`encoder_result` that is not an object is not compared: native 1.6.1 never answers such a request.)
]


def test_the_workers_media_errors_carry_natives_texts(agg):
    before = len(agg.mocks[0].recorded())
    answers = direct(agg, "agg", "backend", MEDIA_ERRORS)
    # Native's error string is its typed error's display: the kind, then the text.
    native = [answer.get("error", "").removeprefix("InvalidRequest: ") for answer in answers["native"]]
    assert [answer.get("error") for answer in answers["trio"]] == native
    assert len(native) == len(MEDIA_ERRORS) and all(native), answers["native"]
    assert native[0] == "vLLM gRPC image_url input must use an http://, https://, or data: URI"
    assert native[7] == native[8] == UNSAFE_UUID
    assert len(agg.mocks[0].recorded()) == before  # nothing reached the engine
