"""The CPU-only mock vLLM gRPC server (docs/reference/mock.md).

``open_mock_server(MockConfig(...))`` runs it inside a test or an application (or
``await nursery.start(serve_mock, config)``); ``trio-sidecar mock`` runs it
as a process. ``planned_tokens`` and ``request_uuid`` are the deterministic functions of docs/reference/mock.md#deterministic-generation, for choosing
stop tokens and checking outputs.

The exports are resolved lazily so that the pure submodules (``generation``, ``validation``, ``handoff``,
``multimodal``) can be imported without pulling in Trio and the transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "MockConfig",
    "MockConfigError",
    "MockServer",
    "open_mock_server",
    "planned_tokens",
    "request_uuid",
    "serve_mock",
]

if TYPE_CHECKING:
    from trio_sidecar.mock.generation import planned_tokens, request_uuid
    from trio_sidecar.mock.server import MockConfig, MockConfigError, MockServer, open_mock_server, serve_mock

_HOMES = {
    "MockConfig": "trio_sidecar.mock.server",
    "MockConfigError": "trio_sidecar.mock.server",
    "MockServer": "trio_sidecar.mock.server",
    "serve_mock": "trio_sidecar.mock.server",
    "open_mock_server": "trio_sidecar.mock.server",
    "planned_tokens": "trio_sidecar.mock.generation",
    "request_uuid": "trio_sidecar.mock.generation",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
