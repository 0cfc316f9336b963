"""The typed request API's Trio side (docs/embedded.md): one request as a stream of :class:`Delta` values
ending with a :class:`Completion`, and many requests under a concurrency limit.

Theory of operation
-------------------
A typed request is an ordinary ``SidecarEngine.generate()`` request: :meth:`Sidecar.stream
<trio_sidecar.api.Sidecar.stream>` builds its ``PreprocessedRequest`` from ``SamplingParams`` and wraps the
chunk stream in :class:`CompletionStream`, which feeds each chunk to a pure ``CompletionBuilder``. So the
typed API has the engine's admission, back-pressure, cancellation and exit guarantee, and no path of its
own. :func:`run_many` runs several such requests in one nursery: the caller's deadline, a failure, or the
caller leaving cancels the rest, and each cancelled request's block resets its stream (vLLM aborts it) and
queues a ``Control.Abort`` before the nursery ends.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Union

import trio

from ..core.completions import Completion, CompletionBuilder, Delta
from ..core.errors import ProtocolError, SidecarError
from ..transport import collapse_single_exception
from .context import GenerateContext
from .stream import ChunkStream

__all__ = ["CompletionStream", "Prompt", "Result", "open_many"]

#: A prompt: text, or token ids.
Prompt = Union[str, Sequence[int]]  # noqa: UP007 - a runtime alias
#: One result of :func:`open_many`: the prompt's index, and its completion (or, with
#: ``return_exceptions``, the error it failed with).
Result = tuple[int, Union[Completion, SidecarError]]  # noqa: UP007 - a runtime alias


class CompletionStream:
    """One streaming request (yielded by ``Sidecar.stream``): iterate it for :class:`Delta` values; once the
    iteration ended, :attr:`completion` holds the :class:`Completion` (also returned by :meth:`final`).

    A stream error (``SidecarError``) is raised from the iteration after the deltas already produced.
    """

    def __init__(self, chunks: ChunkStream, builder: CompletionBuilder, ctx: GenerateContext) -> None:
        self._chunks = chunks
        self._builder = builder
        self._ctx = ctx

    def __repr__(self) -> str:
        return f"<CompletionStream {self.request_id!r}{' finished' if self.completion is not None else ''}>"

    @property
    def request_id(self) -> str:
        return self._builder.request_id

    @property
    def completion(self) -> Completion | None:
        """The completion once the stream ended (``None`` before)."""
        return self._builder.completion

    def stop(self) -> None:
        """Ask vLLM to stop this request: the stream ends at once with ``finish_reason == "abort"`` and the
        usage of the deltas already taken (the deltas not taken yet are dropped). Idempotent."""
        self._ctx.stop()

    def __aiter__(self) -> CompletionStream:
        return self

    async def __anext__(self) -> Delta:
        add = self._builder.add
        async for chunk in self._chunks:
            delta = add(chunk)
            if delta is not None:
                return delta
        raise StopAsyncIteration

    async def final(self) -> Completion:
        """Read the rest of the stream; return the completion.

        Raises:
            SidecarError: the request failed (after the deltas the caller already took).
        """
        async for _ in self:
            pass
        completion = self._builder.completion
        if completion is None:  # (the engine always ends a stream with a final chunk or an error)
            raise ProtocolError("the stream ended without a final chunk")
        return completion


@asynccontextmanager
async def open_many(
    complete: Callable[[int, Prompt], Awaitable[Completion]],
    prompts: Sequence[Prompt],
    *,
    limit: int,
    return_exceptions: bool,
) -> AsyncIterator[trio.MemoryReceiveChannel[Result]]:
    """Run ``complete(index, prompt)`` for every prompt, at most ``limit`` at a time, in a nursery of the block;
    yield the results as they complete (see ``Sidecar.complete_many``)."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    send, receive = trio.open_memory_channel[Result](math.inf)  # (at most one small result per prompt)

    async def one(index: int, prompt: Prompt, limiter: trio.CapacityLimiter) -> None:
        try:
            try:
                result: Completion | SidecarError = await complete(index, prompt)
            except SidecarError as exc:
                if not return_exceptions:
                    raise
                result = exc
            send.send_nowait((index, result))
        finally:
            limiter.release_on_behalf_of(index)

    async def run_all() -> None:
        limiter = trio.CapacityLimiter(limit)
        async with send, trio.open_nursery() as nursery:
            for index, prompt in enumerate(prompts):
                await limiter.acquire_on_behalf_of(index)  # (a task per running request, not per prompt)
                nursery.start_soon(one, index, prompt, limiter)

    with collapse_single_exception():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_all)
            async with receive:
                yield receive
            nursery.cancel_scope.cancel()  # the caller left before the last result: stop the rest
