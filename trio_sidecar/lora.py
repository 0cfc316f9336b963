"""LoRA adapter lifecycle, the pure part (docs/lora.md): request checks, texts and JSON answers. No Trio.

The texts and the order of the checks are the native 1.6.1 sidecar's, as observed (docs/dynamo.md, "LoRA
and RL controls in the native 1.6.1 sidecar, as observed"). Control calls, locking and discovery records
live in :mod:`trio_sidecar.lora_lifecycle`; the Dynamo surface (``/v1/loras`` and the ``update/*`` engine
routes on the system port) in :mod:`trio_sidecar.dynamo.lora_routes`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs

from .errors import InvalidArgument, ProtocolError, SidecarError, native_error_text

__all__ = [
    "LORA_UNAVAILABLE",
    "LoraAdapter",
    "LoadRequest",
    "LoadResult",
    "lora_serving_requested",
    "hot_swap_requested",
    "parse_load_body",
    "parse_lora_name",
    "check_adapter_name",
    "check_capacity",
    "check_hot_swap",
    "not_loaded",
    "resolve_local_source",
    "list_answer",
    "load_answer",
    "unload_answer",
    "error_answer",
]

#: Logged at start-up when the LoRA surface stays off (the native sidecar's line).
LORA_UNAVAILABLE = (
    "LoRA lifecycle is not available: it requires DYN_LORA_ENABLED and a vLLM server advertising LoRA "
    "support with max_loras > 0"
)
#: The embedded API's refusal when the server has no LoRA support (no environment variable applies there).
LORA_UNSUPPORTED = "LoRA lifecycle is not available: the vLLM server does not advertise LoRA support with max_loras > 0"

_TRUE = {"1", "true", "yes", "on"}
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


def lora_serving_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """``DYN_LORA_ENABLED``: the operator's opt-in (the server must also report ``max_loras`` > 0)."""
    return _truthy(environ.get("DYN_LORA_ENABLED"))


def hot_swap_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """``DYN_LORA_HOTSWAP_ENABLED``: a reload of a loaded name is then refused instead of answered as a no-op."""
    return _truthy(environ.get("DYN_LORA_HOTSWAP_ENABLED"))


@attrs.frozen
class LoraAdapter:
    """One adapter as vLLM reports it (``vllm.LoraAdapter``): ``lora_id`` is vLLM's, counting from 1."""

    name: str
    lora_id: int
    source_path: str


@attrs.frozen
class LoadResult:
    """The outcome of a load: the adapter, and whether it was already loaded (nothing was sent to vLLM)."""

    adapter: LoraAdapter
    already_loaded: bool


@attrs.frozen
class LoadRequest:
    """A checked load request: the adapter name, the ``file://`` URI as given, and its local path."""

    name: str
    uri: str
    path: str


def parse_lora_name(body: Mapping[str, Any]) -> str:
    """The ``lora_name`` of a request body (unload, and the first check of a load)."""
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument("lora_name must be a non-empty string")
    return name


def parse_load_body(body: Mapping[str, Any]) -> LoadRequest:
    """Check a load body ``{"lora_name": …, "source": {"uri": …}}`` before anything is sent to vLLM.

    Only ``file://`` URIs with an absolute local path are loaded; ``hf://`` and ``s3://`` pass the scheme
    check like the native sidecar's, and are then refused by :func:`resolve_local_source` (trio-sidecar
    downloads nothing).

    Raises:
        InvalidArgument: with the native sidecar's texts.
    """
    name = parse_lora_name(body)
    source = body.get("source")
    uri = source.get("uri") if isinstance(source, Mapping) else None
    if not isinstance(uri, str) or not uri:
        raise InvalidArgument("source.uri must be a non-empty string")
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme not in ("file", "hf", "s3"):
        raise InvalidArgument("source.uri must use the file://, hf://, or s3:// scheme")
    path = ""
    if scheme == "file":
        parts = urlsplit(uri)
        if parts.netloc or parts.query or parts.fragment or not parts.path.startswith("/"):
            raise InvalidArgument(
                "file source.uri must contain an absolute local path without a host, query, or fragment"
            )
        path = parts.path
    return LoadRequest(name=name, uri=uri, path=path)


