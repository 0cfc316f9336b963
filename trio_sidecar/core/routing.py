"""Data-parallel rank selection and KV-event source validation (docs/reference/sidecar.md#data-parallel-rank). PURE: no I/O, no Trio."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from .config import DisaggregationMode
from .errors import ProtocolError

if TYPE_CHECKING:
    from .protocol import RoutingHints

__all__ = [
    "DP_RANK_METADATA_KEY",
    "KvEventSource",
    "select_dp_rank",
    "dp_rank_metadata",
    "validate_kv_event_sources",
    "rewrite_wildcard_endpoint",
    "UNSUPPORTED_TRANSPORT_WARNING",
]

DP_RANK_METADATA_KEY = "x-data-parallel-rank"
UNSUPPORTED_TRANSPORT_WARNING = "Skipping unsupported vLLM KV-event transport"

# ZMQ bind addresses that mean "every interface": a subscriber must use the vLLM host instead.
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")


@attrs.frozen
class KvEventSource:
    """One validated ZMQ KV-event publisher of vLLM (one per DP rank); ``topic`` ``""`` = all topics."""

    endpoint: str
    topic: str
    dp_rank: int


def select_dp_rank(routing: RoutingHints | None, mode: DisaggregationMode) -> int | None:
    """docs/reference/sidecar.md#data-parallel-rank: prefill prefers ``routing.prefill_dp_rank``, then ``routing.dp_rank``; others ``dp_rank``."""
    if routing is None:
        return None
    if DisaggregationMode.parse(mode) is DisaggregationMode.PREFILL and routing.prefill_dp_rank is not None:
        return routing.prefill_dp_rank
    return routing.dp_rank


def dp_rank_metadata(rank: int | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata for ``rank``: empty without a rank, so vLLM keeps its own balancing."""
    if rank is None:
        return ()
    return ((DP_RANK_METADATA_KEY, str(rank)),)


def rewrite_wildcard_endpoint(endpoint: str, grpc_host: str) -> str:
    """``tcp://*:P`` / ``tcp://0.0.0.0:P`` / ``tcp://[::]:P`` → ``tcp://{grpc_host}:P`` (IPv6 bracketed)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return endpoint
    host, colon, port = rest.rpartition(":")
    if not colon or host not in _WILDCARD_HOSTS:
        return endpoint
    bare = grpc_host.strip("[]")
    url_host = f"[{bare}]" if ":" in bare else bare
    return f"tcp://{url_host}:{port}"


def validate_kv_event_sources(
    sources: Iterable[Any], ranks: range | int, grpc_host: str
) -> tuple[tuple[KvEventSource, ...], list[str]]:
    """Validate ``GetKvEventSources`` entries (docs/reference/sidecar.md#kv-event-sources) and rewrite wildcard hosts.

    Args:
        sources: ``vllm.KvEventSource`` messages, in the server's order.
        ranks: the DP ranks this vLLM hosts (an int ``n`` means ``range(n)``).
        grpc_host: the host of ``--grpc-endpoint`` (brackets optional for IPv6).

    Returns:
        ``(accepted sources, warnings)``; each warning is a log line for a skipped source.

    Raises:
        ProtocolError: with the texts (docs/reference/sidecar.md#kv-event-sources).
    """
    sources = list(sources)
    if isinstance(ranks, int):
        ranks = range(ranks)
    accepted: list[KvEventSource] = []
    warnings: list[str] = []
    seen: set[int] = set()
    for source in sources:
        if source.transport != "zmq":
            warnings.append(f"{UNSUPPORTED_TRANSPORT_WARNING} `{source.transport}` ({source.endpoint})")
            continue
        if not source.HasField("data_parallel_rank"):
            raise ProtocolError("GetKvEventSources returned a ZMQ source without data_parallel_rank")
        rank = source.data_parallel_rank
        if rank not in ranks:
            raise ProtocolError(
                f"GetKvEventSources returned rank {rank}, outside the expected local range {ranks.start}..{ranks.stop}"
            )
        if rank in seen:
            raise ProtocolError(f"GetKvEventSources returned duplicate rank {rank}")
        if not source.endpoint.strip():
            raise ProtocolError("GetKvEventSources returned a ZMQ source without an endpoint")
        seen.add(rank)
        accepted.append(
            KvEventSource(
                endpoint=rewrite_wildcard_endpoint(source.endpoint, grpc_host),
                topic=source.topic,
                dp_rank=rank,
            )
        )
    if sources and len(seen) != len(ranks):
        raise ProtocolError(
            f"GetKvEventSources returned ZMQ sources for {len(seen)} of {len(ranks)} local data-parallel ranks; "
            "KV routing requires one source for every local rank"
        )
    return tuple(accepted), warnings
