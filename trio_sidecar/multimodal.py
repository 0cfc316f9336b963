"""Multimodal image requests (docs/reference/sidecar.md#multimodal-requests). PURE: no I/O, no Trio.

Theory of operation: aggregated and prefill requests forward image sources to vLLM as ``MediaItem``s; vLLM
expands the image placeholders, so its prompt becomes authoritative. A prefill worker asks for the
expanded prompt ids and hands them to the decode worker inside the opaque KV handoff under
:data:`HANDOFF_KEY`; the decode worker sends those ids (and no media) and strips the key before the
handoff reaches vLLM.
"""

from __future__ import annotations

from typing import Any

from ._proto.vllm import inference_pb2
from .errors import InvalidArgument, ProtocolError

__all__ = [
    "HANDOFF_KEY",
    "IMAGE_KEY",
    "UUID_LENGTH",
    "MEDIA_EXTRA_ARGS_KEYS",
    "MEDIA_SOURCE_ERROR",
    "classify_media_source",
    "has_media",
    "build_media_items",
    "pad_uuid",
    "decode_prompt_token_ids",
    "prefill_handoff_ids",
]

HANDOFF_KEY = "_dynamo_sidecar_multimodal_prompt_token_ids"
IMAGE_KEY = "image_url"
UUID_LENGTH = 64
# extra_args keys the frontend adds for multimodal requests; consumed, never forwarded.
MEDIA_EXTRA_ARGS_KEYS = ("messages", "formatted_prompt", "mm_hashes")

_U32_MAX = 2**32 - 1
MEDIA_SOURCE_ERROR = "vLLM gRPC image input must use an http://, https://, or data: URI"
# URI schemes are case-insensitive (RFC 3986 section 3.1): `DATA:` is a data URI, `HTTPS://` a URL.
_DATA_SCHEME = "data:"
_URL_SCHEMES = ("http://", "https://")


def has_media(multi_modal_data: Any) -> bool:
    """Whether the request carries any media item (of any modality)."""
    if not isinstance(multi_modal_data, dict):
        return multi_modal_data is not None
    return any(bool(items) for items in multi_modal_data.values())


def pad_uuid(value: str) -> str:
    """Right-pad with ``'0'`` to 64 characters so repeated images share vLLM KV-event keys (docs/reference/sidecar.md#multimodal-requests)."""
    return value.ljust(UUID_LENGTH, "0")


def build_media_items(multi_modal_data: Any, multi_modal_uuids: Any, mm_hashes: Any) -> list[inference_pb2.MediaItem]:
    """Validate the media (docs/reference/sidecar.md#multimodal-requests) and build the ``MediaItem``s (empty without media).

    Args:
        multi_modal_data: the request's ``multi_modal_data`` (``{"image_url": [item, ...]}``).
        multi_modal_uuids: the request's ``multi_modal_uuids`` (optional).
        mm_hashes: ``extra_args.mm_hashes`` (``None`` when absent).

    Raises:
        InvalidArgument: with the texts (docs/reference/sidecar.md#multimodal-requests).
    """
    uuids_given = multi_modal_uuids is not None and multi_modal_uuids != {}
    if multi_modal_data is None or multi_modal_data == {}:
        if uuids_given:
            raise InvalidArgument("multi_modal_uuids were provided without multi_modal_data")
        return []
    if not isinstance(multi_modal_data, dict):
        raise InvalidArgument("multi_modal_data must be a JSON object")
    for key in multi_modal_data:
        if key != IMAGE_KEY:
            raise InvalidArgument(f"vLLM gRPC currently supports image_url media only; got `{key}`")
    raw_items = multi_modal_data.get(IMAGE_KEY)
    if raw_items is None:
        raw_items = []
    if not isinstance(raw_items, list):
        raise InvalidArgument(f"multi_modal_data.{IMAGE_KEY} must be an array")

    items: list[inference_pb2.MediaItem] = []
    for raw in raw_items:
        item = inference_pb2.MediaItem(modality=inference_pb2.MODALITY_IMAGE, mime_type="")
        source = _media_source(raw)
        setattr(item, classify_media_source(source), source)
        items.append(item)

    uuids = _uuids(multi_modal_uuids, len(items), uuids_given)
    if uuids is None and mm_hashes is not None and items:
        uuids = _mm_hash_uuids(mm_hashes, len(items))
    if uuids is not None:
        for item, uuid in zip(items, uuids, strict=True):  # lengths checked above
            item.uuid = uuid
    return items


