"""The mock's "polynomial" timing model (docs/reference/mock.md#timing-model, docs/reference/mock.md#scheduler) — pure.

Times are modelled in milliseconds for one scheduler pass and then divided by the speedup ratios. The
scheduler sleeps for :func:`pass_seconds` only when ``speedup_ratio > 0``; a ratio of 0 means "no
sleeping at all", so this module returns 0.0 for it rather than dividing by zero.
"""

from __future__ import annotations

__all__ = ["decode_ms", "pass_seconds", "prefill_ms"]

# Fitted upstream (lib/mocker "polynomial" perf model); copied as published in the spec.
_PREFILL = (4.209989e-7, 1.518344e-2, 16.50142)
_DECODE = (-25.74, 54.01, 5.74)
_DECODE_FLOOR_MS = 1.0


def prefill_ms(new_tokens: int) -> float:
    """Modelled prefill time of one pass that computes ``new_tokens`` prompt tokens (0 → 0 ms).

    ``new_tokens`` is the sum of the prompt chunks computed in the pass (cached prefixes excluded).
    """
    if new_tokens <= 0:
        return 0.0
    a, b, c = _PREFILL
    t = float(new_tokens)
    return a * t * t + b * t + c


def decode_ms(kv_fraction: float) -> float:
    """Modelled decode time of one pass; ``kv_fraction`` is the decode-ready requests' total current
    sequence length divided by the rank's KV capacity in tokens (``num_gpu_blocks × block_size``).
    Floored at 1 ms."""
    a, b, c = _DECODE
    p = kv_fraction
    return max(_DECODE_FLOOR_MS, a * p * p + b * p + c)


def pass_seconds(
    *,
    prefill_tokens: int,
    decode_tokens: int,
    has_decode: bool,
    kv_capacity_tokens: int,
    speedup_ratio: float,
    decode_speedup_ratio: float = 1.0,
) -> float:
    """Wall time (seconds) to sleep for one scheduler pass.

    Args:
        prefill_tokens: prompt tokens computed in the pass (sum of chunks).
        decode_tokens: sum of the current sequence lengths of the pass's decode-ready requests.
        has_decode: whether the pass has decode-ready requests (the decode term applies only then).
        kv_capacity_tokens: ``num_gpu_blocks × block_size`` of the rank.
        speedup_ratio: divides all modelled time; 0 means no sleeping (returns 0.0).
        decode_speedup_ratio: extra divisor of the decode term.
    """
    if speedup_ratio <= 0:
        return 0.0
    total_ms = prefill_ms(prefill_tokens) / speedup_ratio
    if has_decode:
        fraction = decode_tokens / kv_capacity_tokens if kv_capacity_tokens > 0 else 0.0
        total_ms += decode_ms(fraction) / (speedup_ratio * decode_speedup_ratio)
    return total_ms / 1000.0
