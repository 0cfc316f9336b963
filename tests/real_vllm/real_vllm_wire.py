"""Schema-free protobuf decoding, to pin raw field numbers independently of our generated code (docs/reference/real-vllm.md#readiness, docs/reference/real-vllm.md#control)."""

from __future__ import annotations

Fields = dict[int, list[object]]


class RawMessage:
    """Bytes in, bytes out: stands in for a generated message class on a channel call."""

    def __init__(self, data: bytes = b""):
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        return self.data

    @classmethod
    def FromString(cls, data: bytes) -> RawMessage:  # noqa: N802 - protobuf's name
        return cls(bytes(data))

    def ParseFromString(self, data: bytes) -> int:  # noqa: N802 - protobuf's name
        self.data = bytes(data)
        return len(data)

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        return len(self.data)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def decode(buf: bytes) -> Fields:
    """Top-level fields: varints as int, length-delimited as bytes, fixed32/64 as raw bytes."""
    out: Fields = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = _varint(buf, i)
        elif wire_type == 2:
            length, i = _varint(buf, i)
            value, i = buf[i : i + length], i + length
        elif wire_type == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire_type == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported wire type {wire_type} for field {number}")
        out.setdefault(number, []).append(value)
    return out


def scalar_fields(buf: bytes) -> dict[int, object]:
    """Like decode() but one value per field (the last, as protobuf merges scalars)."""
    return {k: v[-1] for k, v in decode(buf).items()}
