"""Multimodal requests: images, videos and audio by URL or data URI (docs/reference/sidecar.md#multimodal-requests). PURE: no I/O, no Trio.

Theory of operation: aggregated, prefill and decode requests forward their media sources to vLLM as
``MediaItem``s (one per item, in the request's order, modality from the ``multi_modal_data`` key); vLLM
expands the placeholders, so its prompt count becomes authoritative. A prefill worker also asks for the
expanded prompt ids and hands them to the decode worker inside the opaque KV handoff under
:data:`HANDOFF_KEY`, as the native 1.6.1 sidecar does. The decode worker strips that key before the handoff
reaches vLLM and sends the *original* prompt ids with the media again: the KV transfer carries the prompt's
KV blocks but not the model-specific multimodal position metadata (Qwen-VL's mRoPE positions), so the
decode engine must rebuild the expanded prompt and its positions from the prompt and the media itself
(the Dynamo repository's ``lib/sidecar/vllm/README.md``).

Media uuids become engine cache and connector keys, so a uuid that could act as a path (``.``, ``..``, or one
holding ``/``, ``\\`` or NUL) is refused before anything reaches vLLM, with native's text.
"""

from __future__ import annotations

from typing import Any

from .._proto.vllm import inference_pb2
from .errors import InvalidArgument, ProtocolError

__all__ = [
    "HANDOFF_KEY",
    "IMAGE_KEY",
    "MEDIA_KEYS",
    "UUID_LENGTH",
    "MEDIA_EXTRA_ARGS_KEYS",
    "UNSAFE_UUID",
    "classify_media_source",
    "check_cache_uuids",
    "check_media_uuid",
    "check_encode_request",
    "has_media",
    "build_media_items",
    "media_source_error",
    "pad_uuid",
    "prefill_handoff_ids",
]

HANDOFF_KEY = "_dynamo_sidecar_multimodal_prompt_token_ids"
IMAGE_KEY = "image_url"
VIDEO_KEY = "video_url"
#: ``multi_modal_data`` keys and the modality each is sent as (native 1.6.1's table).
MEDIA_KEYS = {
    IMAGE_KEY: inference_pb2.MODALITY_IMAGE,
    VIDEO_KEY: inference_pb2.MODALITY_VIDEO,
    "audio_url": inference_pb2.MODALITY_AUDIO,
}
UUID_LENGTH = 64
# extra_args keys the frontend adds for multimodal requests; consumed, never forwarded.
MEDIA_EXTRA_ARGS_KEYS = ("messages", "formatted_prompt", "mm_hashes")
UNSAFE_UUID = (
    "multimodal media uuid must be a safe identifier without path separators, NUL bytes, or dot path components"
)

# URI schemes are case-insensitive (RFC 3986 section 3.1): `DATA:` is a data URI, `HTTPS://` a URL.
_DATA_SCHEME = "data:"
_URL_SCHEMES = ("http://", "https://")


def media_source_error(key: str) -> str:
    """The text for a source that is neither a URL nor a data URI, for the ``multi_modal_data`` key ``key``."""
    return f"vLLM gRPC {key} input must use an http://, https://, or data: URI"


def has_media(multi_modal_data: Any) -> bool:
    """Whether the request carries any media item (of any modality)."""
    if not isinstance(multi_modal_data, dict):
        return multi_modal_data is not None
    return any(bool(items) for items in multi_modal_data.values())


def pad_uuid(value: str) -> str:
    """Right-pad with ``'0'`` to 64 characters so repeated images share vLLM KV-event keys (docs/reference/sidecar.md#multimodal-requests)."""
    return value.ljust(UUID_LENGTH, "0")


def check_media_uuid(uuid: str) -> None:
    """Refuse a media uuid that could act as a path component (native 1.6.1's rule, with its text).

    ``.`` and ``..`` themselves, and any uuid holding ``/``, ``\\`` or NUL, are refused; ``a..b`` is fine.

    Raises:
        InvalidArgument: :data:`UNSAFE_UUID`.
    """
    if uuid in (".", "..") or any(c in uuid for c in "/\\\0"):
        raise InvalidArgument(UNSAFE_UUID)


