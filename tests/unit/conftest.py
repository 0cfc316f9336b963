"""Unit tests of the pure core (no sockets, no Trio): table-driven, plus hypothesis properties.

Hypothesis profiles: ``quick`` (default, small) and ``long`` (``HYPOTHESIS_PROFILE=long``, >= 10,000
examples per property, for fuzz runs).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "quick", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))
