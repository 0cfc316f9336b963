"""Per-message outputs for reasoning models: with ``merge`` off the bridge hands queued token deltas to Dynamo
one by one (Dynamo's reasoning parser counts ``reasoning_tokens`` by output; docs/reference/worker.md#parsers).
The worker's choice (merging off with a reasoning parser) is compared with native end to end by
``test_parsers_differential.py`` (``reasoning_tokens`` in the usage)."""

from __future__ import annotations

import pytest

from trio_sidecar.dynamo.bridge import _Stream
from trio_sidecar.dynamo.wakeup import Outbox

DELTAS = [{"token_ids": [1], "index": 0, "text": "<think>"}, {"token_ids": [2], "index": 0, "text": "</think>"}]


@pytest.mark.parametrize(("merge", "expected"), [(True, 1), (False, 2)])
def test_queued_deltas_are_merged_only_when_merging(merge, expected):
    outbox = Outbox()
    outbox.items.extend(dict(d) for d in DELTAS)
    stream = _Stream(None, outbox, "r", lambda: None, merge)  # type: ignore[arg-type]
    taken = []
    while outbox.items:
        taken.append(stream.take())
    assert len(taken) == expected
    assert [t for d in taken for t in d["token_ids"]] == [1, 2]
    assert "".join(d["text"] for d in taken) == "<think></think>"
