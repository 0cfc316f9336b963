"""Fixtures for the sidecar engine tests.

Rules (as trio-websocket's tests): every server binds 127.0.0.1 on port 0 and is started with
``nursery.start``; bounds in assertions are the documented functional bounds; nothing outlives a test.
"""

from __future__ import annotations

import logging

import pytest
from sidecar_fakes import FakeVllm


@pytest.fixture
async def fake(nursery) -> FakeVllm:
    """A started scripted fake vLLM (the upstream test fake's defaults, see ``sidecar_fakes``)."""
    return await nursery.start(FakeVllm().serve)


@pytest.fixture
def caplog_sidecar(caplog):
    caplog.set_level(logging.DEBUG, logger="trio_sidecar")
    return caplog
