"""Fixtures for the conformance suite against the real vLLM 0.32 gRPC server on CPU.

Every test in this folder is marked ``real_vllm`` and skipped unless ``scripts/real-vllm.sh`` has been run
and its two variables are exported (``TRIO_SIDECAR_REAL_VLLM_PYTHON``, ``TRIO_SIDECAR_REAL_VLLM_MODEL``).

Server lifetimes: starting vLLM costs 25-45 s on an idle 2-core machine (up to 3 minutes when other test
suites share the cores), so one Python-supervised server is shared by the whole folder (``real_server``,
session scope). Tests on it never break it, except the SIGTERM test, which uses it through
``ending_real_server`` and is ordered last. ``test_real_variant_server.py`` starts its own Rust-managed server
(LoRA and KV events on), whose last test kills its engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from real_vllm_server import (
    ENV_MODEL,
    ENV_PYTHON,
    TIMINGS,
    AttachedServer,
    RealVllmServer,
    env_from_environ,
    start_ready_server,
)

# Developer iteration only: reuse a running server ("PORT:LOG_PATH") instead of starting one.
ENV_ATTACH = "TRIO_SIDECAR_REAL_VLLM_ATTACH"

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # Tests that end the shared server run after every other test of the session.
    ending = [item for item in items if "ending_real_server" in getattr(item, "fixturenames", ())]
    if ending:
        items[:] = [item for item in items if item not in ending] + ending
    skip = None
    if env_from_environ() is None:
        skip = pytest.mark.skip(reason=f"{ENV_PYTHON} / {ENV_MODEL} not set (run scripts/real-vllm.sh)")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.real_vllm)
            if skip is not None:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("real vLLM timings")
        for what, seconds in TIMINGS:
            terminalreporter.write_line(f"{what}: {seconds:.1f} s")


def _start(launch: str, *, warm_up: bool = True) -> RealVllmServer:
    env = env_from_environ()
    assert env is not None
    server = start_ready_server(env, launch=launch, warm_up=warm_up)
    TIMINGS.append((f"{launch} launch: start -> SERVING", server.ready_after_s or 0.0))
    if warm_up:
        TIMINGS.append((f"{launch} launch: start -> warmed up", time.monotonic() - server.started_at))
    return server


def _stop(server: RealVllmServer, label: str) -> None:
    try:
        already_exited = server.exited()
        took = server.stop()
        if not already_exited:
            TIMINGS.append((f"{label}: SIGTERM -> main process exited", took))
        assert not server.leftovers(), f"vLLM processes still running after stop: {server.leftovers()}"
    finally:
        server.cleanup_files()


@pytest.fixture(scope="session")
def real_server():
    """The shared, warmed-up ``vllm serve`` (Python-supervised) server on 127.0.0.1."""
    attach = os.environ.get(ENV_ATTACH)
    if attach:
        yield AttachedServer(env_from_environ(), attach)
        return
    server = _start("python")
    yield server
    _stop(server, "shared server")


@pytest.fixture
def ending_real_server(real_server):
    """The shared server, for a test that stops it (such tests are ordered last; saves a server start)."""
    if isinstance(real_server, AttachedServer):
        pytest.skip("an attached server is never stopped by the tests")
    return real_server
