"""Fixtures for the Dynamo end-to-end tests.

Real processes on 127.0.0.1: ``python -m dynamo.frontend`` and ``trio-sidecar run`` (or the native
``python -m dynamo.vllm.sidecar``) as subprocesses with file discovery in a per-module temporary directory
and a unique namespace, stopped by PID. The mock vLLM server runs *in this process* on a background thread
with its own ``trio.run`` (:class:`MockThread`), so tests can read its hooks (``active_request_count()``,
``recorded_requests``, metrics) while the frontend and sidecars talk to it over loopback. Deployments are
started once per module (the frontend alone takes a few seconds on a loaded 2-core machine).

Tests in this folder are marked ``dynamo``; the end-to-end ones skip only when the Dynamo packages are
absent (``scripts/install-dynamo.sh`` installs them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dynamo_harness import Deployment, make_tiny_model, require_dynamo


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers")
    return make_tiny_model(tmp_path_factory.getbasetemp() / "tiny-model")


@pytest.fixture(scope="module")
def deployment_factory(tmp_path_factory, tiny_model) -> Iterator[Callable[[], Deployment]]:
    require_dynamo()
    created: list[Deployment] = []

    def make() -> Deployment:
        dep = Deployment(tmp_path_factory.mktemp("dynamo"), tiny_model)
        created.append(dep)
        return dep

    try:
        yield make
    finally:
        for dep in created:
            dep.close()
