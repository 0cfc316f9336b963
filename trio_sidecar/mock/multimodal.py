"""Image and video media acceptance and placeholder expansion (docs/reference/mock.md#multimodal). PURE.

Media are never fetched or decoded. With ``--supports-multimodal`` each placeholder token (``image_token_id``,
default 31999) in ``token_ids`` stands for one ``media`` item, an image or a video (the mock treats a video
like an image), and is expanded to ``tokens_per_image`` copies (default 16), which is what the scheduler
computes and what ``PromptInfo`` reports. A request without media (already-expanded ids) is taken as-is.

Each expanded run is one multimodal feature (:class:`~trio_sidecar.mock.kvcache.MmSpan`) whose identifier is
the item's ``uuid``, or the hex blake3 digest of its source without one (vLLM's content hash plays that
part). The KV cache keys the blocks a feature overlaps on its identifier and reports it in ``BlockStored``
``extra_keys``, as vLLM does (docs/reference/mock.md#kv-cache-and-kv-events).
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.generation import RequestRejected
from trio_sidecar.mock.kvcache import MmSpan

__all__ = [
    "DEFAULT_IMAGE_TOKEN_ID",
    "DEFAULT_TOKENS_PER_IMAGE",
    "MULTIMODAL_DISABLED",
    "UNSUPPORTED_MODALITY",
    "check_media",
    "expand_image_placeholders",
    "image_spans",
    "media_identifier",
]

DEFAULT_IMAGE_TOKEN_ID = 31999
DEFAULT_TOKENS_PER_IMAGE = 16
UNSUPPORTED_MODALITY = "only image and video media are supported by the mock server"
_MODALITIES = (pb.MODALITY_IMAGE, pb.MODALITY_VIDEO)
MULTIMODAL_DISABLED = "multimodal input is not supported by this mock server; start it with --supports-multimodal"


def _invalid(message: str) -> RequestRejected:
    return RequestRejected(StatusCode.INVALID_ARGUMENT, message)


def check_media(media: Sequence[pb.MediaItem], supports_multimodal: bool) -> None:
    """Validate ``GenerateRequest.media`` (docs/reference/mock.md#request-validation rows 9–10).

    Raises:
        RequestRejected: ``INVALID_ARGUMENT`` naming the first bad item.
    """
    if not media:
        return
    if not supports_multimodal:
        raise _invalid(MULTIMODAL_DISABLED)
    for i, item in enumerate(media):
        if item.modality not in _MODALITIES:
            raise _invalid(UNSUPPORTED_MODALITY)
        source = item.WhichOneof("source")
        if source is None or not getattr(item, source):
            raise _invalid(f"media item {i} has no source")


def expand_image_placeholders(
    token_ids: Sequence[int], media_count: int, image_token_id: int, tokens_per_image: int
) -> tuple[int, ...]:
    """Replace each placeholder by ``tokens_per_image`` copies of it (docs/reference/mock.md#multimodal).

    With no media the ids are returned unchanged.

    Raises:
        RequestRejected: ``INVALID_ARGUMENT`` when the placeholder count differs from ``media_count``.
    """
    if media_count == 0:
        return tuple(token_ids)
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != media_count:
        raise _invalid(f"expected {media_count} image placeholders in token_ids, found {found}")
    out: list[int] = []
    for t in token_ids:
        if t == image_token_id:
            out.extend([image_token_id] * tokens_per_image)
        else:
            out.append(t)
    return tuple(out)


def media_identifier(item: pb.MediaItem) -> str:
    """The feature identifier of one media item: its ``uuid``, else the hex blake3 digest of its source."""
    if item.uuid:
        return item.uuid
    source = item.WhichOneof("source")
    value = getattr(item, source) if source is not None else b""
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return blake3.blake3(data).hexdigest()


def image_spans(
    token_ids: Sequence[int], media: Sequence[pb.MediaItem], image_token_id: int, tokens_per_image: int
) -> tuple[MmSpan, ...]:
    """The features of the expanded prompt: the ``i``-th placeholder of the *unexpanded* ``token_ids`` becomes
    the run ``[offset, offset + tokens_per_image)`` of media item ``i``. Call after
    :func:`expand_image_placeholders` accepted the same ids (one placeholder per item)."""
    spans: list[MmSpan] = []
    for position, token in enumerate(token_ids):
        if token == image_token_id:
            index = len(spans)
            offset = position + index * (tokens_per_image - 1)
            spans.append(MmSpan(offset, tokens_per_image, media_identifier(media[index])))
    return tuple(spans)
