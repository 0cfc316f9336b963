"""The Dynamo upstream: the asyncio-thread bridge and the ``trio-sidecar run`` worker (docs/reference/worker.md).

Importing this package never imports Dynamo; :mod:`trio_sidecar.dynamo.worker` does so lazily, so the
optional ``dynamo`` extra is needed only to actually run a worker.
"""

from __future__ import annotations

__all__ = ["run_worker"]


def run_worker(config, options) -> int:  # pragma: no cover - thin lazy re-export
    from .worker import run_worker as _run_worker

    return _run_worker(config, options)
