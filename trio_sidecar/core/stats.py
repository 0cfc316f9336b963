"""The sidecar's counters, gauges and histograms (docs/observability.md). PURE: no I/O, no Trio.

Theory of operation
-------------------
One :class:`SidecarStats` per engine records what happens, from the Trio thread only, with plain integer
adds: each request's start, rejection and end (engine), its first delivered tokens (request task),
``Control.Abort`` outcomes (abort sender), decode hand-off deferrals, the prober's state transitions.
Nothing is computed per token or per delivery: a request reads the clock three times (accepted, first
tokens delivered, ended), observes its time to first token once, its mean inter-token latency once at its
end, and its tokens are summed then.

:meth:`SidecarStats.snapshot` copies everything into a frozen :class:`StatsSnapshot` (the embedded
``Sidecar.stats()``; ``trio-sidecar run`` maps it to Prometheus text when ``/metrics`` is scraped). A copy
is made of each field with one C-level operation (``dict.copy``, ``tuple(list)``), so a snapshot may also be
taken from another thread holding the GIL (Dynamo's scrape callback): every field is exact, the fields
together may straddle a request's end.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

import attrs

__all__ = [
    "ABORT_OUTCOMES",
    "ERROR_TYPES",
    "FINISH_REASONS",
    "HEALTH_STATES",
    "ITL_BUCKETS",
    "REJECT_REASONS",
    "TTFT_BUCKETS",
    "Histogram",
    "HistogramSnapshot",
    "SidecarStats",
    "StatsSnapshot",
    "error_type",
]

#: Time to first token, seconds: vLLM's own buckets (``vllm/v1/metrics/buckets.py``,
#: ``TIME_TO_FIRST_TOKEN_BUCKETS``), so the sidecar's view lines up with ``vllm:time_to_first_token_seconds``.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: Inter-token latency (a request's mean), seconds: vLLM's ``INTER_TOKEN_LATENCY_BUCKETS`` with three finer
#: buckets below 10 ms in front (tokens that vLLM sends in one step, or that arrive together, are a few µs
#: apart as the sidecar sees them).
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

#: Finish reasons present (at 0) from the start; any other reason vLLM reports is added when first seen.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "cancelled")
#: The error family's kinds (``errors.ErrorKind``) in snake case, plus ``unexpected`` for a failure outside
#: the family (a bug).
ERROR_TYPES: tuple[str, ...] = (
    "invalid_argument",
    "unknown",
    "engine_shutdown",
    "cannot_connect",
    "connection_timeout",
    "cancelled",
    "unexpected",
)
#: Why a request was refused before it started: the prober's state is not SERVING (``not_serving``), the
#: engine is not started or stopped admitting (``not_started``), or the request did not convert
#: (``invalid_argument``).
REJECT_REASONS: tuple[str, ...] = ("not_serving", "not_started", "invalid_argument")
#: ``Control.Abort`` outcomes, counted in request ids.
ABORT_OUTCOMES: tuple[str, ...] = ("sent", "failed", "timed_out")
#: The prober's states (``health_policy.HealthKind`` values).
HEALTH_STATES: tuple[str, ...] = ("serving", "not_serving", "unreachable", "recovering", "failed")

_ERROR_TYPE_OF_KIND = {
    "InvalidArgument": "invalid_argument",
    "Unknown": "unknown",
    "EngineShutdown": "engine_shutdown",
    "CannotConnect": "cannot_connect",
    "ConnectionTimeout": "connection_timeout",
    "Cancelled": "cancelled",
}


def error_type(kind_value: str | None) -> str:
    """The ``error_type`` of an ``ErrorKind`` value (``"CannotConnect"`` → ``"cannot_connect"``); ``None`` (not
    a ``SidecarError``) → ``"unexpected"``."""
    if kind_value is None:
        return "unexpected"
    return _ERROR_TYPE_OF_KIND.get(kind_value, "unexpected")


@attrs.frozen
class HistogramSnapshot:
    """A histogram's state. ``counts[i]`` counts observations ``<= bounds[i]`` (and above the previous
    bound); the last one, those above every bound (``+Inf``)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Prometheus's ``_bucket`` values: observations ``<= bounds[i]``, then ``+Inf`` (the total)."""
        out: list[int] = []
        total = 0
        for count in self.counts:
            total += count
            out.append(total)
        return out


