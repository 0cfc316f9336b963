"""gRPC status codes (pure: no I/O, no Trio).

Shared by the transport (``trio_sidecar.transport``) and the error taxonomy (``trio_sidecar.core.errors``).
``rust_name`` is the CamelCase form Rust's tonic prints (``InvalidArgument``); upstream error texts embed
it, so messages such as ``GenerateStream: rejected (InvalidArgument)`` match the native sidecar's.
"""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @property
    def rust_name(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_"))

    @classmethod
    def from_wire(cls, value: int) -> StatusCode:
        """Map a received code; values outside the standard set are UNKNOWN (per the gRPC spec)."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN
