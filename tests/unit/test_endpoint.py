"""Endpoint normalization (docs/reference/sidecar.md#endpoint-normalization), every row of the table."""

from __future__ import annotations

import pytest

from trio_sidecar.core.endpoint import GrpcEndpoint, parse_grpc_endpoint
from trio_sidecar.core.errors import InvalidArgument

REQUIRED = "`--grpc-endpoint` is required and must specify a gRPC server address, such as `http://HOST:PORT`"
HOST = "`--grpc-endpoint` must include a host"
TLS = "TLS endpoints are not supported by `--grpc-endpoint`"
USERINFO = "`--grpc-endpoint` must not include user information"
AUTHORITY = "`--grpc-endpoint` must contain only a plaintext scheme and authority"
PARSE = "invalid gRPC endpoint for `--grpc-endpoint`: "


@pytest.mark.parametrize(
    ("raw", "canonical", "host", "port"),
    [
        ("127.0.0.1:50051", "http://127.0.0.1:50051", "127.0.0.1", 50051),
        (" grpc://localhost:50051 ", "http://localhost:50051", "localhost", 50051),
        ("http://[::1]:50051/", "http://[::1]:50051", "::1", 50051),
        ("http://127.0.0.1:50051", "http://127.0.0.1:50051", "127.0.0.1", 50051),
        ("grpc://server", "http://server", "server", 80),
        ("server", "http://server", "server", 80),
        ("[::1]:7", "http://[::1]:7", "::1", 7),
        ("HTTP://Server:9/", "http://server:9", "server", 9),
    ],
)
def test_accepted_forms(raw: str, canonical: str, host: str, port: int) -> None:
    assert parse_grpc_endpoint(raw) == GrpcEndpoint(canonical=canonical, host=host, port=port)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("", REQUIRED),
        (" ", REQUIRED),
        ("http://", HOST),
        ("grpc://", HOST),
        ("http://:50051", HOST),
        ("https://server", TLS),
        ("grpcs://server", TLS),
        ("other://server", "unsupported endpoint scheme in `--grpc-endpoint`: `other://server`"),
        ("http://user@server:1", USERINFO),
        ("http://user:pw@server:1", USERINFO),
        ("http://server:1/path", AUTHORITY),
        ("http://server:1?q=1", AUTHORITY),
        ("http://server:1#f", AUTHORITY),
        ("http://server:1/?q=1", AUTHORITY),
        ("http://server:port", PARSE),
        ("http://server:70000", PARSE),
        ("http://[::1", PARSE),
        ("http://[zz]:1", PARSE),
        ("http://ser ver:1", PARSE),
    ],
)
def test_rejected_forms(raw: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_grpc_endpoint(raw)
    if message == PARSE:
        assert str(info.value).startswith(PARSE)
    else:
        assert str(info.value) == message


def test_messages_name_the_flag() -> None:
    with pytest.raises(InvalidArgument, match="`--vllm-endpoint` must include a host"):
        parse_grpc_endpoint("http://", flag="--vllm-endpoint")


def test_url_host_brackets_ipv6() -> None:
    assert parse_grpc_endpoint("[::1]:1").url_host == "[::1]"
    assert parse_grpc_endpoint("h:1").url_host == "h"
