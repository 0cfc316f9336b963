"""trio-sidecar: a Trio structured-concurrency sidecar between vLLM's gRPC services and NVIDIA Dynamo."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
