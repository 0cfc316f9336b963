"""Coalescing under back-pressure (trio_sidecar/dynamo/coalesce.py): pure, no Dynamo and no Trio."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_sidecar.dynamo.coalesce import take_merged

CANCELLED = {"token_ids": [], "index": 0, "finish_reason": "cancelled"}


def merged_pair(first: dict, second: dict) -> dict | None:
    """``take_merged`` of two queued chunks: the merged one, or None when the second stayed queued."""
    items = deque([dict(first), dict(second)])
    out = take_merged(items)
    return None if items else out


@pytest.mark.parametrize(
    ("first", "second", "merged"),
    [
        ({"token_ids": [1], "index": 0}, {"token_ids": [2], "index": 0}, {"token_ids": [1, 2], "index": 0}),
        # text and per-token logprob arrays are concatenated, aligned with the tokens
        (
            {
                "token_ids": [1],
                "index": 0,
                "text": "a",
                "log_probs": [-0.1],
                "top_logprobs": [[{"rank": 1, "token_id": 1, "token": None, "logprob": -0.1}]],
            },
            {
                "token_ids": [2, 3],
                "index": 0,
                "text": "bc",
                "log_probs": [-0.2, -0.3],
                "top_logprobs": [
                    [{"rank": 1, "token_id": 2, "token": None, "logprob": -0.2}],
                    [{"rank": 1, "token_id": 3, "token": None, "logprob": -0.3}],
                ],
            },
            {
                "token_ids": [1, 2, 3],
                "index": 0,
                "text": "abc",
                "log_probs": [-0.1, -0.2, -0.3],
                "top_logprobs": [
                    [{"rank": 1, "token_id": 1, "token": None, "logprob": -0.1}],
                    [{"rank": 1, "token_id": 2, "token": None, "logprob": -0.2}],
                    [{"rank": 1, "token_id": 3, "token": None, "logprob": -0.3}],
                ],
            },
        ),
        # held-back text ("") and the completed character: concatenated exactly, "" kept (never dropped)
        (
            {"token_ids": [1], "index": 0, "text": ""},
            {"token_ids": [2], "index": 0, "text": "\u00e4"},
            {"token_ids": [1, 2], "index": 0, "text": "\u00e4"},
        ),
        (
            {"token_ids": [1], "index": 0, "text": ""},
            {"token_ids": [2], "index": 0, "text": ""},
            {"token_ids": [1, 2], "index": 0, "text": ""},
        ),
        # a delta absorbs the terminal chunk; the terminal's keys are kept
        (
            {"token_ids": [1], "index": 0},
            {
                "token_ids": [2],
                "index": 0,
                "finish_reason": "length",
                "completion_usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            },
            {
                "token_ids": [1, 2],
                "index": 0,
                "finish_reason": "length",
                "completion_usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            },
        ),
    ],
)
def test_plain_token_deltas_are_coalesced(first, second, merged):
    assert merged_pair(first, second) == merged


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"token_ids": [1], "index": 0, "finish_reason": "stop"}, {"token_ids": [2], "index": 0}),  # terminal first
        ({"token_ids": [1], "index": 0}, CANCELLED),  # never fold into or across an empty delta
        ({"token_ids": [], "index": 0}, {"token_ids": [2], "index": 0}),
        ({"token_ids": [1], "index": 0, "log_probs": [-0.1]}, {"token_ids": [2], "index": 0}),  # misaligned
        ({"token_ids": [1], "index": 0}, {"token_ids": [2], "index": 1}),
        ({"token_ids": [1], "index": 0, "disaggregated_params": {}}, {"token_ids": [2], "index": 0}),
    ],
)
def test_chunks_that_are_not_plain_deltas_are_never_coalesced(first, second):
    assert merged_pair(first, second) is None


def test_nothing_is_merged_past_the_end_or_an_error():
    end, error = object(), RuntimeError("x")
    for stop in (end, error):
        items = deque([{"token_ids": [1], "index": 0}, stop, {"token_ids": [2], "index": 0}])
        assert take_merged(items) == {"token_ids": [1], "index": 0}
        assert items[0] is stop


@st.composite
def queued_chunk(draw):
    """A chunk as the Trio side queues it: mostly plain deltas, sometimes terminal, cancelled or other."""
    index = draw(st.sampled_from([0, 0, 0, 1]))
    ids = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))
    chunk = {"token_ids": ids, "index": index}
    if draw(st.booleans()):
        chunk["text"] = draw(st.sampled_from(["", "a", "bc"]))
    if draw(st.integers(0, 4)) == 0:
        chunk["log_probs"] = [-0.5] * len(ids)
    if draw(st.integers(0, 6)) == 0:
        chunk["top_logprobs"] = [[{"rank": 1, "token_id": t, "token": None, "logprob": -0.5}] for t in ids]
    kind = draw(st.integers(0, 7))
    if kind == 0:
        chunk.update(
            finish_reason="length", completion_usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        )
    elif kind == 1:
        chunk["disaggregated_params"] = {}
    return chunk


def fold_pairwise(queue: list) -> list:
    """The reference: fold the queued chunks one pair at a time, each merge by the documented rules."""
    keys = {"token_ids", "index", "text", "log_probs", "top_logprobs"}

    def merge(first: dict, second: dict) -> dict | None:
        if not first.keys() <= keys or first.get("index", 0) != second.get("index", 0):
            return None
        if not first.get("token_ids") or not second.get("token_ids"):
            return None
        for key in ("log_probs", "top_logprobs"):
            if (key in first) != (key in second):
                return None
        merged = dict(second)
        for key in ("token_ids", "log_probs", "top_logprobs"):
            if key in first:
                merged[key] = [*first[key], *second[key]]
        if "text" in first or "text" in second:
            merged["text"] = first.get("text", "") + second.get("text", "")
        return merged

    items = deque(queue)
    out = []
    while items:
        chunk = items.popleft()
        while items:
            folded = merge(chunk, items[0])
            if folded is None:
                break
            items.popleft()
            chunk = folded
        out.append(chunk)
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(queued_chunk(), max_size=12))
def test_taking_merged_runs_equals_merging_the_queue_pair_by_pair(queue):
    items = deque(dict(c) for c in queue)
    taken = []
    while items:
        taken.append(take_merged(items))
    assert taken == fold_pairwise([dict(c) for c in queue])
