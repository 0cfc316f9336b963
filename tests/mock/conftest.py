"""Fixtures for the mock-server tests; helpers live in ``mock_helpers.py``."""

from __future__ import annotations

from typing import Any

import pytest
from mock_helpers import FAST_ARGS


@pytest.fixture
def fast_args() -> dict[str, Any]:
    """The upstream tests' admitting engine arguments (docs/reference/mock.md#in-process-api-and-test-hooks), as a fresh dict."""
    return dict(FAST_ARGS)
