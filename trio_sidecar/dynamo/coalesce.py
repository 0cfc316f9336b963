"""Coalescing under back-pressure (pure): the queued token deltas of one request handed to Dynamo as one.

The engine already hands the plain token chunks of the messages it reads together to the bridge as one
(``convert/batch.deliver_items``). This is the other, separate case: chunks that *queue* because Dynamo's
consumer lags (a request past its inline window whose previous frame is still being sent). When the next
frame goes out, the plain token deltas queued behind it go with it as one multi-token delta, so a lagging
consumer pays Dynamo's per-item cost once per batch instead of once per token.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["take_merged"]

# Keys a chunk may carry and still be merged with its successor (a plain token delta, docs/reference/sidecar.md#output-chunks).
_DELTA_KEYS = frozenset({"token_ids", "index", "text", "log_probs", "top_logprobs"})
_LIST_KEYS = ("token_ids", "log_probs", "top_logprobs")


def take_merged(items: deque[Any]) -> dict[str, Any]:
    """Take the output dict at the head of ``items``, with the chunks queued behind it folded in while they
    merge.

    Only a plain token delta (``token_ids``, ``text``, logprobs, non-empty ids) absorbs its successor; the
    successor may be the terminal chunk (its ``finish_reason``, usage and other keys are kept, and nothing
    merges after it). Never folds into or across an empty delta (cancelled chunks, prefill terminals), never
    across choices (``index``), and per-token arrays stay aligned: every chunk of a run carries the same of
    ``log_probs``/``top_logprobs``. Texts are concatenated exactly. Anything that is not a dict (the end
    sentinel, an error) stops the run.
    """
    first: dict[str, Any] = items.popleft()
    if not items or not first.keys() <= _DELTA_KEYS or not first.get("token_ids"):
        return first
    index = first.get("index", 0)
    log_probs = "log_probs" in first
    top_logprobs = "top_logprobs" in first
    run = [first]
    previous = first
    while items:
        chunk = items[0]
        if (
            type(chunk) is not dict
            or not previous.keys() <= _DELTA_KEYS  # (the previous one was a terminal chunk: nothing follows it)
            or chunk.get("index", 0) != index
            or not chunk.get("token_ids")
            or ("log_probs" in chunk) != log_probs
            or ("top_logprobs" in chunk) != top_logprobs
        ):
            break
        run.append(items.popleft())
        previous = chunk
    if len(run) == 1:
        return first
    merged = dict(run[-1])
    for key in _LIST_KEYS:
        if key in first:
            values: list[Any] = []
            for chunk in run:
                values += chunk[key]
            merged[key] = values
    if any("text" in chunk for chunk in run):
        merged["text"] = "".join([chunk.get("text", "") for chunk in run])
    return merged
