"""trio-sidecar: a Trio structured-concurrency sidecar between vLLM's gRPC services and NVIDIA Dynamo.

The public API (docs/reference/sidecar.md#embedded-api)::

    from trio_sidecar import open_sidecar, SidecarConfig, SamplingParams, Completion

The typed API (``Sidecar.complete``/``stream``/``complete_many``, docs/embedded.md) sits beside the
Dynamo-shaped one (``Sidecar.generate``/``submit`` with ``GenerateContext``).

The exports are resolved lazily, so importing a pure submodule (``trio_sidecar.core.errors``,
``trio_sidecar.core.convert.request``, ...) never pulls in Trio or the transport.
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
    from .core.completions import Completion, Delta, Logprob, SamplingParams, StructuredOutputs, Usage
    from .core.config import DisaggregationMode, SidecarConfig, WorkerOptions
    from .core.errors import (
        CannotConnect,
        ConnectionTimeout,
        EngineShutdown,
        ErrorKind,
        InvalidArgument,
        ProtocolError,
        RequestCancelled,
        SidecarError,
    )
    from .core.health_policy import HealthKind, HealthState
    from .core.model import DiscoveredModel, EngineConfig, ModelIdentity
    from .core.protocol import LLMEngineOutput, PreprocessedRequest, structure_request
    from .core.rl_requests import PauseMode, RlCapabilities
    from .core.routing import KvEventSource
    from .core.stats import HistogramSnapshot, StatsSnapshot
    from .shell.completion_stream import CompletionStream
    from .shell.context import ChunkSink, GenerateContext
    from .shell.engine import SidecarEngine
    from .shell.rl_controls import WakeState

_HOMES = {
    "open_sidecar": "api",
    "discover": "api",
    "Sidecar": "api",
    "GenerateContext": "shell.context",
    "ChunkSink": "shell.context",
    "SidecarEngine": "shell.engine",
    "SamplingParams": "core.completions",
    "StructuredOutputs": "core.completions",
    "Completion": "core.completions",
    "CompletionStream": "shell.completion_stream",
    "Delta": "core.completions",
    "Logprob": "core.completions",
    "Usage": "core.completions",
    "SidecarConfig": "core.config",
    "WorkerOptions": "core.config",
    "DisaggregationMode": "core.config",
    "PreprocessedRequest": "core.protocol",
    "LLMEngineOutput": "core.protocol",
    "structure_request": "core.protocol",
    "DiscoveredModel": "core.model",
    "ModelIdentity": "core.model",
    "EngineConfig": "core.model",
    "KvEventSource": "core.routing",
    "HealthKind": "core.health_policy",
    "HealthState": "core.health_policy",
    "PauseMode": "core.rl_requests",
    "RlCapabilities": "core.rl_requests",
    "WakeState": "shell.rl_controls",
    "StatsSnapshot": "core.stats",
    "HistogramSnapshot": "core.stats",
    "ErrorKind": "core.errors",
    "SidecarError": "core.errors",
    "InvalidArgument": "core.errors",
    "ProtocolError": "core.errors",
    "EngineShutdown": "core.errors",
    "CannotConnect": "core.errors",
    "ConnectionTimeout": "core.errors",
    "RequestCancelled": "core.errors",
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
