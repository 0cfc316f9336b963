"""JSON values <-> ``google.protobuf.Struct`` (docs/reference/sidecar.md#json-and-protobuf-struct). PURE: no I/O, no Trio.

Struct numbers are doubles. Requests refuse what a double cannot carry exactly (integers beyond 2**53,
non-finite floats) rather than silently changing a KV-transfer payload; responses turn whole doubles back
into ints so ``remote_port`` and block ids keep their JSON shape (upstream ``json.rs``).
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2

from .errors import InvalidArgument, ProtocolError

__all__ = ["json_to_struct", "struct_to_json", "value_to_json", "int_text", "MAX_EXACT_INT"]

MAX_EXACT_INT = 2**53


def int_text(value: int) -> str:
    """The integer's digits, or its size when Python refuses to print it (beyond 4300 digits by default)."""
    try:
        return str(value)
    except ValueError:
        return f"<{value.bit_length()}-bit integer>"


def json_to_struct(value: Any, *, name: str = "kv_transfer_params") -> struct_pb2.Struct:
    """Encode a JSON object as a ``Struct``.

    Raises:
        InvalidArgument: not an object, an integer beyond ±2**53, or a non-finite float.
    """
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be a JSON object")
    struct = struct_pb2.Struct()
    _fill_struct(struct, value, name)
    return struct


def _fill_struct(struct: struct_pb2.Struct, obj: dict[Any, Any], name: str) -> None:
    for key, item in obj.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"{name} keys must be strings")
        _fill_value(struct.fields[key], item, name)


def _fill_value(target: struct_pb2.Value, value: Any, name: str) -> None:
    # bool before int: bool is an int subclass.
    if value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, int):
        if abs(value) > MAX_EXACT_INT:
            raise InvalidArgument(f"{name} integer {int_text(value)} cannot be represented exactly by protobuf Struct")
        target.number_value = float(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"{name} number {value} cannot be represented by protobuf Struct")
        target.number_value = value
    elif isinstance(value, dict):
        target.struct_value.SetInParent()  # an empty object is still an object
        _fill_struct(target.struct_value, value, name)
    elif isinstance(value, (list, tuple)):
        target.list_value.SetInParent()
        values = target.list_value.values
        for item in value:
            _fill_value(values.add(), item, name)
    else:
        raise InvalidArgument(f"{name} value of type {type(value).__name__} is not JSON")


def struct_to_json(struct: struct_pb2.Struct) -> dict[str, Any]:
    """Decode a ``Struct`` into a JSON object.

    Raises:
        ProtocolError: ``kv_transfer_params contains NaN or infinity``.
    """
    return {key: value_to_json(item) for key, item in struct.fields.items()}


def value_to_json(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise ProtocolError("kv_transfer_params contains NaN or infinity")
        if number.is_integer() and abs(number) <= MAX_EXACT_INT:
            return int(number)  # -0.0 -> 0
        return number
    if kind == "struct_value":
        return struct_to_json(value.struct_value)
    return [value_to_json(item) for item in value.list_value.values]
