"""Fixtures for the sidecar engine tests.

Rules (as trio-websocket's tests): every server binds 127.0.0.1 on port 0 and is started with
``nursery.start``; bounds in assertions are the spec's functional bounds; nothing outlives a test.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sidecar_fakes import FakeVllm

from trio_sidecar.config import SidecarConfig

#: The mock's fast engine args (mock-server.md §17, "admitting args").
FAST_ENGINE_ARGS: dict[str, Any] = {
    "block_size": 4,
    "enable_prefix_caching": False,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "speedup_ratio": 0.0,
}


def sidecar_config(endpoint: str, **overrides: Any) -> SidecarConfig:
    """Test defaults: 2 connections, short timeouts, no prober (tests that need it turn it on)."""
    fields: dict[str, Any] = dict(
        grpc_endpoint=endpoint,
        grpc_connections=2,
        connect_attempt_timeout=2.0,
        retry_interval=0.05,
        startup_deadline=5.0,
        health_prober=False,
        abort_timeout=2.0,
    )
    fields.update(overrides)
    return SidecarConfig(**fields)


@pytest.fixture
async def fake(nursery) -> FakeVllm:
    """A started scripted fake vLLM (defaults of §23's preamble)."""
    return await nursery.start(FakeVllm().serve)


@pytest.fixture
def caplog_sidecar(caplog):
    caplog.set_level(logging.DEBUG, logger="trio_sidecar")
    return caplog
