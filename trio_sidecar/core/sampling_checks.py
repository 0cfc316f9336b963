"""vLLM 0.32's checks of the float sampling fields of a ``GenerateRequest``. PURE: no I/O, no Trio.

Measured on the real vLLM 0.32 gRPC server (the table is in docs/conformance.md, and
``tests/real_vllm/test_real_float_conformance.py`` asserts it against the server): every rejection is
``INVALID_ARGUMENT`` with the text below, the value printed as Rust prints an ``f32``. The checks run in
this order (the first failing one is reported); ``logit_bias`` values are never checked (NaN and ±inf
are accepted). A field at its proto3 default (``0``) means "unset" and is always accepted, except
``min_p`` and the penalties, whose accepted range contains 0 anyway.

The checks read the message itself, so they see what vLLM sees: the ``f32`` the value was rounded to
(``1e39`` is ``inf`` there). The sidecar runs them on the request it built, the mock on the request it
received.
"""

from __future__ import annotations

import math
import struct
from decimal import Decimal

from .._proto.vllm import inference_pb2

__all__ = ["format_f32", "sampling_error"]


def _to_f32(value: float) -> float:
    """``value`` rounded to the nearest f32 (to ±inf beyond its range, as a Rust ``as f32`` cast does)."""
    try:
        f32: float = struct.unpack("<f", struct.pack("<f", value))[0]
        return f32
    except OverflowError:
        return math.copysign(math.inf, value)


def format_f32(value: float) -> str:
    """Format a float32 the way Rust's ``Display`` does.

    Shortest round-trip digits, never an exponent: ``2`` not ``2.0``, ``1e38`` as 39 digits, ``1e-7`` as
    ``0.0000001``, ``NaN``, ``inf``, ``-inf``, ``-0``.
    """
    f32 = _to_f32(value)
    if math.isnan(f32):
        return "NaN"
    if math.isinf(f32):
        return "inf" if f32 > 0 else "-inf"
    for digits in range(1, 10):
        text = f"{f32:.{digits}g}"
        if _to_f32(float(text)) == f32:
            break
    return format(Decimal(text), "f")


def _in(value: float, low: float, high: float) -> bool:
    return low <= value <= high  # False for NaN


def sampling_error(request: inference_pb2.GenerateRequest) -> str | None:
    """vLLM's message for the first float sampling field it rejects, or ``None`` when it accepts them all."""
    if request.HasField("temperature"):
        value = request.temperature
        if not math.isfinite(value):
            return f"temperature must be a finite number, got {format_f32(value)}"
        if not _in(value, 0.0, 2.0):
            return f"temperature must be in [0, 2], got {format_f32(value)}"
    value = request.sampling.top_p
    if value != 0.0 and not 0.0 < value <= 1.0:
        return f"top_p must be in (0, 1], got {format_f32(value)}"
    value = request.sampling.min_p
    if not _in(value, 0.0, 1.0):
        return f"min_p must be in [0, 1], got {format_f32(value)}"
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(request.decoding, name)
        if not _in(value, -2.0, 2.0):
            return f"{name} must be in [-2, 2], got {format_f32(value)}"
    value = request.decoding.repetition_penalty
    if not math.isfinite(value):
        return f"repetition_penalty must be a finite number, got {format_f32(value)}"
    if value != 0.0 and not value > 0.0:
        return f"repetition_penalty must be in (0, inf), got {format_f32(value)}"
    return None
