"""The simulated engine of one DP rank: vLLM-v1-like continuous batching over a paged KV pool
(docs/reference/mock.md#kv-cache-and-kv-events, docs/reference/mock.md#scheduler).

Theory of operation
-------------------
A :class:`RankEngine` owns a waiting queue, a running list and a :class:`~trio_sidecar.mock.kvcache.KvPool`.
Its :meth:`RankEngine.run` task repeats *passes*; each pass is three steps:

1. **Schedule** (synchronous). The token budget (``max_num_batched_tokens``) is spent on running requests
   first, in admission order: a request computes ``min(remaining, budget)`` tokens, where ``remaining`` is
   1 for a decode-ready request and the rest of its prompt while prefilling. A request that needs one more
   KV block and finds none preempts the newest (``lifo``) or oldest (``fifo``) running request — possibly
   itself — until the block fits: the victim's blocks are released, its computed tokens reset to 0
   (recompute) and it goes to the front of the waiting queue. If nothing was preempted, waiting requests are
   admitted in order while ``len(running) < max_num_seqs`` and budget remains: a request is admitted when
   the blocks of its current sequence fit (active cached prefix free, inactive charged, see kvcache); if the
   head does not fit it waits and nothing overtakes it. Without chunked prefill the head must also fit the
   remaining budget in one go.
2. **Model time.** The pass's duration comes from the polynomial model (timing.py) and is slept only when
   ``speedup_ratio > 0``. With 0 nothing is modelled: passes run back to back and the loop checkpoints
   once about every ``_BURST_SIGNALS`` output signals (each pass counts one more), so a reader wakes to
   a run of buffered tokens instead of once per token. Submissions and cancels land between bursts.
3. **Apply** (synchronous). Each scheduled request that was not cancelled meanwhile adds its computed
   tokens; full blocks are committed (stored in the prefix cache, events queued); a request whose sequence
   is fully computed emits its next planned token into its output channel (``completed`` on the last one),
   and a completed request releases its blocks to the inactive pool. The KV events of the pass go out as
   one message, and the :class:`Metrics` snapshot is refreshed.

:meth:`RankEngine.cancel` is synchronous: it releases the request's blocks and slot at once, even while the
loop sleeps through a long pass (the apply step skips requests that are no longer running). When nothing is
runnable the loop waits on an event set by ``submit``/``cancel``; it never spins.

Output channels (:class:`TokenReceiver`) are written with ``send_nowait`` and never block: a request emits at
most ``len(plan)`` signals (a recompute after preemption re-emits nothing), so a slow reader never stalls the
loop. Unread output is *coalesced*: the tokens are the plan's, in order, so a channel holds two counters
(emitted, received) and the reader computes the tokens it takes. A request whose client does not read
therefore costs no memory per generated token (docs/reliability.md). A reader that went away (closed
receive side) gets its request cancelled.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import attrs
import trio
import trio_util
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.engine_args import EngineArgs, PreemptionMode
from trio_sidecar.mock.generation import TokenPlan, token_at
from trio_sidecar.mock.kvcache import KvPool, MmSpan, SeqKv
from trio_sidecar.mock.timing import pass_seconds

if TYPE_CHECKING:
    from trio_sidecar.mock.kv_events import KvEventPublisher

__all__ = [
    "BudgetError",
    "CapacityError",
    "Metrics",
    "OutputSignal",
    "RankEngine",
    "SchedulerError",
    "SimRequest",
    "TokenReceiver",
    "TokenSender",
    "check_prompt",
    "open_token_channel",
]

LOGGER = logging.getLogger("trio_sidecar.mock.scheduler")

CAPACITY_MESSAGE = "request exceeds the simulated KV-cache capacity"
# speedup 0: passes run back to back until they emitted about this many output signals (each pass counts
# one more), then the loop checkpoints once. Readers wake to several buffered tokens at a time instead of
# once per token, and the transport writes them together.
_BURST_SIGNALS = 4096


class SchedulerError(Exception):
    """A request the simulated engine refuses. ``code`` is the gRPC status the server answers with;
    ``str(e) == e.message``."""

    code: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CapacityError(SchedulerError):
    """The prompt needs more KV blocks than the whole pool (docs/reference/mock.md#request-validation row 20; sent after
    ``prompt_info``)."""

    code = StatusCode.RESOURCE_EXHAUSTED


class BudgetError(SchedulerError):
    """Chunked prefill is off and the prompt exceeds the token budget (docs/reference/mock.md#scheduler; sent
    before ``prompt_info``)."""

    code = StatusCode.INVALID_ARGUMENT


def check_prompt(args: EngineArgs, prompt_len: int) -> None:
    """The scheduler's up-front checks, for servers that want them before submitting.

    Raises:
        BudgetError: chunked prefill off and ``prompt_len > max_num_batched_tokens``.
        CapacityError: ``ceil(prompt_len / block_size) > num_gpu_blocks``.
    """
    budget = args.token_budget
    if not args.enable_chunked_prefill and budget is not None and prompt_len > budget:
        raise BudgetError(
            f"prompt of {prompt_len} tokens exceeds max_num_batched_tokens {budget} with chunked prefill disabled"
        )
    if -(-prompt_len // args.block_size) > args.num_gpu_blocks:
        raise CapacityError(CAPACITY_MESSAGE)


@attrs.frozen(kw_only=True)
class SimRequest:
    """One request as the scheduler sees it. ``plan`` is the full output (already cut by stop tokens and
    the context cap); it must not be empty."""

    uuid: str
    prompt: tuple[int, ...]
    plan: Sequence[int]  # a TokenPlan: computed on demand
    cache_salt: str = ""
    bypass_prefix_cache: bool = False
    priority: int = 0  # recorded, not used for ordering (as upstream)
    mm_spans: tuple[MmSpan, ...] = ()  # multimodal features of the prompt (block keys, BlockStored extra_keys)


class OutputSignal(NamedTuple):
    """One generated token; ``completed`` is set on the last planned token.

    A named tuple (immutable, compared by value): one is built per generated token, and a tuple costs
    a fraction of a frozen attrs instance.
    """

    token: int
    completed: bool


class _TokenBuffer:
    """The state shared by one request's :class:`TokenSender` and :class:`TokenReceiver`.

    The tokens are the plan's, in order, so the channel holds only two counters: tokens emitted and tokens
    received. However far the reader lags, its pending output costs no memory (it is coalesced into the
    range ``plan[received:emitted]``, read when the reader asks).
    """

    __slots__ = ("completed", "emitted", "plan", "received", "receive_closed", "seed", "send_closed", "waiter")

    def __init__(self, plan: Sequence[int]) -> None:
        self.plan = plan
        # A TokenPlan's tokens are computed directly from its seed (no bounds checks per token).
        self.seed = plan.seed if isinstance(plan, TokenPlan) else None
        self.emitted = 0
        self.received = 0
        self.completed = False  # the last token emitted completes the request
        self.send_closed = False
        self.receive_closed = False
        self.waiter: trio.lowlevel.Task | None = None  # the task parked in receive()

    def wake(self) -> None:
        task = self.waiter
        if task is not None:
            self.waiter = None
            reschedule(task)


class TokenSender:
    """The scheduler's end of an output channel: ``emit`` never blocks (see the module docstring)."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: _TokenBuffer) -> None:
        self._buffer = buffer

    def emit(self, completed: bool) -> None:
        """The plan's next token is generated. Raises ``BrokenResourceError`` (reader gone) or
        ``ClosedResourceError`` (after ``close``)."""
        buffer = self._buffer
        if buffer.send_closed:
            raise trio.ClosedResourceError
        if buffer.receive_closed:
            raise trio.BrokenResourceError
        buffer.emitted += 1
        if completed:
            buffer.completed = True
        task = buffer.waiter
        if task is not None:
            buffer.waiter = None
            reschedule(task)

    def close(self) -> None:
        """No more tokens: the reader gets ``EndOfChannel`` once it has taken the pending ones."""
        self._buffer.send_closed = True
        self._buffer.wake()


