"""Encoder disaggregation through Dynamo's frontend, native 1.6.1 against trio-sidecar (docs/reference/worker.md#encoder-disaggregation).

The same mocks (the tiny Qwen2-VL-shaped model) behind two frontends with the KV router, one per sidecar
family, in two topologies: encode + prefill/decode (E+PD) and encode + aggregated. An encode worker
(``--disaggregation-mode encode``, on a mock in encode mode) and a worker that routes to it
(``--route-to-encoder``) register the same cards as native's; the encode request carries the media and asks
for one token, and the encoder handoff the encode mock answered reaches the next workers as
``ec_transfer_params``, verbatim; the client's answers are identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dynamo_harness import Deployment, make_tiny_model, require_dynamo
from mm_sides import (
    ANSI,
    IMAGE,
    SIDES,
    VIDEO_URL,
    Sides,
    answer,
    cards,
    direct,
    image_part,
    mm_mock,
    start_sides,
    video_part,
    vl_deployment,
)

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.mock.multimodal import media_identifier
from trio_sidecar.mock.tiny_vl_model import make_tiny_vl_model

pytestmark = pytest.mark.dynamo


@pytest.fixture(scope="module", params=["epd", "eagg"])
def topology(request, tmp_path_factory) -> Iterator[tuple[str, Sides]]:
    """One topology at a time (pytest runs every test on the first, tears it down, then the second)."""
    label = request.param
    with vl_deployment(tmp_path_factory.mktemp(f"dynamo-{label}")) as dep:
        encode = mm_mock(dep, disaggregation_mode="encode")
        if label == "epd":
            mocks = [encode, mm_mock(dep, disaggregation_mode="prefill"), mm_mock(dep, disaggregation_mode="decode")]
            args: tuple[tuple[str, ...], ...] = (
                ("--disaggregation-mode", "encode"),
                ("--disaggregation-mode", "prefill", "--route-to-encoder"),
                ("--disaggregation-mode", "decode"),
            )
        else:
            mocks = [encode, mm_mock(dep)]
            args = (("--disaggregation-mode", "encode"), ("--route-to-encoder",))
        yield label, start_sides(dep, label, mocks, args)


def _cards(sides: Sides, label: str) -> dict[str, dict[str, Any]]:
    """The model cards each family registered, by component (the fields the comparison covers)."""
    out: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        for entry in cards(sides.dep, f"{sides.dep.namespace}-{label}-{side}"):
            card = entry["card_json"]
            runtime = dict(card["runtime_config"])
            data = runtime.pop("runtime_data", {})
            summary = {
                "component": entry["component"],
                "model_type": card["model_type"],
                "worker_type": card["worker_type"],
                "needs": card.get("needs"),
                "kv_cache_block_size": card["kv_cache_block_size"],
                "runtime_config": runtime,
                "runtime_data": data,
            }
            out.setdefault(side, {})[entry["component"]] = summary
    return out


def test_encode_workers_and_the_workers_routing_to_them_register_natives_cards(topology):
    label, sides = topology
    cards = _cards(sides, label)
    for component, card in cards["native"].items():
        mine = cards["trio"][component]
        diff = {k: (v, mine.get(k)) for k, v in card.items() if k != "runtime_config" and mine.get(k) != v}
        mine_rc = mine["runtime_config"]
        diff.update({k: (v, mine_rc.get(k)) for k, v in card["runtime_config"].items() if mine_rc.get(k) != v})
        assert diff == {}, component
    encode = cards["native"]["encode"]
    assert (encode["worker_type"], encode["needs"]) == ("encode", [["prefill", "decode"], ["aggregated"]])
    routing = cards["native"]["prefill" if label == "epd" else "backend"]
    assert routing["runtime_data"]["encoder_result_handoff"] is True


@pytest.mark.parametrize(
    "part", [image_part(), image_part(uuid="cat-3"), video_part(VIDEO_URL)], ids=["image", "image-uuid", "video"]
)
def test_encoder_disaggregated_media_requests_are_identical_to_natives(topology, part):
    _, sides = topology
    results = sides.chat(part)
    (n_status, n_body, n_sent), (t_status, t_body, t_sent) = results["native"], results["trio"]
    assert n_status == 200, n_body
    assert (t_status, answer(t_body)) == (n_status, answer(n_body))
    encoded = {}
    for side, sent in (("native", n_sent), ("trio", t_sent)):
        assert [len(requests) for requests in sent] == [1] * len(sides.mocks), (side, sent)
        (encode,) = sent[0]
        assert encode["stopping"]["max_new_tokens"] == 1 and len(encode["media"]) == 1
        assert "kv_transfer_params" not in encode.get("kv", {})
        # The encode mock's handoff reached every later worker verbatim.
        handoff = {"mocker_encode_request_id": encode.get("request_id"), "mm_hashes": [_identifier(encode)]}
        for (later,) in sent[1:]:
            assert later["kv"]["ec_transfer_params"]["mm_hashes"] == handoff["mm_hashes"]
            later["kv"]["ec_transfer_params"] = sorted(later["kv"]["ec_transfer_params"])
            kv = later["kv"].get("kv_transfer_params")
            if isinstance(kv, dict):
                later["kv"]["kv_transfer_params"] = sorted(kv)
        encoded[side] = sent
    assert encoded["trio"] == encoded["native"]


def _identifier(encode: dict[str, Any]) -> str:
    """The mock's feature identifier of the request's one media item: its uuid, else its source's digest."""
    item = encode["media"][0]
    source = {key: item[key] for key in ("url", "data_uri") if key in item}
    return media_identifier(pb.MediaItem(uuid=item.get("uuid", ""), **source))


