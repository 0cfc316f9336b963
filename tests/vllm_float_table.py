"""vLLM 0.32's answers to bad float sampling values (measured on the real server; docs/conformance.md).

Shared by ``tests/unit/test_sampling_checks.py`` (the sidecar and the mock give these answers) and
``tests/real_vllm/test_real_float_conformance.py`` (the real server still gives them).
"""

from __future__ import annotations

NAN, INF = float("nan"), float("inf")
BIG = 1e38  # finite in f32
F32_OVERFLOW = 1e39  # beyond f32: vLLM sees inf

# (field, value, vLLM's message or None when it accepts the value)
TABLE: list[tuple[str, float, str | None]] = [
    ("temperature", NAN, "temperature must be a finite number, got NaN"),
    ("temperature", INF, "temperature must be a finite number, got inf"),
    ("temperature", -INF, "temperature must be a finite number, got -inf"),
    ("temperature", F32_OVERFLOW, "temperature must be a finite number, got inf"),
    ("temperature", -1.0, "temperature must be in [0, 2], got -1"),
    ("temperature", -0.5, "temperature must be in [0, 2], got -0.5"),
    ("temperature", 0.0, None),
    ("temperature", 1.5, None),
    ("temperature", 2.0, None),
    ("temperature", 2.0000001, None),  # rounds to 2 in f32
    ("temperature", 2.5, "temperature must be in [0, 2], got 2.5"),
    ("temperature", BIG, "temperature must be in [0, 2], got 100000000000000000000000000000000000000"),
    ("top_p", NAN, "top_p must be in (0, 1], got NaN"),
    ("top_p", INF, "top_p must be in (0, 1], got inf"),
    ("top_p", -INF, "top_p must be in (0, 1], got -inf"),
    ("top_p", -0.5, "top_p must be in (0, 1], got -0.5"),
    ("top_p", 0.0, None),  # proto3 default: unset
    ("top_p", 0.5, None),
    ("top_p", 1.0, None),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", -BIG, "top_p must be in (0, 1], got -100000000000000000000000000000000000000"),
    ("min_p", NAN, "min_p must be in [0, 1], got NaN"),
    ("min_p", INF, "min_p must be in [0, 1], got inf"),
    ("min_p", -INF, "min_p must be in [0, 1], got -inf"),
    ("min_p", -1.0, "min_p must be in [0, 1], got -1"),
    ("min_p", 0.0, None),
    ("min_p", 1.0, None),
    ("min_p", 2.0, "min_p must be in [0, 1], got 2"),
    ("presence_penalty", NAN, "presence_penalty must be in [-2, 2], got NaN"),
    ("presence_penalty", INF, "presence_penalty must be in [-2, 2], got inf"),
    ("presence_penalty", -INF, "presence_penalty must be in [-2, 2], got -inf"),
    ("presence_penalty", -2.0, None),
    ("presence_penalty", -1.0, None),
    ("presence_penalty", 2.0, None),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("presence_penalty", -100.0, "presence_penalty must be in [-2, 2], got -100"),
    ("frequency_penalty", NAN, "frequency_penalty must be in [-2, 2], got NaN"),
    ("frequency_penalty", INF, "frequency_penalty must be in [-2, 2], got inf"),
    ("frequency_penalty", -INF, "frequency_penalty must be in [-2, 2], got -inf"),
    ("frequency_penalty", -2.0, None),
    ("frequency_penalty", 2.0, None),
    ("frequency_penalty", 100.0, "frequency_penalty must be in [-2, 2], got 100"),
    ("repetition_penalty", NAN, "repetition_penalty must be a finite number, got NaN"),
    ("repetition_penalty", INF, "repetition_penalty must be a finite number, got inf"),
    ("repetition_penalty", -INF, "repetition_penalty must be a finite number, got -inf"),
    ("repetition_penalty", -1.0, "repetition_penalty must be in (0, inf), got -1"),
    (
        "repetition_penalty",
        -BIG,
        "repetition_penalty must be in (0, inf), got -100000000000000000000000000000000000000",
    ),
    ("repetition_penalty", 0.0, None),  # proto3 default: unset
    ("repetition_penalty", 0.5, None),
    ("repetition_penalty", 100.0, None),
    ("repetition_penalty", BIG, None),
]

# vLLM checks the fields in this order (measured with every pair of bad values): the first bad one is reported.
ORDER = ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"]
BAD = {
    "temperature": 5.0,
    "top_p": 5.0,
    "min_p": 5.0,
    "frequency_penalty": 5.0,
    "presence_penalty": 5.0,
    "repetition_penalty": -5.0,
}

# logit_bias values are never checked: each of these is accepted.
LOGIT_BIASES = [float("nan"), float("inf"), float("-inf"), -1e38, 1e38]
