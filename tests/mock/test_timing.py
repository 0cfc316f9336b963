"""Polynomial timing model (docs/reference/mock.md#timing-model, docs/reference/mock.md#scheduler) — pure."""

from __future__ import annotations

import pytest

from trio_sidecar.mock.timing import decode_ms, pass_seconds, prefill_ms


@pytest.mark.parametrize(("tokens", "ms"), [(128, 18.45), (1024, 32.49), (4096, 85.76), (8192, 169.14)])
def test_prefill_examples(tokens, ms):
    assert round(prefill_ms(tokens), 2) == ms


def test_prefill_of_nothing_is_free():
    assert prefill_ms(0) == 0.0


@pytest.mark.parametrize(("p", "ms"), [(0.0, 5.74), (0.25, 17.63), (0.5, 26.31), (1.0, 34.01)])
def test_decode_examples(p, ms):
    assert round(decode_ms(p), 2) == ms


def test_decode_is_floored_at_one_ms():
    assert decode_ms(3.0) == 1.0  # the parabola is negative there


def test_pass_seconds_combines_and_scales():
    # 1024 prefill tokens + decode at p = 0.25 (16 blocks x 64 tokens, 256 decode tokens).
    common = dict(prefill_tokens=1024, decode_tokens=256, has_decode=True, kv_capacity_tokens=1024)
    assert pass_seconds(**common, speedup_ratio=1.0) == pytest.approx((32.49 + 17.63) / 1000, abs=1e-5)
    assert pass_seconds(**common, speedup_ratio=10.0) == pytest.approx((32.49 + 17.63) / 10_000, abs=1e-6)
    assert pass_seconds(**common, speedup_ratio=2.0, decode_speedup_ratio=4.0) == pytest.approx(
        (32.49 / 2 + 17.63 / 8) / 1000, abs=1e-5
    )


def test_decode_term_only_with_decode_ready_requests():
    only_prefill = pass_seconds(
        prefill_tokens=128, decode_tokens=0, has_decode=False, kv_capacity_tokens=1024, speedup_ratio=1.0
    )
    assert only_prefill == pytest.approx(18.45 / 1000, abs=1e-5)
    only_decode = pass_seconds(
        prefill_tokens=0, decode_tokens=0, has_decode=True, kv_capacity_tokens=1024, speedup_ratio=1.0
    )
    assert only_decode == pytest.approx(5.74 / 1000, abs=1e-6)


def test_speedup_zero_never_sleeps():
    assert (
        pass_seconds(
            prefill_tokens=8192, decode_tokens=500, has_decode=True, kv_capacity_tokens=1024, speedup_ratio=0.0
        )
        == 0.0
    )