class TokenReceiver:
    """The reader's end of an output channel: the subset of ``trio.MemoryReceiveChannel`` the mock uses
    (``receive``, ``receive_nowait``, ``async for``, ``close``/``aclose``), with the same exceptions.
    Yields ``OutputSignal(token, completed)``, ``completed`` on the plan's last token."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: _TokenBuffer) -> None:
        self._buffer = buffer

    def pending(self) -> int:
        """Tokens emitted and not yet received."""
        return self._buffer.emitted - self._buffer.received

    def receive_nowait(self) -> OutputSignal:
        buffer = self._buffer
        if buffer.receive_closed:
            raise trio.ClosedResourceError
        position = buffer.received
        if position < buffer.emitted:
            buffer.received = position + 1
            seed = buffer.seed
            token = token_at(seed, position) if seed is not None else buffer.plan[position]
            return OutputSignal(token, buffer.completed and position + 1 == buffer.emitted)
        if buffer.send_closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> OutputSignal:
        await trio.lowlevel.checkpoint_if_cancelled()
        buffer = self._buffer
        while True:
            try:
                signal = self.receive_nowait()
            except trio.WouldBlock:
                buffer.waiter = current_task()

                def abort(raise_cancel):  # type: ignore[no-untyped-def]
                    buffer.waiter = None
                    return Abort.SUCCEEDED

                await wait_task_rescheduled(abort)
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return signal

    def __aiter__(self) -> TokenReceiver:
        return self

    async def __anext__(self) -> OutputSignal:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        buffer = self._buffer
        buffer.receive_closed = True
        buffer.wake()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> TokenReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_token_channel(plan: Sequence[int]) -> tuple[TokenSender, TokenReceiver]:
    """An output channel for ``plan``'s tokens (emitted in order by the scheduler)."""
    buffer = _TokenBuffer(plan)
    return TokenSender(buffer), TokenReceiver(buffer)


