"""vLLM gRPC endpoint normalization (docs/reference/sidecar.md#endpoint-normalization). PURE: no I/O, no Trio."""

from __future__ import annotations

import ipaddress
import re

import attrs

from .errors import InvalidArgument

__all__ = ["GrpcEndpoint", "parse_grpc_endpoint"]

# Characters a registered host name may hold (RFC 3986 unreserved + pct-encoded + sub-delims subset).
_HOST_RE = re.compile(r"^[A-Za-z0-9._~%!$&'()*+,;=-]+$")


@attrs.frozen
class GrpcEndpoint:
    """A normalized plaintext endpoint.

    ``canonical`` is ``http://<host>[:<port>]`` (IPv6 bracketed, port as given); ``host`` has no brackets;
    ``port`` is the connect port (80 when none was given).
    """

    canonical: str
    host: str
    port: int

    def __str__(self) -> str:
        return self.canonical

    @property
    def url_host(self) -> str:
        """The host as it appears in a URL (IPv6 bracketed)."""
        return f"[{self.host}]" if ":" in self.host else self.host


def parse_grpc_endpoint(raw: str, flag: str = "--grpc-endpoint") -> GrpcEndpoint:
    """Normalize ``raw`` as in docs/reference/sidecar.md#endpoint-normalization.

    Raises:
        InvalidArgument: with the exact texts of docs/reference/sidecar.md#endpoint-normalization (naming ``flag``).
    """
    text = raw.strip()
    if not text:
        raise InvalidArgument(
            f"`{flag}` is required and must specify a gRPC server address, such as `http://HOST:PORT`"
        )
    if "://" in text:
        scheme, rest = text.split("://", 1)
        lowered = scheme.lower()
        if lowered in ("grpc", "http"):
            pass
        elif lowered in ("grpcs", "https"):
            raise InvalidArgument(f"TLS endpoints are not supported by `{flag}`")
        else:
            raise InvalidArgument(f"unsupported endpoint scheme in `{flag}`: `{text}`")
    else:
        rest = text

    # Split the authority from whatever follows it (path, query, fragment).
    end = len(rest)
    for sep in "/?#":
        i = rest.find(sep)
        if i != -1:
            end = min(end, i)
    authority, tail = rest[:end], rest[end:]

    if "@" in authority:
        if not authority.rsplit("@", 1)[1]:
            raise InvalidArgument(f"`{flag}` must include a host")
        raise InvalidArgument(f"`{flag}` must not include user information")

    host, port_text = _split_authority(authority, flag)
    if not host:
        raise InvalidArgument(f"`{flag}` must include a host")

    if tail not in ("", "/"):
        raise InvalidArgument(f"`{flag}` must contain only a plaintext scheme and authority")

    port: int | None = None
    if port_text:
        if not port_text.isascii() or not port_text.isdigit():
            raise _parse_error(flag, "invalid port number")
        port = int(port_text)
        if port > 65535:
            raise _parse_error(flag, "invalid port number")

    if ":" in host:
        url_host = f"[{host}]"
    else:
        host = host.lower()
        url_host = host
    canonical = f"http://{url_host}" + (f":{port}" if port is not None else "")
    return GrpcEndpoint(canonical=canonical, host=host, port=80 if port is None else port)


def _parse_error(flag: str, err: str) -> InvalidArgument:
    return InvalidArgument(f"invalid gRPC endpoint for `{flag}`: {err}")


def _split_authority(authority: str, flag: str) -> tuple[str, str]:
    """Return ``(host without brackets, port text)``; raise the parse error for malformed input."""
    if authority.startswith("["):
        close = authority.find("]")
        if close == -1:
            raise _parse_error(flag, "invalid IPv6 address")
        host = authority[1:close]
        after = authority[close + 1 :]
        if after and not after.startswith(":"):
            raise _parse_error(flag, "invalid IPv6 address")
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise _parse_error(flag, "invalid IPv6 address") from None
        return host, after[1:]
    if authority.count(":") > 1:
        raise _parse_error(flag, "invalid IPv6 address")
    host, _, port_text = authority.partition(":")
    if host and not _HOST_RE.match(host):
        raise _parse_error(flag, "invalid domain character")
    return host, port_text
