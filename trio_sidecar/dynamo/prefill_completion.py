"""Worker-side prefill completion: the load signal the native sidecar gives Dynamo's KV router (docs/dynamo.md#router-load-signals).

The KV router counts, per worker and DP rank, the prompt tokens of the requests it sent there whose prefill
has not completed yet (``worker_active_prefill_tokens``), and uses that load when it picks a worker. An
aggregated or decode worker of Dynamo 1.6.1 tells it when a request's prefill completed: one
``MarkPrefillCompleted`` event per request, with the request id, the worker's instance id and the request's
DP rank, on the endpoint's ``active_sequences_events`` event channel, published when the request's first
token is produced. The router applies such events from a worker even without replica sync; without them it
falls back to noticing the first token in the response stream.

Dynamo's Python API: ``await endpoint.first_token_source(worker_type)`` creates the channel (``None`` for a
prefill worker); ``source.bind(context, dp_rank)`` attaches one request; the event is published once, at the
first ``context.notify_first_token()``, which the bridge runs on the loop when the request task converted the
request's first tokens (the "First token" section of ``bridge.py``). A request without a DP rank publishes
nothing (Dynamo's rule: the router would not know which rank's load to change).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["PrefillCompletion", "request_dp_rank"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.prefill_completion")


def request_dp_rank(request: Any) -> int | None:
    """The DP rank the router chose for a request (``routing.dp_rank`` of Dynamo's request), if any.

    Only aggregated and decode workers publish prefill completion, and both serve ``routing.dp_rank``
    (docs/reference/sidecar.md#data-parallel-rank); anything but a non-negative integer counts as absent.
    """
    if not isinstance(request, dict):
        return None
    routing = request.get("routing")
    if not isinstance(routing, dict):
        return None
    rank = routing.get("dp_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        return None
    return rank


class PrefillCompletion:
    """The endpoint's ``FirstTokenSource`` (asyncio thread only).

    Args:
        source: what ``endpoint.first_token_source(worker_type)`` returned; ``None`` (a prefill worker, or a
            runtime that could not create the channel) makes :meth:`bind` a no-op.
    """

    def __init__(self, source: Any = None) -> None:
        self.source = source

    @classmethod
    async def create(cls, endpoint: Any, worker_type: str) -> PrefillCompletion:
        """Create the endpoint's source for ``worker_type`` (a ``WorkerType`` member name)."""
        from dynamo.llm import WorkerType

        return cls(await endpoint.first_token_source(getattr(WorkerType, worker_type)))

    @property
    def enabled(self) -> bool:
        return self.source is not None

    def bind(self, context: Any, request: Any) -> bool:
        """Attach one request; returns whether it was attached. The caller then calls
        ``context.notify_first_token()`` once the request's first tokens are converted: the runtime's own
        trigger (the first response chunk with tokens) does not fire on the push egress the worker serves on
        (observed with 1.6.1: no event without the explicit call)."""
        source = self.source
        if source is None:
            return False
        rank = request_dp_rank(request)
        if rank is None:
            return False
        try:
            source.bind(context, rank)
        except Exception:  # noqa: BLE001 - an advisory signal: the router falls back to the response stream
            LOGGER.debug("FirstTokenSource.bind failed", exc_info=True)
            return False
        return True
