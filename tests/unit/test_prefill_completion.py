"""The worker-side prefill completion's per-request binding (docs/dynamo.md#router-load-signals)."""

from __future__ import annotations

import pytest

from trio_sidecar.dynamo.prefill_completion import PrefillCompletion, request_dp_rank


@pytest.mark.parametrize(
    ("request_", "rank"),
    [
        ({"routing": {"dp_rank": 0}}, 0),
        ({"routing": {"dp_rank": 3, "prefill_dp_rank": 1}}, 3),  # the decode/aggregated rank, not prefill's
        ({"routing": {"prefill_dp_rank": 1}}, None),
        ({"routing": {}}, None),
        ({"routing": None}, None),
        ({}, None),
        ({"routing": {"dp_rank": -1}}, None),
        ({"routing": {"dp_rank": True}}, None),
        ({"routing": {"dp_rank": "0"}}, None),
        (None, None),
    ],
)
def test_the_dp_rank_of_a_request_is_the_routers_choice_or_absent(request_, rank):
    assert request_dp_rank(request_) == rank


class RecordingSource:
    def __init__(self, error: Exception | None = None) -> None:
        self.bound: list[tuple[object, int | None]] = []
        self.error = error

    def bind(self, context, dp_rank=None) -> None:
        if self.error is not None:
            raise self.error
        self.bound.append((context, dp_rank))


def test_a_request_with_a_rank_is_bound_with_it():
    source = RecordingSource()
    context = object()
    assert PrefillCompletion(source).bind(context, {"routing": {"dp_rank": 2}}) is True
    assert source.bound == [(context, 2)]


def test_a_request_without_a_rank_is_not_bound():
    # Dynamo publishes nothing for it either: the router would not know which rank's load to change.
    source = RecordingSource()
    assert PrefillCompletion(source).bind(object(), {"routing": {}}) is False
    assert source.bound == []


def test_without_a_source_nothing_is_bound():
    # A prefill worker: endpoint.first_token_source(WorkerType.Prefill) returns None.
    completion = PrefillCompletion(None)
    assert not completion.enabled
    assert completion.bind(object(), {"routing": {"dp_rank": 0}}) is False


def test_a_failing_bind_leaves_the_request_unbound():
    # The signal is advisory: the router falls back to the first token in the response stream.
    source = RecordingSource(error=RuntimeError("closed"))
    assert PrefillCompletion(source).bind(object(), {"routing": {"dp_rank": 0}}) is False
