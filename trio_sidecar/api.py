"""The embeddable Trio API (docs/embedded.md, docs/reference/sidecar.md#embedded-api).

```python
async with open_sidecar(SidecarConfig(grpc_endpoint="127.0.0.1:50051")) as sidecar:
    completion = await sidecar.complete("Hello", SamplingParams(max_tokens=8, temperature=0.0))
    async with sidecar.stream([1, 2, 3], SamplingParams(max_tokens=8)) as stream:
        async for delta in stream:
            print(delta.text, end="")
```

``complete``/``stream``/``complete_many`` are the typed API (vLLM's names); ``generate``/``submit`` take
and give Dynamo's request and chunk shapes (what the Dynamo worker uses).

Everything the sidecar runs (connections, the abort sender, the health prober, one task per in-flight
request) lives in the nursery of :func:`open_sidecar`; nothing outlives its ``async with`` block.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import trio
import trio_util

from .core.completions import Completion, CompletionBuilder, SamplingParams, prompt_token_ids
from .core.config import SidecarConfig, validate_sidecar_config
from .core.health_policy import HealthState
from .core.lora_requests import LoadResult, LoraAdapter
from .core.model import DiscoveredModel, EngineConfig
from .core.protocol import LLMEngineOutput, PreprocessedRequest
from .core.rl_requests import (
    PauseMode,
    RlCapabilities,
    parse_finish_weight_update,
    parse_init_weight_transfer,
    parse_pause,
    parse_sleep,
    parse_update_weight_version,
    parse_update_weights,
    parse_wake_up,
)
from .core.routing import KvEventSource
from .core.stats import StatsSnapshot
from .shell.completion_stream import CompletionStream, Prompt, Result, open_many
from .shell.context import ChunkSink, GenerateContext
from .shell.discovery import discover
from .shell.engine import SidecarEngine
from .shell.lora_lifecycle import LoraLifecycle
from .shell.prober import run_health_prober
from .shell.rl_controls import RlControls, WakeState
from .shell.tokenizer import Encoder, load_tokenizer
from .transport import collapse_single_exception

__all__ = [
    "open_sidecar",
    "discover",
    "Sidecar",
    "Completion",
    "CompletionStream",
    "SamplingParams",
    "ChunkSink",
    "GenerateContext",
    "LoadResult",
    "LoraAdapter",
    "PauseMode",
    "WakeState",
]


@attrs.define(eq=False)
class Sidecar:
    """A started sidecar (yielded by :func:`open_sidecar`).

    Attributes:
        model: the discovered model (identity, ``ServerInfo``, DP size); refreshed after a recovery.
        engine_config: registration data (docs/reference/sidecar.md#registration-data).
        kv_event_sources: validated ``KvEventSource`` tuple (docs/reference/sidecar.md#kv-event-sources); refreshed after a recovery
            (docs/reference/sidecar.md#recovery).
        health: ``AsyncValue[HealthState]`` (docs/reference/sidecar.md#health-prober), the engine's: admission
            is open only while it is ``SERVING``.
        engine: the underlying :class:`SidecarEngine`, the owner of admission and drain (``in_flight``,
            ``stop_admission()``, ``wait_idle()``, ``cancel_in_flight()``, ``drain(timeout)``).
        lora: the LoRA adapter lifecycle (docs/lora.md); :meth:`list_loras`, :meth:`load_lora` and
            :meth:`unload_lora` are its entry points.
    """

    engine: SidecarEngine
    model: DiscoveredModel
    engine_config: EngineConfig
    kv_event_sources: tuple[KvEventSource, ...]
    health: trio_util.AsyncValue[HealthState]
    lora: LoraLifecycle
    _encoder: Encoder | None = attrs.field(default=None, init=False)  # the local tokenizer, once loaded

    def __repr__(self) -> str:
        return (
            f"<Sidecar {self.model.served_model_name!r} {self.health.value.kind.name} "
            f"[{self.engine.in_flight} in flight]>"
        )

    def generate(
        self, request: dict[str, Any] | PreprocessedRequest, ctx: GenerateContext | None = None
    ) -> AbstractAsyncContextManager[AsyncIterator[LLMEngineOutput]]:
        """Stream one request (docs/reference/sidecar.md#embedded-api); see :meth:`SidecarEngine.generate` for the full contract.

        Raises (from ``__aenter__``):
            InvalidArgument: conversion failed; nothing was sent.
            CannotConnect: ``vLLM is not serving: {reason}`` (admission closed, docs/reference/sidecar.md#admission), or a mapped open error.
            EngineShutdown: ``vLLM sidecar is not started`` (after the ``open_sidecar`` block).
        """
        return self.engine.generate(request, ctx)

    # --- the typed API (docs/embedded.md) ----------------------------------------------------------------

    async def complete(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str = ""
    ) -> Completion:
        """Generate one completion of ``prompt`` (text, or token ids) and return it whole.

        Args:
            prompt: a ``str`` (sent as text when vLLM advertises ``supports_text_input``, else tokenized
                here with the model's tokenizer: docs/embedded.md#text-prompts), or token ids.
            params: vLLM's sampling parameters; ``None``: ``SamplingParams()`` (vLLM's defaults).
            request_id: vLLM's request id; empty: a fresh UUID4 string.

        Raises:
            InvalidArgument: the prompt (empty, an id out of range, no tokenizer for a text prompt: the
                message names the extra), or vLLM refused the request (its text).
            CannotConnect, EngineShutdown, ProtocolError, SidecarError: as :meth:`generate`.

        Cancellation: cancelling the caller (a deadline, a sibling's failure) stops the request in vLLM; the
        call returns or raises only once the stream is reset and the request no longer counts in
        ``engine.in_flight`` (docs/embedded.md#what-a-blocks-exit-guarantees).
        """
        async with self.stream(prompt, params, request_id=request_id) as stream:
            return await stream.final()

    @asynccontextmanager
    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str = ""
    ) -> AsyncIterator[CompletionStream]:
        """Stream one completion: ``async with sidecar.stream(prompt, params) as stream: async for delta in
        stream: ...``; then ``stream.completion`` (or ``await stream.final()``) is the :class:`Completion`.

        Arguments and errors as :meth:`complete` (``__aenter__`` raises the request's refusal; iteration
        raises a stream error). The block's exit waits, shielded and bounded, until the stream is reset
        and the request no longer counts (docs/embedded.md#what-a-blocks-exit-guarantees).
        """
        token_ids, text = await self._prompt(prompt)
        request = (params if params is not None else _DEFAULT_PARAMS).request(token_ids)
        ctx = GenerateContext(request_id)
        async with self.engine.generate(request, ctx, text=text) as chunks:
            yield CompletionStream(chunks, CompletionBuilder(chunks.request_id, token_ids or None), ctx)

    @asynccontextmanager
    async def complete_many(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        limit: int = 8,
        return_exceptions: bool = False,
    ) -> AsyncIterator[trio.MemoryReceiveChannel[Result]]:
        """Complete every prompt, at most ``limit`` at a time; yield ``(index, completion)`` pairs in
        completion order: ``async with sidecar.complete_many(prompts, params) as results: async for index,
        completion in results: ...``. ``params`` is one ``SamplingParams`` for all, or one per prompt (as
        vLLM's ``LLM.generate``).

        A failed request (a ``SidecarError``) cancels the others (each is stopped in vLLM) and is raised
        from the block, unless ``return_exceptions``: then its pair carries the error and the others go on.
        Leaving the block early cancels the requests still running. Every request the block started has
        ended (stream reset, no longer in ``engine.in_flight``) when the block is left.

        Raises:
            ValueError: ``limit`` below 1, or not one ``SamplingParams`` per prompt.
            SidecarError: the first failure (without ``return_exceptions``); never an ``ExceptionGroup``
                for one failure.
        """
        if params is None or isinstance(params, SamplingParams):
            each: Sequence[SamplingParams | None] = [params] * len(prompts)
        elif len(params) == len(prompts):
            each = params
        else:
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")

        async def one(index: int, prompt: Prompt) -> Completion:
            return await self.complete(prompt, each[index])

        async with open_many(one, prompts, limit=limit, return_exceptions=return_exceptions) as results:
            yield results

    async def _prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """``(token_ids, text)`` for the request: text vLLM tokenizes, or token ids (docs/embedded.md#text-prompts)."""
        if not isinstance(prompt, str):
            return prompt_token_ids(prompt), None
        if self.model.model_info.supports_text_input:
            return [], prompt
        encoder = self._encoder
        if encoder is None:
            encoder = self._encoder = await trio.to_thread.run_sync(load_tokenizer, self.model.model_id)
        return prompt_token_ids(encoder.encode(prompt)), None

    def submit(
        self,
        request: dict[str, Any] | PreprocessedRequest,
        ctx: GenerateContext,
        sink: ChunkSink,
        *,
        merge: bool = True,
    ) -> None:
        """Start one request whose chunks go to ``sink`` (what the Dynamo worker uses); see
        :meth:`SidecarEngine.submit` (``merge``: token chunks of messages read together go over as one).

        Raises (synchronously; the sink is not called): ``InvalidArgument`` (conversion), ``CannotConnect``
        (admission closed), ``EngineShutdown`` (not started). Open and stream errors reach ``sink.end``.
        """
        self.engine.submit(request, ctx, sink, merge=merge)

    async def list_loras(self) -> list[LoraAdapter]:
        """The adapters vLLM holds (``ListLoras``), in its order (docs/lora.md#embedded-api).

        Raises:
            InvalidArgument: the server does not advertise LoRA support with ``max_loras`` > 0.
            SidecarError: the mapped gRPC status of ``ListLoras``; ``EngineShutdown`` after the block.
        """
        return await self.lora.list_adapters()

    async def load_lora(self, name: str, source: str) -> LoadResult:
        """Load the adapter directory ``source`` (an absolute path or a ``file://`` URI) as ``name``.

        ``hf://`` and ``s3://`` sources need a resolver set on ``sidecar.lora.resolver`` (a
        :class:`~trio_sidecar.shell.lora_lifecycle.SourceResolver`; docs/lora.md#sources): the embedded API
        downloads nothing by itself.

        Control calls: ``ListLoras``, then ``LoadLora`` unless refused by the checks of docs/lora.md (same
        texts as the ``/v1/loras`` answers, without the ``InvalidRequest:`` prefix) or already loaded
        (``LoadResult.already_loaded``; any path).

        Raises:
            InvalidArgument, ProtocolError, SidecarError: see docs/lora.md#routes (the same texts).
        """
        uri = f"file://{source}" if source.startswith("/") else source
        return await self.lora.load(name, uri)

    async def unload_lora(self, name: str) -> LoraAdapter:
        """Unload adapter ``name`` (``ListLoras``, ``UnloadLora``) and return what vLLM removed.

        Raises:
            InvalidArgument: ``LoRA adapter 'x' not found. Available LoRAs: [...]``, or no LoRA support.
        """
        return await self.lora.unload(name)

    def stats(self) -> StatsSnapshot:
        """The sidecar's counters, gauges and histograms now, as a frozen snapshot (docs/observability.md):
        requests started, finished by outcome, rejected and in flight; tokens; time to first token and
        inter-token latency; ``Control.Abort`` outcomes; decode deferrals; the prober's state and
        transitions; the connection pool. No Prometheus needed; safe to call from any thread."""
        return self.engine.snapshot_stats()

    def _on_recovered(self, model: DiscoveredModel, kv_sources: tuple[KvEventSource, ...]) -> None:
        # The prober already logged a changed source list (docs/reference/sidecar.md#recovery); this only swaps the state.
        self.model = model
        self.engine.model = model
        self.kv_event_sources = kv_sources
        self.engine.kv_event_sources = kv_sources
        if model.supports_lora:
            self.lora.request_reconcile()  # a restarted vLLM may have lost the adapters (docs/lora.md#reconciliation)

    # --- RL controls (docs/rl.md#embedded-api) --------------------------------------------------------------
    # Each method is one Control call (two for resume/wake-up) on the sidecar's pool. Errors: the mapped gRPC
    # status (``InvalidArgument`` for vLLM's FAILED_PRECONDITION/INVALID_ARGUMENT, e.g. sleep mode not
    # configured; ``CannotConnect`` when vLLM is unreachable), ``EngineShutdown`` after the block; arguments
    # are checked first with the engine routes' texts (``InvalidArgument``, nothing sent).

    @property
    def rl_capabilities(self) -> RlCapabilities:
        """``ServerInfo.rl_capabilities`` of the current vLLM (sleep mode, weight transfer, draft updates)."""
        return RlCapabilities.from_server_info(self.model.server_info)

    def rl_controls(self) -> RlControls:
        """The RL Control calls on this sidecar's pool, without argument checks (what the Dynamo worker's engine
        routes use after parsing their bodies); ``EngineShutdown`` once the sidecar is stopped."""
        return RlControls(
            lambda: self.engine.pool if self.engine.started else None, sleep_mode=self.rl_capabilities.sleep_mode
        )

    async def pause_generation(
        self, mode: PauseMode | str = PauseMode.ABORT, *, clear_cache: bool | None = None
    ) -> None:
        """``PauseGeneration``: ``abort`` (in-flight requests end), ``wait`` (they finish) or ``keep`` (frozen)."""
        request = parse_pause({"mode": _mode_text(mode), "clear_cache": clear_cache})
        await self.rl_controls().pause_generation(request.mode, clear_cache=request.clear_cache)

    async def resume_generation(self) -> WakeState:
        """``ResumeGeneration`` (then ``IsSleeping`` on a server with sleep mode: ``WakeState.sleeping``)."""
        return await self.rl_controls().resume_generation()

    async def is_paused(self) -> bool:
        return await self.rl_controls().is_paused()

    async def sleep(self, level: int | None = None, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """``Sleep``: level 0 pauses, 1 and 2 also release the weights and the KV cache (None: vLLM's default, 1)."""
        request = parse_sleep({"level": level, "mode": _mode_text(mode)})
        await self.rl_controls().sleep(request.level, request.mode)

    async def wake_up(self, tags: Sequence[str] = ()) -> WakeState:
        """``WakeUp`` for ``tags`` (``weights``, ``kv_cache``, ``scheduling``; none: everything), then ``IsSleeping``."""
        return await self.rl_controls().wake_up(parse_wake_up({"tags": list(tags)}))

    async def is_sleeping(self) -> bool:
        return await self.rl_controls().is_sleeping()

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``InitWeightTransferEngine`` with ``init_info`` as compact JSON."""
        await self.rl_controls().init_weight_transfer_engine(parse_init_weight_transfer({"init_info": init_info}))

    async def start_weight_update(self, *, draft: bool = False) -> None:
        """``StartWeightUpdate`` (``StartDraftWeightUpdate`` with ``draft``)."""
        await self.rl_controls().start_weight_update(draft=draft)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        """``UpdateWeights`` with ``update_info`` as compact JSON."""
        await self.rl_controls().update_weights(parse_update_weights({"update_info": update_info}))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.rl_controls().finish_weight_update(parse_finish_weight_update({"weight_version": weight_version}))

    async def update_weight_version(self, weight_version: str) -> None:
        await self.rl_controls().update_weight_version(parse_update_weight_version({"new_version": weight_version}))

    async def get_weight_version(self) -> str:
        return await self.rl_controls().get_weight_version()


_DEFAULT_PARAMS = SamplingParams()


def _mode_text(mode: PauseMode | str) -> str:
    return mode.value if isinstance(mode, PauseMode) else mode


@asynccontextmanager
async def open_sidecar(config: SidecarConfig, *, expected: DiscoveredModel | None = None) -> AsyncIterator[Sidecar]:
    """Start a sidecar against ``config.grpc_endpoint`` (docs/reference/sidecar.md#embedded-api).

    Runs the ``SidecarConfig`` pre-network checks (docs/reference/sidecar.md#pre-network-checks), then the start phase (docs/reference/sidecar.md#start-phase); with ``expected``
    (the bootstrap model from :func:`discover`) the compatibility check (docs/reference/sidecar.md#identity-check) too. Starts the health prober
    when ``config.health_prober`` is on.

    Raises:
        InvalidArgument: pre-network checks (no socket opened).
        CannotConnect, ConnectionTimeout, ProtocolError, EngineShutdown, SidecarError: startup failures.
        ProtocolError: a fatal prober finding (identity or DP size changed after a recovery) ends the block.
        A single failure is raised as itself, never as an ``ExceptionGroup``.

    Cancellation: leaving the block cancels everything the sidecar owns (in-flight requests end with a
    cancelled chunk, queued Aborts are flushed with a 5 s shielded grace) and returns only when all its
    tasks have ended.
    """
    endpoint = validate_sidecar_config(config)
    engine = SidecarEngine(config, endpoint=endpoint)
    with collapse_single_exception():
        async with trio.open_nursery() as nursery:
            try:
                engine_config = await engine.start(nursery, expected=expected)
                assert engine.model is not None
                sidecar = Sidecar(
                    engine=engine,
                    model=engine.model,
                    engine_config=engine_config,
                    kv_event_sources=engine.kv_event_sources,
                    health=engine.health,
                    lora=LoraLifecycle(lambda: engine.pool, lambda: engine.model),
                )
                if sidecar.model.supports_lora:
                    await nursery.start(sidecar.lora.run_reconciler)
                if config.health_prober:
                    await nursery.start(
                        functools.partial(
                            run_health_prober,
                            endpoint=endpoint,
                            config=config,
                            model=sidecar.model,
                            kv_sources=sidecar.kv_event_sources,
                            health=sidecar.health,
                            on_recovered=sidecar._on_recovered,
                            stats=engine.stats,
                        )
                    )
                yield sidecar
            finally:
                await engine.cleanup()
                nursery.cancel_scope.cancel()
