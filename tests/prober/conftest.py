"""Fixtures for the prober tests (helpers live in ``prober_fakes.py``)."""

from __future__ import annotations

import logging

import pytest
from prober_fakes import ScriptedVllm


@pytest.fixture
async def scripted_vllm(nursery):
    vllm = ScriptedVllm(nursery)
    await vllm.start()
    return vllm


@pytest.fixture
def caplog_prober(caplog):
    caplog.set_level(logging.DEBUG, logger="trio_sidecar.prober")
    return caplog