def test_the_encode_workers_request_errors_carry_natives_texts(topology):
    label, sides = topology
    base = {
        "token_ids": [87, 85, 31999, 28],
        "stop_conditions": {"max_tokens": 1},
        "sampling_options": {},
        "output_options": {},
        "eos_token_ids": [1],
        "annotations": [],
    }
    image = {"image_url": [{"Url": IMAGE}]}
    requests = [
        base,
        {**base, "multi_modal_data": {"audio_url": [{"Url": "https://host/a.wav"}]}},
        {**base, "multi_modal_data": image, "encoder_result": {"handle": 1}},
        {**base, "multi_modal_data": image, "multi_modal_uuids": {"image_url": ["../etc"]}},
    ]
    before = len(sides.mocks[0].recorded())
    answers = direct(sides, label, "encode", requests)
    native = [answer.get("error", "").removeprefix("InvalidRequest: ") for answer in answers["native"]]
    assert [answer.get("error") for answer in answers["trio"]] == native
    assert native[:3] == [
        "encode requests require multimodal media",
        "encode requests support image and video media only",
        "encode requests must not include encoder_result",
    ]
    assert native[3] == (
        "multimodal media uuid must be a safe identifier without path separators, NUL bytes, or dot path components"
    )
    assert len(sides.mocks[0].recorded()) == before


# --- start-up refusals, once the engine is known -------------------------------------------------------------------

ROUTE_TO_ENCODER_ON_DECODE = (
    "--route-to-encoder is meaningful only for --disaggregation-mode agg|prefill; got 'decode'. Decode workers "
    "consume KV cache from a Prefill peer (encoder dependency propagates transitively through Prefill); Encode "
    "workers are the producer of the encoder result."
)


@pytest.mark.parametrize(
    ("multimodal", "args", "text"),
    [
        (
            False,
            ("--disaggregation-mode", "encode"),
            "encode mode requires a multimodal engine; `tiny` does not advertise multimodal support",
        ),
        (True, ("--disaggregation-mode", "decode", "--route-to-encoder"), ROUTE_TO_ENCODER_ON_DECODE),
    ],
    ids=["encode-on-a-text-model", "route-to-encoder-on-decode"],
)
def test_encoder_settings_the_engine_cannot_serve_exit_1_with_natives_text(tmp_path, multimodal, args, text):
    require_dynamo()
    pytest.importorskip("tokenizers")
    model = make_tiny_vl_model(tmp_path / "vl") if multimodal else make_tiny_model(tmp_path / "text")
    dep = Deployment(tmp_path / "run", model)
    try:
        mock = dep.mock(served_model_name="tiny", supports_multimodal=multimodal)
        for side in SIDES:
            start = dep.native_sidecar if side == "native" else dep.trio_sidecar
            proc = start(mock, *args, name=side)
            code = proc.wait(120)
            log = ANSI.sub("", proc.log())
            assert code == 1, (side, log[-2000:])
            assert text in log, (side, log[-2000:])
            assert "Discovering vLLM model metadata" in log  # refused once the engine is known, as native
    finally:
        dep.close()
