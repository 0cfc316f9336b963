"""KV-event source validation and wildcard rewrite (docs/reference/sidecar.md#kv-event-sources); DP rank selection (docs/reference/sidecar.md#data-parallel-rank)."""

from __future__ import annotations

from typing import Any

import pytest

from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.errors import ProtocolError
from trio_sidecar.core.protocol import RoutingHints
from trio_sidecar.core.routing import (
    KvEventSource,
    dp_rank_metadata,
    rewrite_wildcard_endpoint,
    select_dp_rank,
    validate_kv_event_sources,
)


def src(endpoint: str = "tcp://127.0.0.1:1", rank: int | None = 0, transport: str = "zmq", topic: str = "") -> Any:
    msg = control_pb2.KvEventSource(transport=transport, endpoint=endpoint, topic=topic)
    if rank is not None:
        msg.data_parallel_rank = rank
    return msg


def test_dp2_fixture_rewrites_wildcards() -> None:
    sources, warnings = validate_kv_event_sources(
        [src("tcp://*:20081", 0), src("tcp://0.0.0.0:20082", 1)], 2, "127.0.0.1"
    )
    assert [s.endpoint for s in sources] == ["tcp://127.0.0.1:20081", "tcp://127.0.0.1:20082"]
    assert {s.dp_rank for s in sources} == {0, 1}
    assert all(s.topic == "" for s in sources)
    assert warnings == []


@pytest.mark.parametrize(
    ("endpoint", "host", "expected"),
    [
        ("tcp://*:1", "10.0.0.5", "tcp://10.0.0.5:1"),
        ("tcp://0.0.0.0:2", "vllm.local", "tcp://vllm.local:2"),
        ("tcp://[::]:3", "::1", "tcp://[::1]:3"),
        ("tcp://*:4", "[::1]", "tcp://[::1]:4"),
        ("tcp://127.0.0.2:5", "::1", "tcp://127.0.0.2:5"),
        ("tcp://vllm:6", "other", "tcp://vllm:6"),
        ("ipc:///tmp/kv", "h", "ipc:///tmp/kv"),
    ],
)
def test_rewrite(endpoint: str, host: str, expected: str) -> None:
    assert rewrite_wildcard_endpoint(endpoint, host) == expected


def test_ipv6_endpoint_host_is_bracketed() -> None:
    sources, _ = validate_kv_event_sources([src("tcp://*:9", 0, topic="kv-events")], 1, "::1")
    assert sources == (KvEventSource(endpoint="tcp://[::1]:9", topic="kv-events", dp_rank=0),)


def test_empty_list_means_no_sources() -> None:
    assert validate_kv_event_sources([], 4, "h") == ((), [])


def test_non_zmq_source_is_skipped_with_warning() -> None:
    sources, warnings = validate_kv_event_sources(
        [src("nats://x", None, transport="nats"), src("tcp://*:1", 0)], 1, "h"
    )
    assert [s.endpoint for s in sources] == ["tcp://h:1"]
    assert len(warnings) == 1 and warnings[0].startswith("Skipping unsupported vLLM KV-event transport")


@pytest.mark.parametrize(
    ("sources", "dp", "message"),
    [
        ([src(rank=None)], 1, "GetKvEventSources returned a ZMQ source without data_parallel_rank"),
        ([src(rank=2)], 2, "GetKvEventSources returned rank 2, outside the expected local range 0..2"),
        ([src(rank=0), src(rank=0)], 2, "GetKvEventSources returned duplicate rank 0"),
        ([src(endpoint="  ", rank=0)], 1, "GetKvEventSources returned a ZMQ source without an endpoint"),
        (
            [src(rank=1)],
            2,
            "GetKvEventSources returned ZMQ sources for 1 of 2 local data-parallel ranks; KV routing requires one "
            "source for every local rank",
        ),
        (
            [src(transport="nats")],
            1,
            "GetKvEventSources returned ZMQ sources for 0 of 1 local data-parallel ranks; KV routing requires one "
            "source for every local rank",
        ),
    ],
)
def test_source_errors(sources: list, dp: int, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_kv_event_sources(sources, dp, "h")
    assert str(info.value) == "invalid vLLM gRPC response: " + message


def test_a_hybrid_node_accepts_exactly_its_hosted_ranks() -> None:
    sources, _ = validate_kv_event_sources([src("tcp://*:1", 2), src("tcp://*:2", 3)], range(2, 4), "h")
    assert [s.dp_rank for s in sources] == [2, 3]
    with pytest.raises(ProtocolError, match="returned rank 0, outside the expected local range 2..4"):
        validate_kv_event_sources([src(rank=0)], range(2, 4), "h")


def test_checks_in_order_per_source() -> None:
    # Rank out of range is reported before the blank endpoint of the same source.
    with pytest.raises(ProtocolError, match="outside the expected local range"):
        validate_kv_event_sources([src(endpoint="", rank=5)], 1, "h")
    # A skipped non-ZMQ source is never validated further.
    sources, _ = validate_kv_event_sources([src("", None, transport="ipc"), src(rank=0)], 1, "h")
    assert len(sources) == 1


@pytest.mark.parametrize(
    ("routing", "mode", "rank"),
    [
        (RoutingHints(dp_rank=1), DisaggregationMode.AGG, 1),
        (RoutingHints(prefill_dp_rank=2, dp_rank=1), DisaggregationMode.PREFILL, 2),
        (RoutingHints(dp_rank=1), DisaggregationMode.PREFILL, 1),
        (RoutingHints(prefill_dp_rank=2), DisaggregationMode.DECODE, None),
        (RoutingHints(), DisaggregationMode.AGG, None),
        (None, DisaggregationMode.AGG, None),
    ],
)
def test_select_dp_rank(routing: RoutingHints | None, mode: DisaggregationMode, rank: int | None) -> None:
    assert select_dp_rank(routing, mode) == rank


def test_metadata() -> None:
    assert dp_rank_metadata(None) == ()
    assert dp_rank_metadata(0) == (("x-data-parallel-rank", "0"),)
    assert dp_rank_metadata(12) == (("x-data-parallel-rank", "12"),)
