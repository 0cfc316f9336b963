"""Multimodal requests (docs/reference/sidecar.md#multimodal-requests): the prefill/decode handoff (decode re-sends the
original prompt and the media), images, videos and audio by URL and data URI, media uuid safety, encoder
handoff parameters, and every error text."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import ResponseState, build_generate_request
from trio_sidecar.core.errors import InvalidArgument, ProtocolError
from trio_sidecar.core.jsonstruct import json_to_struct, struct_to_json
from trio_sidecar.core.multimodal import HANDOFF_KEY, UNSAFE_UUID, classify_media_source, media_source_error, pad_uuid
from trio_sidecar.core.protocol import structure_request

AGG, PREFILL, DECODE, ENCODE = (
    DisaggregationMode.AGG,
    DisaggregationMode.PREFILL,
    DisaggregationMode.DECODE,
    DisaggregationMode.ENCODE,
)
DATA_URI = "data:image/png;base64,iVBORw0KGgo="
PLACEHOLDER = 31999


def image_request(**kw: Any) -> dict[str, Any]:
    req: dict[str, Any] = {
        "token_ids": [1, PLACEHOLDER, 2],
        "multi_modal_data": {"image_url": [{"Url": DATA_URI}]},
        "extra_args": {"mm_hashes": ["0123456789abcdef"], "messages": [{"role": "user"}], "formatted_prompt": "p"},
    }
    req.update(kw)
    return req


def build(req: dict[str, Any], mode: DisaggregationMode = AGG):
    request = structure_request(req)
    built = build_generate_request(request, "r", "served", mode)
    return request, built


def rejects(req: dict[str, Any], message: str, mode: DisaggregationMode = AGG) -> None:
    with pytest.raises(InvalidArgument) as info:
        build(req, mode)
    assert str(info.value) == message


def test_pad_uuid() -> None:
    assert pad_uuid("0123456789abcdef") == "0123456789abcdef" + "0" * 48
    assert len(pad_uuid("a")) == 64
    assert pad_uuid("x" * 70) == "x" * 70


def test_prefill_decode_handoff_with_601_expanded_ids() -> None:
    expanded = list(range(100, 701))
    assert len(expanded) == 601
    # Prefill: media forwarded with the padded mm_hash uuid; prompt token ids requested.
    req = image_request()
    request, built = build(req, PREFILL)
    m = built.message
    assert len(m.media) == 1
    item = m.media[0]
    assert item.modality == pb.MODALITY_IMAGE and item.WhichOneof("source") == "data_uri"
    assert item.data_uri == DATA_URI and item.mime_type == ""
    assert item.uuid == "0123456789abcdef" + "0" * 48
    assert m.response.prompt_token_ids is True and built.has_media
    # vLLM reports the expanded prompt; the mismatch with the 3 request ids is tolerated.
    st = ResponseState(request, built, PREFILL)
    info = pb.PromptInfo(num_prompt_tokens=601, token_ids=expanded)
    assert st.convert(pb.GenerateResponse(prompt_info=info)) is None
    finish = pb.FinishInfo(num_output_tokens=1, finish_reason=1)
    finish.kv_transfer_params.CopyFrom(json_to_struct({"do_remote_prefill": True, "remote_port": 20097}))
    terminal = st.convert(
        pb.GenerateResponse(outputs=pb.SequenceOutput(num_tokens=1, token_ids=[5], finish_info=finish))
    )
    assert terminal is not None and terminal.token_ids == []
    handoff = terminal.disaggregated_params
    assert handoff is not None and handoff[HANDOFF_KEY] == expanded
    assert terminal.completion_usage.prompt_tokens == 601  # type: ignore[union-attr]

    # Decode: the original 3 ids and the media again (the engine rebuilds the expanded prompt and its
    # multimodal positions); the expanded ids stripped from the handoff; remote_port a string.
    for _ in range(2):
        dreq = image_request(prefill_result={"disaggregated_params": copy.deepcopy(handoff)})
        drequest, dbuilt = build(dreq, DECODE)
        dm = dbuilt.message
        assert list(dm.media) == list(m.media) and dbuilt.has_media
        assert list(dm.token_ids.ids) == [1, PLACEHOLDER, 2] and dbuilt.prompt_tokens == 3
        assert struct_to_json(dm.kv.kv_transfer_params) == {"do_remote_prefill": True, "remote_port": "20097"}
        assert dm.response.prompt_token_ids is False
        dst = ResponseState(drequest, dbuilt, DECODE)
        dst.convert(pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=601)))
        assert dst.prompt_tokens == 601  # vLLM's expanded count is authoritative


def test_aggregated_media_with_url_and_uuid_override() -> None:
    req = image_request(
        multi_modal_data={"image_url": [{"Url": "https://x/a.png"}, "http://x/b.png", {"RawUrl": DATA_URI}]},
        multi_modal_uuids={"image_url": ["u1", "u2", "u3"]},
        extra_args={"mm_hashes": "ignored when uuids are given"},
    )
    _, built = build(req)
    items = built.message.media
    assert [i.WhichOneof("source") for i in items] == ["url", "url", "data_uri"]
    assert [i.uuid for i in items] == ["u1", "u2", "u3"]  # uuids are not padded
    assert built.message.response.prompt_token_ids is False  # aggregated, no prompt logprobs
    assert list(built.message.token_ids.ids) == [1, PLACEHOLDER, 2]


def test_no_uuid_source_gives_empty_uuid() -> None:
    _, built = build({"token_ids": [1], "multi_modal_data": {"image_url": ["https://x"]}})
    assert built.message.media[0].uuid == ""


def test_media_extra_args_keys_consumed_not_forwarded() -> None:
    _, built = build(
        image_request(
            extra_args={"messages": [], "formatted_prompt": "x", "mm_hashes": ["a"], "kv_transfer_params": {"k": 1}}
        )
    )
    assert struct_to_json(built.message.kv.kv_transfer_params) == {"k": 1}


def test_empty_media_list_is_no_media() -> None:
    _, built = build({"token_ids": [1], "multi_modal_data": {"image_url": []}})
    assert len(built.message.media) == 0 and not built.has_media


ERRORS = [
    (
        image_request(multi_modal_data={"pdf_url": [{"Url": "https://x"}]}),
        "vLLM gRPC does not support media modality `pdf_url`",
    ),
    (
        image_request(multi_modal_data={"image_url": [{"Url": "ftp://x"}]}),
        "vLLM gRPC image_url input must use an http://, https://, or data: URI",
    ),
    (
        image_request(multi_modal_data={"image_url": ["file:///etc/passwd"]}),
        "vLLM gRPC image_url input must use an http://, https://, or data: URI",
    ),
    (
        image_request(multi_modal_data={"video_url": ["file:///v.mp4"]}),
        "vLLM gRPC video_url input must use an http://, https://, or data: URI",
    ),
    (
        image_request(multi_modal_data={"video_url": ["https://x/v.mp4"]}, multi_modal_uuids={"video_url": ["v"]}),
        "multimodal cache UUIDs are supported only for image_url; got non-empty multi_modal_uuids.video_url",
    ),
    (
        image_request(multi_modal_data={"image_url": [{"Decoded": {"shape": [1]}}]}),
        "vLLM sidecar cannot dereference pre-decoded RDMA media; configure URL passthrough",
    ),
    (
        image_request(multi_modal_data={"image_url": [{"UuidOnly": "u"}]}),
        "vLLM gRPC requires a media source and cannot resolve UUID-only media",
    ),
    (
        image_request(multi_modal_uuids={"image_url": ["a", "b"]}),
        "multi_modal_uuids.image_url has 2 entries for 1 media items",
    ),
    (
        {"token_ids": [1], "multi_modal_uuids": {"image_url": ["a"]}},
        "multi_modal_uuids were provided without multi_modal_data",
    ),
    (image_request(extra_args={"mm_hashes": ["a", ""]}), "extra_args.mm_hashes[1] must be a non-empty string"),
    (image_request(extra_args={"mm_hashes": [3]}), "extra_args.mm_hashes[0] must be a non-empty string"),
    (image_request(extra_args={"mm_hashes": "abc"}), "extra_args.mm_hashes must be an array of strings"),
    (image_request(extra_args={"mm_hashes": ["a", "b"]}), "extra_args.mm_hashes has 2 entries for 1 media items"),
]


@pytest.mark.parametrize(("req", "message"), ERRORS)
def test_media_errors(req: dict[str, Any], message: str) -> None:
    rejects(req, message)


def prefill_state(**req: Any) -> ResponseState:
    request, built = build(image_request(**req), PREFILL)
    return ResponseState(request, built, PREFILL)


def terminal(**params: Any) -> pb.GenerateResponse:
    finish = pb.FinishInfo(num_output_tokens=1, finish_reason=1)
    finish.kv_transfer_params.CopyFrom(json_to_struct({"do_remote_prefill": True, **params}))
    return pb.GenerateResponse(outputs=pb.SequenceOutput(num_tokens=1, token_ids=[5], finish_info=finish))


def test_prefill_without_expanded_ids() -> None:
    st = prefill_state()
    st.convert(pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=4)))
    with pytest.raises(ProtocolError, match="multimodal prefill did not return expanded prompt token IDs$"):
        st.convert(terminal())
    with pytest.raises(ProtocolError, match="multimodal prefill did not return expanded prompt token IDs$"):
        prefill_state().convert(terminal())  # no prompt_info at all


def test_prefill_expanded_length_mismatch() -> None:
    st = prefill_state()
    st.convert(pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=4, token_ids=[1, 2, 3])))
    with pytest.raises(ProtocolError) as info:
        st.convert(terminal())
    assert (
        str(info.value)
        == "invalid vLLM gRPC response: multimodal prefill returned 3 prompt token IDs for 4 prompt tokens"
    )


# One case-insensitive classification decides both whether a source is accepted and which MediaItem field
# carries it (URI schemes are case-insensitive, RFC 3986 section 3.1).
SOURCES = [
    ("data:image/png;base64,AA==", "data_uri"),
    ("DATA:image/png;base64,AA==", "data_uri"),
    ("Data:image/png;base64,AA==", "data_uri"),
    ("http://host/a.png", "url"),
    ("HTTP://host/a.png", "url"),
    ("https://host/a.png", "url"),
    ("HtTpS://host/a.png", "url"),
]


@pytest.mark.parametrize(("source", "field"), SOURCES)
@pytest.mark.parametrize("wrap", ["Url", "RawUrl", None], ids=["Url", "RawUrl", "bare-string"])
def test_media_source_is_classified_case_insensitively(source: str, field: str, wrap: str | None) -> None:
    assert classify_media_source(source) == field
    raw = source if wrap is None else {wrap: source}
    _, built = build(image_request(multi_modal_data={"image_url": [raw]}))
    item = built.message.media[0]
    assert item.WhichOneof("source") == field
    assert getattr(item, field) == source  # sent as given, scheme case included


@pytest.mark.parametrize("source", ["ftp://x", "file:///etc/passwd", "datа:x", "", "data", "https:/x", " data:x"])
def test_other_sources_are_rejected_by_the_same_classifier(source: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        classify_media_source(source)
    assert str(info.value) == media_source_error("image_url")
    rejects(image_request(multi_modal_data={"image_url": [{"Url": source}]}), media_source_error("image_url"))


# --- media uuid safety: a uuid that could act as a path is refused before anything reaches vLLM ------------


@pytest.mark.parametrize(
    ("uuid", "via"),
    [(u, "multi_modal_uuids") for u in ("../etc", "..", ".", "a/b", "/abs", "a\\b", "a\x00b")]
    # A frontend hash is padded to 64 characters first, so "." or ".." alone cannot come that way.
    + [(u, "mm_hashes") for u in ("../etc", "a/b", "a\\b", "a\x00b")],
)
def test_a_path_like_media_uuid_is_refused_with_natives_text(uuid: str, via: str) -> None:
    if via == "multi_modal_uuids":
        req = image_request(multi_modal_uuids={"image_url": [uuid]})
    else:
        req = image_request(extra_args={"mm_hashes": [uuid]})
    for mode in (AGG, PREFILL, DECODE):
        rejects({**req, "prefill_result": {"disaggregated_params": {}}}, UNSAFE_UUID, mode)


@pytest.mark.parametrize("uuid", ["a..b", "...", "abc", "x.y", "0123456789abcdef", "..a", "a.."])
def test_dots_inside_a_media_uuid_are_fine(uuid: str) -> None:
    _, built = build(image_request(multi_modal_uuids={"image_url": [uuid]}))
    assert built.message.media[0].uuid == uuid


def test_a_null_user_uuid_falls_back_to_nothing_and_mm_hashes_are_not_used_beside_user_uuids() -> None:
    _, built = build(image_request(multi_modal_uuids={"image_url": [None]}))
    assert built.message.media[0].uuid == pad_uuid("0123456789abcdef")  # no user uuid: the frontend's hash
    two = {"image_url": [DATA_URI, DATA_URI]}
    _, built = build(image_request(multi_modal_data=two, multi_modal_uuids={"image_url": ["u", None]}))
    assert [item.uuid for item in built.message.media] == ["u", ""]


# --- video and audio: forwarded with their modality, by URL and by data URI, never with a uuid -------------


@pytest.mark.parametrize(("key", "modality"), [("video_url", pb.MODALITY_VIDEO), ("audio_url", pb.MODALITY_AUDIO)])
@pytest.mark.parametrize(
    ("source", "field"), [("https://host/v.mp4", "url"), ("data:video/mp4;base64,AAAA", "data_uri")]
)
def test_video_and_audio_are_forwarded_with_their_modality(key: str, modality: int, source: str, field: str) -> None:
    req = {"token_ids": [1, PLACEHOLDER], "multi_modal_data": {key: [{"Url": source}]}, "extra_args": {"mm_hashes": []}}
    for mode in (AGG, PREFILL):
        _, built = build(req, mode)
        (item,) = built.message.media
        assert item.modality == modality and item.WhichOneof("source") == field and getattr(item, field) == source
        assert item.uuid == "" and built.has_media


def test_images_then_videos_keep_the_requests_order() -> None:
    req = image_request(multi_modal_data={"image_url": [DATA_URI], "video_url": ["https://h/v.mp4"]})
    _, built = build(req)
    assert [item.modality for item in built.message.media] == [pb.MODALITY_IMAGE, pb.MODALITY_VIDEO]
    assert built.message.media[0].uuid == pad_uuid("0123456789abcdef") and built.message.media[1].uuid == ""


# --- encoder disaggregation: the encode worker's request and the encoder handoff downstream ----------------


def test_an_encode_request_asks_for_one_token_with_the_media_and_no_kv_handoff() -> None:
    req = image_request(extra_args={"mm_hashes": ["0123456789abcdef"], "kv_transfer_params": {"k": 1}})
    req["routing"] = {"dp_rank": 1}
    _, built = build(req, ENCODE)
    m = built.message
    assert m.stopping.max_new_tokens == 1 and m.stopping.min_new_tokens == 1
    assert len(m.media) == 1 and m.media[0].uuid == pad_uuid("0123456789abcdef")
    assert not m.kv.HasField("kv_transfer_params") and not m.kv.HasField("ec_transfer_params")
    assert built.dp_rank is None and built.metadata == ()


@pytest.mark.parametrize(
    ("req", "message"),
    [
        ({"token_ids": [1]}, "encode requests require multimodal media"),
        (
            image_request(multi_modal_data={"audio_url": ["https://h/a.wav"]}),
            "encode requests support image and video media only",
        ),
        (image_request(encoder_result={"ec": 1}), "encode requests must not include encoder_result"),
    ],
)
def test_encode_request_errors(req: dict[str, Any], message: str) -> None:
    rejects(req, message, ENCODE)


@pytest.mark.parametrize("mode", [AGG, PREFILL, DECODE])
def test_the_encoder_handoff_is_forwarded_as_ec_transfer_params(mode: DisaggregationMode) -> None:
    handoff = {"ec_connector": "shm", "mm_hashes": ["h"], "port": 7}
    req = image_request(encoder_result=handoff, prefill_result={"disaggregated_params": {"do_remote_prefill": True}})
    _, built = build(req, mode)
    assert struct_to_json(built.message.kv.ec_transfer_params) == handoff
    rejects({**req, "encoder_result": [1]}, "encoder_result must be a JSON object", mode)


def encode_state() -> ResponseState:
    request, built = build(image_request(), ENCODE)
    return ResponseState(request, built, ENCODE)


def encode_terminal(reason: int = pb.FinishInfo.STOP, tokens: int = 0, **ec: Any) -> pb.GenerateResponse:
    finish = pb.FinishInfo(num_output_tokens=tokens, finish_reason=reason)
    if ec:
        finish.ec_transfer_params.CopyFrom(json_to_struct(ec))
    return pb.GenerateResponse(outputs=pb.SequenceOutput(num_tokens=0, finish_info=finish))


def test_an_encode_terminal_becomes_the_encoder_result() -> None:
    st = encode_state()
    assert st.convert(pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=18))) is None
    chunk = st.convert(encode_terminal(handle="h", mm_hashes=["a"]))
    assert chunk is not None
    assert chunk.to_dict() == {
        "token_ids": [],
        "index": 0,
        "finish_reason": "stop",
        "encoder_result": {"handle": "h", "mm_hashes": ["a"]},
    }
    cancelled = encode_state().convert(encode_terminal(pb.FinishInfo.ABORTED))
    assert cancelled is not None and cancelled.finish_reason == "cancelled" and cancelled.encoder_result is None


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (
            pb.GenerateResponse(outputs=pb.SequenceOutput(num_tokens=1, token_ids=[5])),
            "encode response produced output tokens",
        ),
        (encode_terminal(), "encode terminal is missing valid ec_transfer_params"),
        (
            encode_terminal(pb.FinishInfo.LENGTH, handle="h"),
            "encode terminal has invalid finish reason Some(Length); expected stop or cancelled",
        ),
    ],
)
def test_encode_response_errors(response: pb.GenerateResponse, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        encode_state().convert(response)
    assert str(info.value) == f"invalid vLLM gRPC response: {message}"