def _media_source(raw: Any) -> str:
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
            raise InvalidArgument(f"unsupported multi_modal_data.{IMAGE_KEY} item `{tag}`")
    else:
        raise InvalidArgument(f"unsupported multi_modal_data.{IMAGE_KEY} item")
    if not isinstance(source, str):
        raise InvalidArgument(MEDIA_SOURCE_ERROR)
    return source


def classify_media_source(source: str) -> str:
    """The ``MediaItem`` source field for an image source: ``"data_uri"`` or ``"url"``.

    The one classification used for both the scheme check and the field, case-insensitively, so
    ``DATA:image/png;base64,...`` is sent as ``data_uri`` and ``HTTPS://host/x`` as ``url``.

    Raises:
        InvalidArgument: ``vLLM gRPC image input must use an http://, https://, or data: URI``.
    """
    scheme = source[:8].lower()
    if scheme.startswith(_DATA_SCHEME):
        return "data_uri"
    if scheme.startswith(_URL_SCHEMES):
        return "url"
    raise InvalidArgument(MEDIA_SOURCE_ERROR)


def _uuids(multi_modal_uuids: Any, count: int, given: bool) -> list[str] | None:
    if not given:
        return None
    if not isinstance(multi_modal_uuids, dict):
        raise InvalidArgument("multi_modal_uuids must be a JSON object")
    for key in multi_modal_uuids:
        if key != IMAGE_KEY:
            raise InvalidArgument("multi_modal_uuids were provided without multi_modal_data")
    entries = multi_modal_uuids.get(IMAGE_KEY)
    if entries is None:
        return None
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise InvalidArgument(f"multi_modal_uuids.{IMAGE_KEY} must be an array of strings")
    if len(entries) != count:
        raise InvalidArgument(f"multi_modal_uuids.{IMAGE_KEY} has {len(entries)} entries for {count} media items")
    return list(entries)


def _mm_hash_uuids(mm_hashes: Any, count: int) -> list[str]:
    if not isinstance(mm_hashes, list) or not all(isinstance(h, str) and h for h in mm_hashes):
        raise InvalidArgument("extra_args.mm_hashes must be an array of non-empty strings")
    if len(mm_hashes) != count:
        raise InvalidArgument(f"extra_args.mm_hashes has {len(mm_hashes)} entries for {count} media items")
    return [pad_uuid(h) for h in mm_hashes]


def decode_prompt_token_ids(prefill_result: Any) -> list[int]:
    """docs/reference/sidecar.md#multimodal-requests: the expanded prompt ids a multimodal decode request sends instead of its own.

    Args:
        prefill_result: the request's ``prefill_result`` (attrs ``PrefillResult`` or ``None``).

    Raises:
        InvalidArgument: with the texts (docs/reference/sidecar.md#multimodal-requests).
    """
    if prefill_result is None:
        raise InvalidArgument("multimodal decode request is missing the prefill result")
    params = getattr(prefill_result, "disaggregated_params", None)
    if not isinstance(params, dict) or HANDOFF_KEY not in params:
        raise InvalidArgument("multimodal decode request is missing expanded prefill token IDs")
    ids = params[HANDOFF_KEY]
    if not isinstance(ids, list):
        raise InvalidArgument(f"multimodal prefill token IDs are invalid: expected an array, got {_json_type(ids)}")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _U32_MAX:
            raise InvalidArgument(
                f"multimodal prefill token IDs are invalid: entry {i} ({token!r}) is not an unsigned 32-bit integer"
            )
    if not ids:
        raise InvalidArgument("multimodal prefill token IDs must not be empty")
    return list(ids)


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


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
