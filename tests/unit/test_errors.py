"""Error taxonomy (docs/reference/sidecar.md#errors) and Rust-style duration formatting (docs/reference/sidecar.md#duration-format)."""

from __future__ import annotations

import copy
import pickle

import pytest

from trio_sidecar.core.errors import (
    CannotConnect,
    ConnectionTimeout,
    EngineShutdown,
    ErrorKind,
    InvalidArgument,
    ProtocolError,
    RequestCancelled,
    SidecarError,
    UnknownError,
    format_duration,
    status_to_error,
)
from trio_sidecar.core.status import StatusCode

STATUS_TABLE = [
    (StatusCode.OK, ErrorKind.UNKNOWN, "Ok"),
    (StatusCode.CANCELLED, ErrorKind.CANCELLED, "Cancelled"),
    (StatusCode.UNKNOWN, ErrorKind.UNKNOWN, "Unknown"),
    (StatusCode.INVALID_ARGUMENT, ErrorKind.INVALID_ARGUMENT, "InvalidArgument"),
    (StatusCode.DEADLINE_EXCEEDED, ErrorKind.CONNECTION_TIMEOUT, "DeadlineExceeded"),
    (StatusCode.NOT_FOUND, ErrorKind.INVALID_ARGUMENT, "NotFound"),
    (StatusCode.ALREADY_EXISTS, ErrorKind.INVALID_ARGUMENT, "AlreadyExists"),
    (StatusCode.PERMISSION_DENIED, ErrorKind.UNKNOWN, "PermissionDenied"),
    (StatusCode.RESOURCE_EXHAUSTED, ErrorKind.UNKNOWN, "ResourceExhausted"),
    (StatusCode.FAILED_PRECONDITION, ErrorKind.INVALID_ARGUMENT, "FailedPrecondition"),
    (StatusCode.ABORTED, ErrorKind.UNKNOWN, "Aborted"),
    (StatusCode.OUT_OF_RANGE, ErrorKind.INVALID_ARGUMENT, "OutOfRange"),
    (StatusCode.UNIMPLEMENTED, ErrorKind.UNKNOWN, "Unimplemented"),
    (StatusCode.INTERNAL, ErrorKind.UNKNOWN, "Internal"),
    (StatusCode.UNAVAILABLE, ErrorKind.CANNOT_CONNECT, "Unavailable"),
    (StatusCode.DATA_LOSS, ErrorKind.UNKNOWN, "DataLoss"),
    (StatusCode.UNAUTHENTICATED, ErrorKind.UNKNOWN, "Unauthenticated"),
]


def test_status_table_covers_every_code() -> None:
    assert {row[0] for row in STATUS_TABLE} == set(StatusCode)


@pytest.mark.parametrize(("code", "kind", "name"), STATUS_TABLE)
def test_status_to_error_maps_every_code(code: StatusCode, kind: ErrorKind, name: str) -> None:
    err = status_to_error("GenerateStream", code, "rejected by fake vLLM")
    assert isinstance(err, SidecarError)
    assert err.kind is kind
    assert str(err) == err.message == f"GenerateStream: rejected by fake vLLM ({name})"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (StatusCode.UNAVAILABLE, CannotConnect),
        (StatusCode.DEADLINE_EXCEEDED, ConnectionTimeout),
        (StatusCode.CANCELLED, RequestCancelled),
        (StatusCode.INTERNAL, UnknownError),
    ],
)
def test_status_to_error_class(code: StatusCode, cls: type) -> None:
    assert type(status_to_error("GetModelInfo", code, "m")) is cls


def test_status_to_error_does_not_use_the_protocol_prefix() -> None:
    err = status_to_error("GetServerInfo", StatusCode.INTERNAL, "boom")
    assert not isinstance(err, ProtocolError)
    assert str(err) == "GetServerInfo: boom (Internal)"


def test_protocol_error_prefix_and_detail() -> None:
    err = ProtocolError("GenerateStream ended before a terminal response")
    assert str(err) == "invalid vLLM gRPC response: GenerateStream ended before a terminal response"
    assert err.detail == "GenerateStream ended before a terminal response"
    assert err.kind is ErrorKind.UNKNOWN


@pytest.mark.parametrize(
    ("cls", "kind"),
    [
        (InvalidArgument, ErrorKind.INVALID_ARGUMENT),
        (EngineShutdown, ErrorKind.ENGINE_SHUTDOWN),
        (CannotConnect, ErrorKind.CANNOT_CONNECT),
        (ConnectionTimeout, ErrorKind.CONNECTION_TIMEOUT),
        (RequestCancelled, ErrorKind.CANCELLED),
    ],
)
def test_kinds(cls: type[SidecarError], kind: ErrorKind) -> None:
    err = cls("vLLM sidecar is not started")
    assert err.kind is kind
    assert str(err) == "vLLM sidecar is not started"


@pytest.mark.parametrize("err", [InvalidArgument("a"), ProtocolError("b"), CannotConnect("c")])
def test_errors_survive_pickle_and_copy(err: SidecarError) -> None:
    for clone in (pickle.loads(pickle.dumps(err)), copy.copy(err)):
        assert type(clone) is type(err)
        assert clone.message == err.message
        assert str(clone) == str(err)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (5, "5s"),
        (1.5, "1.5s"),
        (5.002345, "5.002345s"),
        (1800, "1800s"),
        (1, "1s"),
        (0.1, "100ms"),
        (0.0125, "12.5ms"),
        (0.001, "1ms"),
        (0.05, "50ms"),
        (0.000001, "1µs"),
        (0.0000015, "1.5µs"),
        (0.000000003, "3ns"),
        (0, "0ns"),
        (2.000000001, "2.000000001s"),
    ],
)
def test_format_duration_matches_rust_debug(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_a_translated_status_keeps_its_code_and_message_through_pickle_and_copy() -> None:
    err = status_to_error("Health.Check", StatusCode.UNIMPLEMENTED, "no such method")
    for clone in (err, pickle.loads(pickle.dumps(err)), copy.copy(err)):
        assert (clone.grpc_code, clone.grpc_message) == (StatusCode.UNIMPLEMENTED, "no such method")
        assert str(clone) == "Health.Check: no such method (Unimplemented)"
    assert (InvalidArgument("a").grpc_code, InvalidArgument("a").grpc_message) == (None, "")