def check_adapter_name(name: str, base_names: Collection[str]) -> None:
    """An adapter may not take the served model's name or one of its aliases (it would shadow the base model)."""
    if name in base_names:
        raise InvalidArgument(f"LoRA adapter `{name}` conflicts with the base model name or one of its aliases")


def check_hot_swap(name: str, hot_swap: bool) -> None:
    """With ``DYN_LORA_HOTSWAP_ENABLED``, loading a loaded name again is refused (vLLM's gRPC has no swap)."""
    if hot_swap:
        raise InvalidArgument(
            f"LoRA adapter `{name}` is already loaded; hot swap is not supported by the gRPC backend. "
            "Load new weights under a different name."
        )


def check_capacity(loaded: int, max_loras: int) -> None:
    """At most ``max_loras`` adapters (checked before the source, from ``ListLoras``)."""
    if loaded >= max_loras:
        raise InvalidArgument(f"LoRA capacity exceeded: at most {max_loras} adapter(s) may be loaded")


def not_loaded(name: str, loaded: Sequence[str]) -> InvalidArgument:
    """The unload of a name vLLM does not hold; ``loaded`` in vLLM's order."""
    listed = "[" + ", ".join('"' + n.replace("\\", "\\\\").replace('"', '\\"') + '"' for n in loaded) + "]"
    return InvalidArgument(f"LoRA adapter '{name}' not found. Available LoRAs: {listed}")


def resolve_local_source(request: LoadRequest) -> str:
    """The directory to hand to ``LoadLora``: it must exist and hold ``adapter_config.json`` and weights.

    Reads the local file system only.

    Raises:
        ProtocolError: the directory does not exist (the native sidecar's text, kind ``Internal``).
        InvalidArgument: no adapter files, or a remote source (``hf://``, ``s3://``: nothing is downloaded).
    """
    if not request.path:
        raise InvalidArgument(
            f"LoRA source `{request.uri}` is not supported by trio-sidecar: only file:// sources are loaded "
            "(it downloads nothing)"
        )
    path = request.path
    if not os.path.exists(path):
        raise ProtocolError(f"failed to resolve LoRA source `{request.uri}`: Local LoRA not found: {request.uri}")
    has_config = os.path.isfile(os.path.join(path, "adapter_config.json"))
    has_weights = any(os.path.isfile(os.path.join(path, name)) for name in _ADAPTER_WEIGHTS)
    if not (os.path.isdir(path) and has_config and has_weights):
        raise InvalidArgument(f"LoRA directory `{path}` must contain adapter_config.json and adapter weights")
    return path


# --- JSON answers of the engine routes (the system server's /v1/loras passes them on) -----------------------


def list_answer(adapters: Sequence[LoraAdapter]) -> dict[str, Any]:
    loras = {adapter.name: adapter.lora_id for adapter in adapters}
    return {"status": "success", "count": len(loras), "loras": loras}


def load_answer(result: LoadResult) -> dict[str, Any]:
    adapter = result.adapter
    what = "already loaded" if result.already_loaded else "loaded successfully"
    return {
        "status": "success",
        "message": f"LoRA adapter '{adapter.name}' {what}",
        "lora_name": adapter.name,
        "lora_id": adapter.lora_id,
        "hot_swap": False,
    }


def unload_answer(adapter: LoraAdapter) -> dict[str, Any]:
    return {
        "status": "success",
        "message": f"LoRA adapter '{adapter.name}' unloaded successfully",
        "lora_name": adapter.name,
        "lora_id": adapter.lora_id,
    }


def error_answer(error: SidecarError, body: Mapping[str, Any]) -> dict[str, Any]:
    """A refused update: HTTP 200 on ``/engine/update/*``, 500 on ``/v1/loras`` (the system server decides)."""
    name = body.get("lora_name")
    return {
        "status": "error",
        "message": native_error_text(error),
        "lora_name": name if isinstance(name, str) else None,
    }