def check_encode_request(multi_modal_data: Any, encoder_result: Any) -> None:
    """An encode worker's request must carry images or videos and no encoder handoff (native 1.6.1's checks).

    Raises:
        InvalidArgument: with native's texts.
    """
    if not has_media(multi_modal_data):
        raise InvalidArgument("encode requests require multimodal media")
    if isinstance(multi_modal_data, dict) and any(
        key not in (IMAGE_KEY, VIDEO_KEY) and items for key, items in multi_modal_data.items()
    ):
        raise InvalidArgument("encode requests support image and video media only")
    if encoder_result is not None:
        raise InvalidArgument("encode requests must not include encoder_result")


def check_cache_uuids(multi_modal_uuids: Any) -> None:
    """Cache uuids are honoured for images only: a non-empty uuid of another modality is refused.

    Raises:
        InvalidArgument: ``multimodal cache UUIDs are supported only for image_url; got non-empty
            multi_modal_uuids.{key}`` (native's text).
    """
    if not isinstance(multi_modal_uuids, dict):
        return
    for key, entries in multi_modal_uuids.items():
        if key != IMAGE_KEY and isinstance(entries, list) and any(isinstance(e, str) and e for e in entries):
            raise InvalidArgument(
                f"multimodal cache UUIDs are supported only for {IMAGE_KEY}; got non-empty multi_modal_uuids.{key}"
            )


def build_media_items(multi_modal_data: Any, multi_modal_uuids: Any, mm_hashes: Any) -> list[inference_pb2.MediaItem]:
    """Validate the media (docs/reference/sidecar.md#multimodal-requests) and build the ``MediaItem``s (empty without media).

    Args:
        multi_modal_data: the request's ``multi_modal_data`` (``{"image_url": [item, ...], "video_url": ...}``).
        multi_modal_uuids: the request's ``multi_modal_uuids`` (optional; entries may be null).
        mm_hashes: ``extra_args.mm_hashes`` (``None`` when absent): the image uuids when the caller gave none.

    Raises:
        InvalidArgument: with the texts (docs/reference/sidecar.md#multimodal-requests).
    """
    check_cache_uuids(multi_modal_uuids)
    if multi_modal_uuids is not None and not isinstance(multi_modal_uuids, dict):
        raise InvalidArgument("multi_modal_uuids must be a JSON object")
    if multi_modal_data is None or multi_modal_data == {}:
        if multi_modal_uuids and any(entries for entries in multi_modal_uuids.values()):
            raise InvalidArgument("multi_modal_uuids were provided without multi_modal_data")
        return []
    if not isinstance(multi_modal_data, dict):
        raise InvalidArgument("multi_modal_data must be a JSON object")
    uuids_by_key = multi_modal_uuids or {}
    image_items = multi_modal_data.get(IMAGE_KEY)
    forwarded = None
    if image_items and not _has_user_uuid(uuids_by_key.get(IMAGE_KEY)):
        forwarded = _mm_hash_uuids(mm_hashes)

    items: list[inference_pb2.MediaItem] = []
    for key, raw_items in multi_modal_data.items():
        if raw_items is None or raw_items == []:
            continue
        modality = MEDIA_KEYS.get(key)
        if modality is None:
            raise InvalidArgument(f"vLLM gRPC does not support media modality `{key}`")
        if not isinstance(raw_items, list):
            raise InvalidArgument(f"multi_modal_data.{key} must be an array")
        uuids = _uuids(uuids_by_key.get(key), key, len(raw_items))
        if key == IMAGE_KEY and forwarded is not None and len(forwarded) != len(raw_items):
            raise InvalidArgument(f"extra_args.mm_hashes has {len(forwarded)} entries for {len(raw_items)} media items")
        for index, raw in enumerate(raw_items):
            item = inference_pb2.MediaItem(modality=modality, mime_type="")
            source = _media_source(raw, key)
            setattr(item, classify_media_source(source, key), source)
            if key == IMAGE_KEY:
                uuid = (uuids[index] if uuids is not None else None) or (
                    forwarded[index] if forwarded is not None else ""
                )
                if uuid:
                    check_media_uuid(uuid)
                    item.uuid = uuid
            items.append(item)
    return items


