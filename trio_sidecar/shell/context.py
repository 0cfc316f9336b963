"""The embedded API's per-request types: :class:`GenerateContext` (the request id and the client's
cancellation signal) and :class:`ChunkSink` (where :meth:`SidecarEngine.submit` delivers a request's output).
See docs/reference/sidecar.md#embedded-api.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio

from ..core.protocol import LLMEngineOutput
from ..core.tracecontext import trace_metadata

__all__ = ["ChunkSink", "GenerateContext"]


class GenerateContext:
    """Per-request context of the embedded API (docs/reference/sidecar.md#embedded-api): the request id, the
    client's cancellation signal and the request's trace context.

    Args:
        request_id: sent as ``GenerateRequest.request_id``; empty → a fresh UUID4 string.
        on_first_token: called once, from the request's task, when its first tokens are converted (before
            the sink gets them; also for the first token the decode deferral replaces,
            docs/reference/sidecar.md#decode-deferral).
        traceparent: a W3C ``traceparent`` header value, sent to vLLM as ``GenerateStream`` metadata so its
            OpenTelemetry spans join the request's trace (docs/reference/sidecar.md#trace-context).
        tracestate: the W3C ``tracestate`` value sent with it (ignored without ``traceparent``).

    Raises:
        ValueError: a trace header value gRPC metadata cannot carry (not printable ASCII).

    ``stop()`` may be called from any Trio task of the same run, before or during the request.
    """

    def __init__(
        self,
        request_id: str = "",
        *,
        on_first_token: Callable[[], None] | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.on_first_token = on_first_token
        self.traceparent = traceparent
        self.tracestate = tracestate
        #: The trace context's ``GenerateStream`` metadata; ``()`` without ``traceparent``.
        self.trace_metadata = trace_metadata(traceparent, tracestate)
        self._stopped = trio.Event()
        self._listeners: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        return f"<GenerateContext {self.request_id!r}{' stopped' if self.stopped else ''}>"

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Ask the request to end with a cancelled chunk (decode mode defers it,
        docs/reference/sidecar.md#decode-deferral). Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for listener in list(self._listeners):
            listener()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _notify_first_token(self) -> None:
        if self.on_first_token is not None:
            self.on_first_token()

    def _subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)
        if self.stopped:
            listener()

    def _unsubscribe(self, listener: Callable[[], None]) -> None:
        try:
            self._listeners.remove(listener)
        except ValueError:
            pass


class ChunkSink(Protocol):
    """Where :meth:`SidecarEngine.submit` delivers a request's output (Trio thread; must not block or raise,
    and should be quick: ``chunk``/``tokens`` usually run in the connection's reader task, ahead of the
    other streams on that connection).

    ``chunk`` (or, for a chunk of token ids and text only, ``tokens``) gets every chunk as soon as its
    message is read, from whichever task read it (the connection's reader or the request task); plain token
    chunks of messages read together come as one ``tokens`` call (ids in order, texts concatenated); ``end`` is
    called exactly once, last: with the final chunk (terminal or cancelled) or the error (a
    :class:`~trio_sidecar.core.errors.SidecarError`, or an unexpected exception), the other ``None``. An
    exception from ``chunk``/``tokens`` fails the request like a bug in the engine (logged, ``end`` with the
    error); one from ``end`` is logged.
    """

    def chunk(self, chunk: LLMEngineOutput) -> None: ...

    def tokens(self, token_ids: list[int], text: str) -> None:
        """A plain token chunk (the common one): the same as ``chunk(token_chunk(token_ids, text))``;
        ``token_ids`` is a fresh list the sink may keep; ``text`` is ``""`` when vLLM sent none.
        ``protocol.token_chunk_dict(token_ids, text)`` is its Dynamo dict."""

    def end(self, final: LLMEngineOutput | None, error: BaseException | None) -> None: ...
