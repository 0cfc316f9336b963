"""The mock's vLLM-named Prometheus metrics and their optional HTTP ``/metrics`` listener
(docs/reference/mock.md#metrics).

The names, types, labels (``model_name``, ``engine`` = the DP rank) and histogram buckets are vLLM's
(``vllm/v1/metrics/loggers.py``, ``vllm/v1/metrics/buckets.py``), so a dashboard, autoscaler or alert written for
vLLM's ``/metrics`` reads the mock's unchanged. They report what the mock simulates:

- the scheduler's gauges, per rank, read from its metrics snapshot at scrape time
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) and its
  ``vllm:num_preemptions_total``;
- per request, as its RPC delivers tokens: ``vllm:prompt_tokens_total`` (the prompt, counted with the first
  output token, when vLLM's prefill would have finished), ``vllm:generation_tokens_total``,
  ``vllm:time_to_first_token_seconds`` (arrival to the first token handed to the RPC),
  ``vllm:inter_token_latency_seconds`` (one observation per token delivered after the first delivery: the
  time since the previous delivery, shared by the tokens delivered together), ``vllm:e2e_request_latency_seconds`` and
  ``vllm:request_success_total{finished_reason}`` (``stop``, ``length``, ``abort``) when the RPC ends.

Times are Trio's clock, so they include the mock's simulated step durations (``speedup_ratio``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import trio

from trio_sidecar.core.stats import Histogram

__all__ = [
    "E2E_BUCKETS",
    "ITL_BUCKETS",
    "TTFT_BUCKETS",
    "MockMetrics",
    "RequestTimer",
    "serve_metrics_http",
]

#: vLLM's ``TIME_TO_FIRST_TOKEN_BUCKETS``.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's ``INTER_TOKEN_LATENCY_BUCKETS``.
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's request-latency buckets (``vllm:e2e_request_latency_seconds``).
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: vLLM's ``finished_reason`` label values.
FINISHED_REASONS = ("stop", "length", "abort")


class RequestTimer:
    """One request's delivery times (``_Call.timer``); :class:`MockMetrics` reads it when the RPC ends."""

    __slots__ = ("arrival", "finished_reason", "last", "metrics", "prompt_tokens", "rank", "tokens")

    def __init__(self, metrics: MockMetrics, rank: int, prompt_tokens: int) -> None:
        self.metrics = metrics
        self.rank = rank
        self.prompt_tokens = prompt_tokens
        self.arrival = trio.current_time()
        self.last: float | None = None
        self.tokens = 0
        self.finished_reason = "abort"

    def delivered(self, count: int, finish_reason: str | None = None) -> None:
        """``count`` tokens were handed to the RPC now; ``finish_reason`` (``stop``/``length``/``abort``) when
        the terminal came with them."""
        if finish_reason is not None:
            self.finished_reason = finish_reason
        if count <= 0:
            return
        now = trio.current_time()
        rank = self.metrics.ranks[self.rank]
        if self.last is None:  # tokens delivered with the first one observe no interval of their own
            rank.ttft.observe(now - self.arrival)
            rank.prompt_tokens += self.prompt_tokens
        else:
            rank.itl.observe((now - self.last) / count, count)
        rank.generation_tokens += count
        self.tokens += count
        self.last = now

    def ended(self) -> None:
        """The RPC ended (any way)."""
        rank = self.metrics.ranks[self.rank]
        rank.e2e.observe(trio.current_time() - self.arrival)
        rank.success[self.finished_reason] = rank.success.get(self.finished_reason, 0) + 1


class _RankCounters:
    __slots__ = ("e2e", "generation_tokens", "itl", "prompt_tokens", "success", "ttft")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)