class Histogram:
    """Fixed-bucket histogram; :meth:`observe` is one bisect and two adds."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``count`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


@attrs.frozen(kw_only=True)
class StatsSnapshot:
    """Everything :class:`SidecarStats` counts, frozen (``Sidecar.stats()``; docs/observability.md).

    Requests: ``requests_started`` = the sum of ``requests_finished`` and ``request_errors`` +
    ``requests_in_flight`` (a rejected request never started). Mappings are copies; keys with ``None`` are
    requests without a selected DP rank (vLLM balances them).
    """

    requests_started: int
    requests_started_by_dp_rank: Mapping[int | None, int]
    requests_in_flight: int
    requests_in_flight_by_dp_rank: Mapping[int | None, int]
    #: Requests that ended with a final chunk, by its finish reason (``cancelled``: the client's or the
    #: engine's cancellation, or vLLM's ``ABORTED``).
    requests_finished: Mapping[str, int]
    #: Requests that ended with an error, by ``error_type`` (:data:`ERROR_TYPES`).
    request_errors: Mapping[str, int]
    #: Requests refused before they started, by reason (:data:`REJECT_REASONS`).
    requests_rejected: Mapping[str, int]
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot
    aborts_queued: int
    aborts_sent: int
    aborts_failed: int
    aborts_timed_out: int
    decode_deferrals: int
    health_state: str
    health_transitions: Mapping[str, int]
    pool_connections: int
    pool_connections_up: int
    pool_reconnects: int
    pool_reconnect_failures: int


class SidecarStats:
    """The recorder (see the module docstring). Written from one thread; :meth:`snapshot` from any."""

    def __init__(self) -> None:
        self.started_by_rank: dict[int | None, int] = {None: 0}
        self.in_flight_by_rank: dict[int | None, int] = {None: 0}
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.errors: dict[str, int] = dict.fromkeys(ERROR_TYPES, 0)
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.aborts_queued = 0
        self.aborts_sent = 0
        self.aborts_failed = 0
        self.aborts_timed_out = 0
        self.decode_deferrals = 0
        self.health_transitions: dict[str, int] = dict.fromkeys(HEALTH_STATES, 0)

    def __repr__(self) -> str:
        started = sum(self.started_by_rank.values())
        in_flight = sum(self.in_flight_by_rank.values())
        return f"<SidecarStats {started} started, {in_flight} in flight>"

    # --- requests (engine) ------------------------------------------------------------------------------

    def add_dp_ranks(self, dp_size: int) -> None:
        """Show every rank of a data-parallel engine (at 0) before its first request."""
        if dp_size > 1:
            for rank in range(dp_size):
                self.started_by_rank.setdefault(rank, 0)
                self.in_flight_by_rank.setdefault(rank, 0)

    def request_rejected(self, reason: str) -> None:
        self.rejected[reason] += 1

    def request_started(self, dp_rank: int | None) -> None:
        started = self.started_by_rank
        started[dp_rank] = started.get(dp_rank, 0) + 1
        in_flight = self.in_flight_by_rank
        in_flight[dp_rank] = in_flight.get(dp_rank, 0) + 1

    def request_finished(
        self,
        dp_rank: int | None,
        finish_reason: str | None,
        error_kind: str | None,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """One request ended: with a final chunk (``finish_reason``, ``None`` only if it has none) or, when
        ``finish_reason`` is ``None``, with an error (``error_kind`` the ``ErrorKind`` value, ``None``: not a
        ``SidecarError``). ``prompt_tokens`` counts only requests vLLM received (0 otherwise)."""
        self.in_flight_by_rank[dp_rank] -= 1
        if finish_reason is not None:
            finished = self.finished
            finished[finish_reason] = finished.get(finish_reason, 0) + 1
        else:
            self.errors[error_type(error_kind)] += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    # --- the other components ---------------------------------------------------------------------------

    def health_changed(self, state: str) -> None:
        """The prober published a state of another kind (``HealthKind`` value)."""
        self.health_transitions[state] += 1

    # --- reading ----------------------------------------------------------------------------------------

    def snapshot(
        self,
        *,
        health_state: str = "serving",
        pool_connections: int = 0,
        pool_connections_up: int = 0,
        pool_reconnects: int = 0,
        pool_reconnect_failures: int = 0,
    ) -> StatsSnapshot:
        """A frozen copy. The gauges of other components are read by their owner (the engine): the prober's
        current state and the connection pool's numbers."""
        started = self.started_by_rank.copy()
        in_flight = self.in_flight_by_rank.copy()
        return StatsSnapshot(
            requests_started=sum(started.values()),
            requests_started_by_dp_rank=started,
            requests_in_flight=sum(in_flight.values()),
            requests_in_flight_by_dp_rank=in_flight,
            requests_finished=self.finished.copy(),
            request_errors=self.errors.copy(),
            requests_rejected=self.rejected.copy(),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            time_to_first_token=self.ttft.snapshot(),
            inter_token_latency=self.itl.snapshot(),
            aborts_queued=self.aborts_queued,
            aborts_sent=self.aborts_sent,
            aborts_failed=self.aborts_failed,
            aborts_timed_out=self.aborts_timed_out,
            decode_deferrals=self.decode_deferrals,
            health_state=health_state,
            health_transitions=self.health_transitions.copy(),
            pool_connections=pool_connections,
            pool_connections_up=pool_connections_up,
            pool_reconnects=pool_reconnects,
            pool_reconnect_failures=pool_reconnect_failures,
        )
