"""JSON <-> google.protobuf.Struct (docs/reference/sidecar.md#json-and-protobuf-struct)."""

from __future__ import annotations

import math

import pytest
from google.protobuf import struct_pb2

from trio_sidecar.core.errors import InvalidArgument, ProtocolError
from trio_sidecar.core.jsonstruct import json_to_struct, struct_to_json

REFERENCE = {"string": "s", "bool": True, "number": 42, "null": None, "list": [1, "two", False, {"nested": 3.5}]}


def test_reference_round_trip_is_exact() -> None:
    back = struct_to_json(json_to_struct(REFERENCE))
    assert back == REFERENCE
    assert type(back["number"]) is int and type(back["list"][3]["nested"]) is float
    assert type(back["bool"]) is bool


def test_encoding_kinds() -> None:
    s = json_to_struct({"n": None, "b": False, "i": 3, "f": 2.5, "s": "x", "l": [], "o": {}})
    kinds = {k: v.WhichOneof("kind") for k, v in s.fields.items()}
    assert kinds == {
        "n": "null_value",
        "b": "bool_value",
        "i": "number_value",
        "f": "number_value",
        "s": "string_value",
        "l": "list_value",
        "o": "struct_value",
    }
    assert struct_to_json(s) == {"n": None, "b": False, "i": 3, "f": 2.5, "s": "x", "l": [], "o": {}}


@pytest.mark.parametrize("value", [2**53, -(2**53), 0, 1])
def test_exact_integers_accepted(value: int) -> None:
    assert struct_to_json(json_to_struct({"v": value})) == {"v": value}


@pytest.mark.parametrize("value", [2**53 + 1, -(2**53) - 1, 2**64])
def test_inexact_integers_rejected(value: int) -> None:
    with pytest.raises(InvalidArgument) as info:
        json_to_struct({"a": [{"v": value}]})
    assert str(info.value) == f"kv_transfer_params integer {value} cannot be represented exactly by protobuf Struct"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_request_numbers_rejected(value: float) -> None:
    with pytest.raises(InvalidArgument) as info:
        json_to_struct({"v": value})
    assert str(info.value) == f"kv_transfer_params number {value} cannot be represented by protobuf Struct"


@pytest.mark.parametrize("value", [[], "x", 1, None, True])
def test_top_level_must_be_an_object(value: object) -> None:
    with pytest.raises(InvalidArgument, match="^kv_transfer_params must be a JSON object$"):
        json_to_struct(value)


def test_non_json_values_rejected() -> None:
    with pytest.raises(InvalidArgument):
        json_to_struct({"v": object()})
    with pytest.raises(InvalidArgument):
        json_to_struct({1: "int key"})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_response_numbers_are_protocol_errors(value: float) -> None:
    s = struct_pb2.Struct()
    s.fields["deep"].list_value.values.add().number_value = value
    with pytest.raises(ProtocolError) as info:
        struct_to_json(s)
    assert str(info.value) == "invalid vLLM gRPC response: kv_transfer_params contains NaN or infinity"


@pytest.mark.parametrize(
    ("number", "expected", "kind"),
    [
        (5600.0, 5600, int),
        (-0.0, 0, int),
        (2.0**53, 2**53, int),
        (2.0**53 + 2, 2.0**53 + 2, float),
        (1e300, 1e300, float),
        (0.5, 0.5, float),
    ],
)
def test_whole_doubles_come_back_as_ints(number: float, expected: object, kind: type) -> None:
    s = struct_pb2.Struct()
    s.fields["v"].number_value = number
    value = struct_to_json(s)["v"]
    assert value == expected and type(value) is kind
    if number == 0:
        assert math.copysign(1, value) == 1


def test_unset_kind_is_none() -> None:
    s = struct_pb2.Struct()
    s.fields["v"].SetInParent()
    assert struct_to_json(s) == {"v": None}