class MockMetrics:
    """The counters of every rank, and their exposition.

    Args:
        model_name: the ``model_name`` label (the served model name).
        snapshots: per rank, a function returning the scheduler's metrics snapshot (``Metrics``).
    """

    def __init__(self, model_name: str, snapshots: Sequence[Callable[[], Any]]) -> None:
        self.model_name = model_name
        self._snapshots = list(snapshots)
        self.ranks = [_RankCounters() for _ in self._snapshots]

    def timer(self, rank: int, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, rank, prompt_tokens)

    def render(self) -> str:
        """Prometheus text exposition (0.0.4)."""
        lines: list[str] = []
        snapshots = [snap() for snap in self._snapshots]

        def family(name: str, kind: str, help: str) -> None:
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")

        def labels(rank: int, **extra: str) -> str:
            pairs = [("model_name", self.model_name), ("engine", str(rank)), *extra.items()]
            return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"

        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", "running_requests"),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting_requests"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gpu_cache_usage_perc"),
        )
        for name, help, attr in gauges:
            family(name, "gauge", help)
            lines += [f"{name}{labels(r)} {_number(getattr(s, attr))}" for r, s in enumerate(snapshots)]
        family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.")
        lines += [f"vllm:num_preemptions_total{labels(r)} {s.vllm_preemptions_total}" for r, s in enumerate(snapshots)]
        family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
        lines += [f"vllm:prompt_tokens_total{labels(r)} {c.prompt_tokens}" for r, c in enumerate(self.ranks)]
        family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.")
        lines += [f"vllm:generation_tokens_total{labels(r)} {c.generation_tokens}" for r, c in enumerate(self.ranks)]
        family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
        for r, c in enumerate(self.ranks):
            for reason, count in c.success.items():
                lines.append(f"vllm:request_success_total{labels(r, finished_reason=reason)} {count}")
        histograms = (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
        )
        for name, help, attr in histograms:
            family(name, "histogram", help)
            for r, c in enumerate(self.ranks):
                snapshot = getattr(c, attr).snapshot()
                bounds = [repr(float(b)) for b in snapshot.bounds] + ["+Inf"]
                for bound, total in zip(bounds, snapshot.cumulative(), strict=True):
                    lines.append(f"{name}_bucket{labels(r, le=bound)} {total}")
                lines.append(f"{name}_sum{labels(r)} {_number(snapshot.sum)}")
                lines.append(f"{name}_count{labels(r)} {snapshot.count}")
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


_MAX_REQUEST_HEAD = 8192
_REQUEST_TIMEOUT_S = 10.0


async def serve_metrics_http(
    metrics: MockMetrics, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> NoReturn:
    """Serve ``GET /metrics`` (HTTP/1.1, one request per connection) on ``host:port``; ``started(port)``.

    Anything else is ``404`` (another path) or ``405`` (another method). A client that sends no complete
    request head within 10 s, or one over 8 KiB, is disconnected.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(partial(_handle, metrics), listeners)
    raise AssertionError("serve_listeners returned")  # pragma: no cover


async def _handle(metrics: MockMetrics, stream: trio.SocketStream) -> None:
    async with stream:
        head = b""
        with trio.move_on_after(_REQUEST_TIMEOUT_S):
            while b"\r\n\r\n" not in head and len(head) <= _MAX_REQUEST_HEAD:
                try:
                    data = await stream.receive_some(4096)
                except trio.BrokenResourceError:
                    return
                if not data:
                    break
                head += data
        if b"\r\n\r\n" not in head:
            return
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        if path != "/metrics":
            status, body, kind = "404 Not Found", b"not found\n", "text/plain; charset=utf-8"
        elif method not in ("GET", "HEAD"):
            status, body, kind = "405 Method Not Allowed", b"method not allowed\n", "text/plain; charset=utf-8"
        else:
            status, body, kind = "200 OK", metrics.render().encode(), "text/plain; version=0.0.4; charset=utf-8"
        response = (
            f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + (b"" if method == "HEAD" else body)
        try:
            await stream.send_all(response)
        except trio.BrokenResourceError:
            pass
