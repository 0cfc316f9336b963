"""LoRA requests, the pure half of the adapter lifecycle (docs/lora.md): checks, texts and JSON answers. No Trio.

The texts and the order of the checks are the native 1.6.1 sidecar's, as observed (docs/dynamo.md, "LoRA
and RL controls in the native 1.6.1 sidecar, as observed"). Control calls, locking and discovery records
live in :mod:`trio_sidecar.shell.lora_lifecycle`; the Dynamo surface (``/v1/loras`` and the ``update/*`` engine
routes on the system port) in :mod:`trio_sidecar.dynamo.lora_routes`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

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
    "check_inventory",
    "discovery_suffix",
    "source_not_resolved",
    "check_adapter_directory",
    "check_capacity",
    "check_hot_swap",
    "not_loaded",
    "resolve_local_source",
    "list_answer",
    "load_answer",
    "unload_answer",
    "error_answer",
    "list_error_answer",
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
_SLUG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")
#: Dynamo's Python downloader prefixes its errors with this; the native sidecar's texts do not have it.
_DOWNLOAD_FAILED = "Download failed: "


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
    """The ``lora_name`` of a request body (unload, and the first check of a load).

    A name of white space only is refused; the name is returned as given (an unload does not trim it, a load
    does: :func:`parse_load_body`), as the native sidecar's.
    """
    name = body.get("lora_name")
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgument("lora_name must be a non-empty string")
    return name


def parse_load_body(body: Mapping[str, Any]) -> LoadRequest:
    """Check a load body ``{"lora_name": …, "source": {"uri": …}}`` before anything is sent to vLLM.

    ``file://`` URIs must hold an absolute local path; ``hf://`` and ``s3://`` are resolved later (downloaded
    by ``trio-sidecar run``; refused by the embedded API's default :func:`resolve_local_source`).

    Raises:
        InvalidArgument: with the native sidecar's texts.
    """
    name = parse_lora_name(body).strip()
    source = body.get("source")
    uri = source.get("uri") if isinstance(source, Mapping) else None
    if not isinstance(uri, str) or not uri.strip():
        raise InvalidArgument("source.uri must be a non-empty string")
    uri = uri.strip()
    # Prefix checks, case-sensitive, like the native sidecar's (``FILE:///x`` is refused).
    if not uri.startswith(("file://", "hf://", "s3://")):
        raise InvalidArgument("source.uri must use the file://, hf://, or s3:// scheme")
    path = ""
    if uri.startswith("file://"):
        if not uri.startswith("file:///") or "?" in uri or "#" in uri:
            raise InvalidArgument(
                "file source.uri must contain an absolute local path without a host, query, or fragment"
            )
        path = uri.removeprefix("file://")  # as Dynamo's local source: no percent-decoding
    return LoadRequest(name=name, uri=uri, path=path)


def discovery_suffix(name: str) -> str:
    """The key suffix of an adapter's discovery record: Dynamo's slug of the name.

    Lowercase; every character other than ``a-z``, ``0-9``, ``-`` and ``_`` becomes ``_``; leading ``_``
    are dropped (``Slug::slugify`` in Dynamo's public source, ``lib/runtime/src/slug.rs``). So ``A.b`` and
    ``a_b`` share the record ``…/{instance}/a_b``.
    """
    slug = "".join(c if c in _SLUG_CHARS else "_" for c in name.lower())
    return slug.lstrip("_")


def check_adapter_name(name: str, base_names: Collection[str], loaded: Sequence[LoraAdapter] = ()) -> None:
    """The native sidecar's name checks, in its order (after ``ListLoras``, before "already loaded").

    An adapter may not take the served model's name or one of its aliases (it would shadow the base model),
    its name must give a non-empty discovery suffix, and that suffix may not be the one of another adapter
    vLLM holds (publishing it would overwrite that adapter's discovery record).
    """
    if name in base_names:
        raise InvalidArgument(f"LoRA adapter `{name}` conflicts with the base model name or one of its aliases")
    suffix = discovery_suffix(name)
    if not suffix:
        raise InvalidArgument(f"LoRA adapter `{name}` does not produce a usable discovery suffix")
    clash = next((a for a in loaded if a.name != name and discovery_suffix(a.name) == suffix), None)
    if clash is not None:
        raise InvalidArgument(
            f"LoRA adapter `{name}` derives the discovery suffix `{suffix}`, which is already used by loaded "
            f"adapter `{clash.name}`; publishing it would overwrite that adapter's discovery record"
        )


def check_inventory(adapters: Sequence[LoraAdapter]) -> None:
    """What ``ListLoras`` returned must be keyable without ambiguity (the native sidecar's checks and texts).

    Applied to the lists a list, a load and a reconciliation work from (not an unload's, as native). A name
    clash through the discovery key arises when another client loaded ``A.b`` and ``a_b`` into vLLM.

    Raises:
        ProtocolError: the first problem, in the native sidecar's order.
    """
    names: set[str] = set()
    ids: set[int] = set()
    suffixes: set[str] = set()
    for adapter in adapters:
        name = adapter.name
        if not name.strip():
            raise ProtocolError("ListLoras returned an adapter with an empty name")
        if adapter.lora_id <= 0:
            raise ProtocolError(f"ListLoras returned adapter `{name}` with a non-positive id {adapter.lora_id}")
        if not adapter.source_path.strip():
            raise ProtocolError(f"ListLoras returned adapter `{name}` without a source path")
        if name in names:
            raise ProtocolError(f"ListLoras returned duplicate adapter name `{name}`")
        if adapter.lora_id in ids:
            raise ProtocolError(f"ListLoras returned duplicate adapter id {adapter.lora_id}")
        suffix = discovery_suffix(name)
        if not suffix:
            raise ProtocolError(f"adapter `{name}` does not produce a usable discovery suffix")
        if suffix in suffixes:
            raise ProtocolError(
                f"adapter `{name}` derives the discovery suffix `{suffix}`, which another loaded adapter already uses"
            )
        names.add(name)
        ids.add(adapter.lora_id)
        suffixes.add(suffix)


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


def source_not_resolved(uri: str, reason: str) -> ProtocolError:
    """A source that could not be resolved to a local directory (the native sidecar's text, kind ``Internal``).

    ``reason`` is the downloader's message; the ``Download failed:`` prefix of Dynamo's Python binding is
    dropped, the native sidecar calls the same downloader from Rust and has none.
    """
    reason = reason.removeprefix(_DOWNLOAD_FAILED)
    return ProtocolError(f"failed to resolve LoRA source `{uri}`: {reason}")


def check_adapter_directory(path: str) -> str:
    """The canonical directory to hand to ``LoadLora``: it must hold ``adapter_config.json`` and weights.

    Reads the local file system only. Like the native sidecar, the path is canonicalized (symbolic links
    resolved) first, and the text names the canonical path.

    Raises:
        InvalidArgument: no adapter files.
    """
    canonical = os.path.realpath(path)
    has_config = os.path.isfile(os.path.join(canonical, "adapter_config.json"))
    has_weights = any(os.path.isfile(os.path.join(canonical, name)) for name in _ADAPTER_WEIGHTS)
    if not (os.path.isdir(canonical) and has_config and has_weights):
        raise InvalidArgument(f"LoRA directory `{canonical}` must contain adapter_config.json and adapter weights")
    return canonical


def resolve_local_source(request: LoadRequest) -> str:
    """The embedded API's default source resolution: ``file://`` only, no download.

    ``trio-sidecar run`` resolves ``hf://`` and ``s3://`` too, with Dynamo's downloader (docs/lora.md#sources).

    Raises:
        ProtocolError: the directory does not exist (the native sidecar's text, kind ``Internal``).
        InvalidArgument: no adapter files, or a remote source (``hf://``, ``s3://``).
    """
    if not request.path:
        raise InvalidArgument(
            f"LoRA source `{request.uri}` is not supported without a source resolver: only file:// sources are "
            "loaded (see docs/lora.md#sources)"
        )
    if not os.path.exists(request.path):
        raise source_not_resolved(request.uri, f"Local LoRA not found: {request.uri}")
    return check_adapter_directory(request.path)


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


def list_error_answer(error: SidecarError) -> dict[str, Any]:
    """A refused list: like :func:`error_answer` without ``lora_name`` (observed on the native sidecar)."""
    return {"status": "error", "message": native_error_text(error)}


def error_answer(error: SidecarError, body: Mapping[str, Any]) -> dict[str, Any]:
    """A refused update: HTTP 200 on ``/engine/update/*``, 500 on ``/v1/loras`` (the system server decides)."""
    name = body.get("lora_name")
    return {
        "status": "error",
        "message": native_error_text(error),
        "lora_name": name if isinstance(name, str) else None,
    }
