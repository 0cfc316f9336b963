"""Exact multimodal KV routing: the image placeholder token of the served model (docs/reference/worker.md#multimodal-kv-routing). PURE: no I/O, no Trio, no Dynamo.

Theory of operation: for a model that routes images exactly, Dynamo's frontend replaces each image's
placeholder run in the routing tokens with a value derived from the image's hash, and sends that hash to
the worker, which passes it to vLLM as the ``MediaItem.uuid`` (:func:`trio_sidecar.core.multimodal.pad_uuid`).
vLLM stores the image's blocks with the placeholder ids and reports the uuid in ``BlockStored.extra_keys``.
The KV publisher can only rewrite those placeholder runs the way the frontend did when it knows the
placeholder id; without it the router's hashes of every block from the image on never match the worker's,
and an image prompt goes to a worker that does not hold it.

The placeholder id is resolved like the native 1.6.1 sidecar does, only for a model that advertises
multimodal support: the model directory (a local directory as is, else Dynamo's ``fetch_model`` of its
config files, at most :data:`FETCH_TIMEOUT_SECONDS`), then Dynamo's own resolver
(``dynamo._core.resolve_routing_image_token_id``, the frontend's check: a supported model family, its
``preprocessor_config.json`` and the ``config.json`` placeholder field). The edge does the fetching and
calls the resolver; this module decides the outcome and its log line, with native's texts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

__all__ = [
    "FETCH_FAILED",
    "FETCH_TIMED_OUT",
    "FETCH_TIMEOUT_SECONDS",
    "RESOLVED",
    "UNAVAILABLE",
    "ImageTokenOutcome",
    "Resolver",
    "fetch_failed",
    "resolve_image_token",
]

#: How long the model's configuration files may take to fetch (native: ``fetch_timeout_secs=30``).
FETCH_TIMEOUT_SECONDS = 30.0

RESOLVED = "Resolved image placeholder token for multimodal KV routing"
UNAVAILABLE = "Exact multimodal routing prerequisites are unavailable; source metadata will omit the image token"
FETCH_FAILED = "Unable to fetch model configuration; exact multimodal KV routing is disabled"
FETCH_TIMED_OUT = "model configuration fetch timed out"

_U32_MAX = 2**32 - 1

#: ``(model_id, model_dir) -> token id or None``: Dynamo's ``resolve_routing_image_token_id``.
Resolver = Callable[[str, str], "int | None"]


@attrs.frozen
class ImageTokenOutcome:
    """The placeholder id for the KV publishers (None: image blocks are keyed by their raw ids) and the
    line to log about it."""

    image_token_id: int | None
    level: int
    message: str


def resolve_image_token(model: str, model_dir: str, resolver: Resolver) -> ImageTokenOutcome:
    """Ask ``resolver`` for the placeholder id of ``model`` whose files are in ``model_dir``.

    Anything but an unsigned 32-bit integer (None when the model family, its ``preprocessor_config.json`` or
    its placeholder field is missing) leaves exact multimodal routing off, with native's warning.
    """
    token = resolver(model, model_dir)
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _U32_MAX:
        return ImageTokenOutcome(None, logging.WARNING, f"{UNAVAILABLE} (model={model}, model_dir={model_dir})")
    return ImageTokenOutcome(token, logging.INFO, f"{RESOLVED} (model={model}, image_token_id={token})")


def fetch_failed(model: str, error: str) -> ImageTokenOutcome:
    """The model's configuration could not be fetched (``error`` is the fetch's own text, or
    :data:`FETCH_TIMED_OUT`): exact multimodal routing is off."""
    return ImageTokenOutcome(
        None,
        logging.WARNING,
        f"{FETCH_FAILED} (model={model}, fetch_timeout_secs={FETCH_TIMEOUT_SECONDS:g}, error={error})",
    )