def _has_user_uuid(entries: Any) -> bool:
    return isinstance(entries, list) and any(isinstance(e, str) and e for e in entries)


def _media_source(raw: Any, key: str) -> str:
    if isinstance(raw, str):
        source: Any = raw
    elif isinstance(raw, dict) and len(raw) == 1:
        ((tag, value),) = raw.items()
        if tag in ("Url", "RawUrl"):
            source = value
        elif tag == "Decoded":
            raise InvalidArgument("vLLM sidecar cannot dereference pre-decoded RDMA media; configure URL passthrough")
        elif tag == "UuidOnly":
            raise InvalidArgument("vLLM gRPC requires a media source and cannot resolve UUID-only media")
        else:
            raise InvalidArgument(f"unsupported multi_modal_data.{key} item `{tag}`")
    else:
        raise InvalidArgument(f"unsupported multi_modal_data.{key} item")
    if not isinstance(source, str):
        raise InvalidArgument(media_source_error(key))
    return source


def classify_media_source(source: str, key: str = IMAGE_KEY) -> str:
    """The ``MediaItem`` source field for a media source: ``"data_uri"`` or ``"url"``.

    The one classification used for both the scheme check and the field, case-insensitively, so
    ``DATA:image/png;base64,...`` is sent as ``data_uri`` and ``HTTPS://host/x`` as ``url``.

    Raises:
        InvalidArgument: :func:`media_source_error` of ``key``.
    """
    scheme = source[:8].lower()
    if scheme.startswith(_DATA_SCHEME):
        return "data_uri"
    if scheme.startswith(_URL_SCHEMES):
        return "url"
    raise InvalidArgument(media_source_error(key))


def _uuids(entries: Any, key: str, count: int) -> list[str | None] | None:
    if entries is None:
        return None
    if not isinstance(entries, list) or not all(e is None or isinstance(e, str) for e in entries):
        raise InvalidArgument(f"multi_modal_uuids.{key} must be an array of strings")
    if len(entries) != count:
        raise InvalidArgument(f"multi_modal_uuids.{key} has {len(entries)} entries for {count} media items")
    return list(entries)


def _mm_hash_uuids(mm_hashes: Any) -> list[str] | None:
    if mm_hashes is None:
        return None
    if not isinstance(mm_hashes, list):
        raise InvalidArgument("extra_args.mm_hashes must be an array of strings")
    if not mm_hashes:
        return None
    for index, value in enumerate(mm_hashes):
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f"extra_args.mm_hashes[{index}] must be a non-empty string")
    return [pad_uuid(h) for h in mm_hashes]


def prefill_handoff_ids(prompt_info: Any) -> list[int]:
    """docs/reference/sidecar.md#multimodal-requests: the expanded prompt ids a multimodal prefill terminal hands to decode.

    Args:
        prompt_info: the stored ``PromptInfo`` message, or ``None`` if the server sent none.

    Raises:
        ProtocolError: with the texts (docs/reference/sidecar.md#multimodal-requests).
    """
    if prompt_info is None or len(prompt_info.token_ids) == 0:
        raise ProtocolError("multimodal prefill did not return expanded prompt token IDs")
    if len(prompt_info.token_ids) != prompt_info.num_prompt_tokens:
        raise ProtocolError(
            f"multimodal prefill returned {len(prompt_info.token_ids)} prompt token IDs for "
            f"{prompt_info.num_prompt_tokens} prompt tokens"
        )
    return list(prompt_info.token_ids)
