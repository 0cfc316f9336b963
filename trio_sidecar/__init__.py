"""trio-sidecar: a Trio structured-concurrency sidecar between vLLM's gRPC services and NVIDIA Dynamo.

The public API (docs/reference/sidecar.md#embedded-api)::

    from trio_sidecar import open_sidecar, SidecarConfig, SamplingParams, Completion

The typed API (``Sidecar.complete``/``stream``/``complete_many``, docs/embedded.md) sits beside the
Dynamo-shaped one (``Sidecar.generate``/``submit`` with ``GenerateContext``).

The exports are resolved lazily, so importing a pure submodule (``trio_sidecar.errors``,
``trio_sidecar.convert.request``, ...) never pulls in Trio or the transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # embedded API
    "open_sidecar",
    "discover",
    "Sidecar",
    "GenerateContext",
    "ChunkSink",
    "SidecarEngine",
    # typed API (docs/embedded.md)
    "SamplingParams",
    "StructuredOutputs",
    "Completion",
    "CompletionStream",
    "Delta",
    "Logprob",
    "Usage",
    # configuration
    "SidecarConfig",
    "WorkerOptions",
    "DisaggregationMode",
    # models
    "PreprocessedRequest",
    "LLMEngineOutput",
    "structure_request",
    "DiscoveredModel",
    "ModelIdentity",
    "EngineConfig",
    "KvEventSource",
    "HealthKind",
    "HealthState",
    # RL controls (docs/rl.md)
    "PauseMode",
    "RlCapabilities",
    "WakeState",
    # observability
    "StatsSnapshot",
    "HistogramSnapshot",
    # errors
    "ErrorKind",
    "SidecarError",
    "InvalidArgument",
    "ProtocolError",
    "EngineShutdown",
    "CannotConnect",
    "ConnectionTimeout",
    "RequestCancelled",
]

if TYPE_CHECKING:
    from .api import Sidecar, discover, open_sidecar
    from .completion_stream import CompletionStream
    from .completions import Completion, Delta, Logprob, SamplingParams, StructuredOutputs, Usage
    from .config import DisaggregationMode, SidecarConfig, WorkerOptions
    from .context import ChunkSink, GenerateContext
    from .engine import SidecarEngine
    from .errors import (
        CannotConnect,
        ConnectionTimeout,
        EngineShutdown,
        ErrorKind,
        InvalidArgument,
        ProtocolError,
        RequestCancelled,
        SidecarError,
    )
    from .health_policy import HealthKind, HealthState
    from .model import DiscoveredModel, EngineConfig, ModelIdentity
    from .protocol import LLMEngineOutput, PreprocessedRequest, structure_request
    from .rl import PauseMode, RlCapabilities
    from .rl_controls import WakeState
    from .routing import KvEventSource
    from .stats import HistogramSnapshot, StatsSnapshot

_HOMES = {
    "open_sidecar": "api",
    "discover": "api",
    "Sidecar": "api",
    "GenerateContext": "context",
    "ChunkSink": "context",
    "SidecarEngine": "engine",
    "SamplingParams": "completions",
    "StructuredOutputs": "completions",
    "Completion": "completions",
    "CompletionStream": "completion_stream",
    "Delta": "completions",
    "Logprob": "completions",
    "Usage": "completions",
    "SidecarConfig": "config",
    "WorkerOptions": "config",
    "DisaggregationMode": "config",
    "PreprocessedRequest": "protocol",
    "LLMEngineOutput": "protocol",
    "structure_request": "protocol",
    "DiscoveredModel": "model",
    "ModelIdentity": "model",
    "EngineConfig": "model",
    "KvEventSource": "routing",
    "HealthKind": "health_policy",
    "HealthState": "health_policy",
    "PauseMode": "rl",
    "RlCapabilities": "rl",
    "WakeState": "rl_controls",
    "StatsSnapshot": "stats",
    "HistogramSnapshot": "stats",
    "ErrorKind": "errors",
    "SidecarError": "errors",
    "InvalidArgument": "errors",
    "ProtocolError": "errors",
    "EngineShutdown": "errors",
    "CannotConnect": "errors",
    "ConnectionTimeout": "errors",
    "RequestCancelled": "errors",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
