"""Unit tests of the pure core (no sockets, no Trio): table-driven, plus hypothesis properties.

Hypothesis profiles: ``quick`` (default: hypothesis' usual 100 examples, no per-example deadline, derandomized
so CI is reproducible) and ``long`` (``HYPOTHESIS_PROFILE=long``: 10,000 examples per property, for fuzz
runs). Hypothesis settings are process-global, so loading a profile here also applies to the other
folders' hypothesis tests in the same session; ``quick`` keeps their example counts unchanged and only
drops the per-example deadline, which is flaky on a loaded 2-core machine.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "quick", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("long", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))