@attrs.frozen(kw_only=True)
class Metrics:
    """Snapshot of one rank (``mock.metrics``, docs/reference/mock.md#in-process-api-and-test-hooks)."""

    dp_rank: int
    active_decode_blocks: int
    total_blocks: int
    gpu_cache_usage_perc: float
    running_requests: int
    waiting_requests: int
    vllm_preemptions_total: int


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


class _Req:
    __slots__ = (
        "generated",
        "kv",
        "num_computed",
        "num_tokens",
        "prefilled",
        "plan",
        "sched",
        "send",
        "sim",
        "state",
    )

    def __init__(self, sim: SimRequest, send: TokenSender) -> None:
        self.sim = sim
        self.send = send
        self.plan = sim.plan
        self.kv = SeqKv(
            sim.prompt, sim.plan, salt=sim.cache_salt, bypass_prefix_cache=sim.bypass_prefix_cache, mm=sim.mm_spans
        )
        self.num_tokens = len(sim.prompt)  # current sequence: prompt + generated
        self.num_computed = 0  # tokens with KV
        self.generated = 0
        self.prefilled = False  # the (re)computation of the sequence has finished
        self.sched = 0  # tokens scheduled in the current pass
        self.state = _State.WAITING


class RankEngine:
    """The simulated engine of one DP rank (see the module docstring).

    Args:
        rank: the DP rank (reported in metrics and KV-event payloads).
        args: the validated engine arguments.
        publisher: where each pass's KV events go, or None (events are dropped).
    """

    def __init__(self, rank: int, args: EngineArgs, publisher: KvEventPublisher | None = None) -> None:
        self.rank = rank
        self.args = args
        self._publisher = publisher
        self.kv_pool = KvPool(args.num_gpu_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching)
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []
        self._requests: dict[str, _Req] = {}
        self._wakeup = trio.Event()
        self._preemptions = 0
        self._passes = 0
        self._lifo = args.preemption_mode is PreemptionMode.LIFO
        self.metrics_value: trio_util.AsyncValue[Metrics] = trio_util.AsyncValue(self._snapshot())

    # --- public API -------------------------------------------------------------------------------

    @property
    def load(self) -> int:
        """Running + waiting requests (for the least-loaded rank choice)."""
        return len(self._running) + len(self._waiting)

    @property
    def metrics(self) -> Metrics:
        return self.metrics_value.value

    @property
    def passes(self) -> int:
        """Scheduler passes run so far (diagnostics)."""
        return self._passes

    def __contains__(self, uuid: str) -> bool:
        return uuid in self._requests

    def submit(self, req: SimRequest) -> TokenReceiver:
        """Queue a request; returns its output channel (never full: unread tokens are coalesced).

        Raises:
            BudgetError: chunked prefill off and the prompt exceeds ``max_num_batched_tokens``.
            CapacityError: the prompt needs more blocks than the pool.
            ValueError: empty plan or prompt, or the uuid is already queued on this rank (a caller bug).
        """
        if not req.plan or not req.prompt:
            raise ValueError("a simulated request needs a non-empty prompt and plan")
        check_prompt(self.args, len(req.prompt))
        if req.uuid in self._requests:
            raise ValueError(f"request {req.uuid} is already submitted to rank {self.rank}")
        send, receive = open_token_channel(req.plan)
        r = _Req(req, send)
        self._requests[req.uuid] = r
        self._waiting.append(r)
        self._publish_metrics()
        self._wakeup.set()
        return receive

    def cancel(self, uuid: str) -> bool:
        """Remove a request at once: frees its KV blocks and its running/waiting slot and closes its
        output channel. Returns True if it was queued or running."""
        r = self._requests.pop(uuid, None)
        if r is None:
            return False
        self._drop(r)
        self._publish_metrics()
        self._wakeup.set()
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The pass loop; runs until cancelled. On exit every output channel is closed.

        Cancellation: cancelling it stops the engine; requests still queued see their channel closed.
        """
        task_status.started()
        burst = 0  # signals emitted since the loop last let other tasks run (speedup 0)
        try:
            while True:
                if not self._running and not self._waiting:
                    await self._idle()
                    burst = 0
                    continue
                batch, prefill_tokens, decode_tokens, has_decode = self._schedule()
                if not batch:
                    self._flush()
                    await self._idle()
                    burst = 0
                    continue
                seconds = pass_seconds(
                    prefill_tokens=prefill_tokens,
                    decode_tokens=decode_tokens,
                    has_decode=has_decode,
                    kv_capacity_tokens=self.args.num_gpu_blocks * self.args.block_size,
                    speedup_ratio=self.args.speedup_ratio,
                    decode_speedup_ratio=self.args.decode_speedup_ratio,
                )
                if seconds > 0:
                    await trio.sleep(seconds)
                    burst = 0
                elif burst >= _BURST_SIGNALS:
                    await trio.lowlevel.checkpoint()
                    burst = 0
                burst += 1 + self._apply(batch)
                self._passes += 1
                self._flush()
        finally:
            for r in list(self._requests.values()):
                r.send.close()

    # --- the pass ---------------------------------------------------------------------------------

    async def _idle(self) -> None:
        await self._wakeup.wait()
        self._wakeup = trio.Event()

    def _schedule(self) -> tuple[list[_Req], int, int, bool]:
        kv = self.kv_pool
        full_budget = self.args.token_budget
        budget = full_budget if full_budget is not None else 1 << 62
        running = self._running
        batch: list[_Req] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.num_computed, budget)
            target = r.num_computed + n
            self_preempted = False
            while not kv.grow(r.kv, target):
                if len(running) == 1:
                    # Alone and still short: the sequence outgrew the whole pool; run on what exists.
                    kv.grow_partial(r.kv, target)
                    break
                victim_index = len(running) - 1 if self._lifo else 0
                victim = running[victim_index]
                self._preempt(victim_index)
                preempted = True
                if victim.sched:
                    budget += victim.sched
                    victim.sched = 0
                    batch.remove(victim)
                if victim is r:
                    self_preempted = True
                    break
                if victim_index < i:
                    i -= 1
            if self_preempted:
                continue
            r.sched = n
            batch.append(r)
            budget -= n
            i += 1

        # vLLM admits nothing in a step that had to preempt.
        if not preempted:
            limit = self.args.seq_limit
            waiting = self._waiting
            chunked = self.args.enable_chunked_prefill
            while waiting and budget > 0 and (limit is None or len(running) < limit):
                r = waiting[0]
                if not chunked:
                    remaining = r.num_tokens - kv.cached_prefix_tokens(r.kv, r.num_tokens)
                    # A sequence longer than the whole budget (a recompute after preemption) may
                    # only run alone, chunked.
                    alone = not batch and full_budget is not None and remaining > full_budget
                    if remaining > budget and not alone:
                        break
                cached = kv.admit(r.kv, r.num_tokens)
                if cached is None:
                    break
                waiting.popleft()
                r.state = _State.RUNNING
                r.num_computed = cached
                running.append(r)
                n = min(r.num_tokens - cached, budget)
                r.sched = n
                batch.append(r)
                budget -= n

        prefill_tokens = 0
        decode_tokens = 0
        has_decode = False
        for r in batch:
            if r.prefilled:
                has_decode = True
                decode_tokens += r.num_tokens
            else:
                prefill_tokens += r.sched
        return batch, prefill_tokens, decode_tokens, has_decode

    def _preempt(self, index: int) -> None:
        r = self._running.pop(index)
        self.kv_pool.release(r.kv)
        r.num_computed = 0
        r.prefilled = False
        r.state = _State.WAITING
        self._waiting.appendleft(r)
        self._preemptions += 1

    def _apply(self, batch: list[_Req]) -> int:
        """Apply a pass; returns the number of output signals emitted."""
        kv = self.kv_pool
        finished = False
        emitted = 0
        for r in batch:
            n, r.sched = r.sched, 0
            if r.state is not _State.RUNNING:
                continue  # cancelled while the pass was modelled
            r.num_computed += n
            kv.commit(r.kv, r.num_computed)
            if r.num_computed < r.num_tokens:
                continue  # a prompt chunk
            r.prefilled = True
            r.generated = generated = r.generated + 1
            r.num_tokens += 1
            completed = generated == len(r.plan)
            emitted += 1
            try:
                r.send.emit(completed)  # (the token is plan[generated - 1]; the reader computes it)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The reader went away: the request has no one to serve.
                completed = True
            if completed:
                self._requests.pop(r.sim.uuid, None)
                r.state = _State.DONE
                kv.release(r.kv)
                r.send.close()
                finished = True
        if finished:
            self._running = [r for r in self._running if r.state is _State.RUNNING]
        return emitted

    def _drop(self, r: _Req) -> None:
        if r.state is _State.WAITING:
            self._waiting.remove(r)
        elif r.state is _State.RUNNING:
            self._running.remove(r)
        r.state = _State.DONE
        self.kv_pool.release(r.kv)
        r.send.close()

    def _flush(self) -> None:
        events = self.kv_pool.drain_events()
        if events and self._publisher is not None:
            try:
                self._publisher.publish(events)
            except Exception:  # a broken publisher must not stop the engine
                LOGGER.warning("rank %d: publishing KV events failed", self.rank, exc_info=True)
        self._publish_metrics()

    # --- metrics ----------------------------------------------------------------------------------

    def _snapshot(self) -> Metrics:
        kv = self.kv_pool
        active = kv.active_blocks
        return Metrics(
            dp_rank=self.rank,
            active_decode_blocks=active,
            total_blocks=kv.total_blocks,
            gpu_cache_usage_perc=active / kv.total_blocks,
            running_requests=len(self._running),
            waiting_requests=len(self._waiting),
            vllm_preemptions_total=self._preemptions,
        )

    def _publish_metrics(self) -> None:
        snapshot = self._snapshot()
        if snapshot != self.metrics_value.value:
            self.metrics_value.value = snapshot

    def __repr__(self) -> str:
        return (
            f"<RankEngine rank={self.rank} running={len(self._running)} waiting={len(self._waiting)} "
            f"preemptions={self._preemptions} {self.kv_pool!r}>"
        )
