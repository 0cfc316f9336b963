"""Disaggregated encode/prefill/decode emulation, wire level only (docs/reference/mock.md#prefill-and-decode-emulation). PURE: no I/O, no Trio.

The mock moves no KV: a prefill server answers with a vLLM-shaped ``kv_transfer_params`` handoff, and a
decode server checks that the handoff came back verbatim (the ``mocker_request_id`` sentinel proves the
sidecar kept it opaque) and then recomputes the prompt like an aggregated engine. An encode server (encoder
disaggregation) computes the prompt and its media, answers a ``STOP`` terminal without tokens whose
``ec_transfer_params`` name the request and its media, and takes no KV handoff.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import struct_pb2

from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.generation import RequestRejected

__all__ = [
    "HANDOFF_CHUNK_TOKENS",
    "RENDEZVOUS_FIELDS",
    "Role",
    "check_role",
    "classify_kv_transfer_params",
    "encode_terminal_params",
    "prefill_terminal_params",
]

RENDEZVOUS_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
# The prefill handoff lists fixed 64-token chunks, not the engine's block_size (upstream behaviour).
HANDOFF_CHUNK_TOKENS = 64


class Role(enum.Enum):
    """A request's wire role, and the server's ``--disaggregation-mode``."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"

    @classmethod
    def parse(cls, value: str) -> Role:
        """Parse a mode name; ``agg`` is an alias of ``aggregated``. Raises ValueError."""
        text = value.strip().lower()
        if text == "agg":
            return cls.AGGREGATED
        return cls(text)


def _invalid(message: str) -> RequestRejected:
    return RequestRejected(StatusCode.INVALID_ARGUMENT, message)


def _value(v: struct_pb2.Value) -> Any:
    """Decode one ``Struct`` value, keeping the JSON kind (bool stays bool, numbers stay float)."""
    kind = v.WhichOneof("kind")
    if kind == "bool_value":
        return v.bool_value
    if kind == "number_value":
        return v.number_value
    if kind == "string_value":
        return v.string_value
    if kind == "list_value":
        return [_value(x) for x in v.list_value.values]
    if kind == "struct_value":
        return {k: _value(x) for k, x in v.struct_value.fields.items()}
    return None  # null_value or unset


def _is_integral(v: Any) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v.is_integer()


def _is_port(v: Any) -> bool:
    if _is_integral(v):
        return 0 <= v <= 65535
    if isinstance(v, str):
        # Like Rust's `str::parse::<u16>`: ASCII digits with an optional leading '+', no whitespace.
        digits = v[1:] if v.startswith("+") else v
        return digits.isascii() and digits.isdigit() and int(digits) <= 65535
    return False


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and v != ""


def _check_decode(params: Mapping[str, Any]) -> None:
    checks = (
        ("remote_engine_id", _nonempty_str, "must be a non-empty string"),
        ("remote_host", _nonempty_str, "must be a non-empty string"),
        ("remote_port", _is_port, "must be a port number (0..65535) or a decimal string"),
        (
            "remote_block_ids",
            lambda v: isinstance(v, list) and all(_is_integral(x) and x >= 0 for x in v),
            "must be a list of non-negative integers",
        ),
        ("mocker_request_id", _nonempty_str, "must be a non-empty string"),
    )
    for key, ok, requirement in checks:
        if key not in params or not ok(params[key]):
            raise _invalid(f"decode KV transfer field '{key}' {requirement}")


def classify_kv_transfer_params(kv_transfer_params: struct_pb2.Struct | None) -> Role:
    """Classify ``KVCacheParameters.kv_transfer_params`` (docs/reference/mock.md#prefill-and-decode-emulation); ``None`` means the field is absent.

    Raises:
        RequestRejected: ``INVALID_ARGUMENT`` with the message (docs/reference/mock.md#prefill-and-decode-emulation) for malformed parameters.
    """
    if kv_transfer_params is None:
        return Role.AGGREGATED
    params = {k: _value(v) for k, v in kv_transfer_params.fields.items()}
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if flag in params and not isinstance(params[flag], bool):
            raise _invalid(f"KV transfer field '{flag}' must be a boolean")
    remote_decode = params.get("do_remote_decode") is True
    remote_prefill = params.get("do_remote_prefill") is True
    if remote_decode and remote_prefill:
        raise _invalid("KV transfer parameters cannot set both do_remote_decode and do_remote_prefill")
    if remote_decode:
        for key in RENDEZVOUS_FIELDS:
            if key in params:
                raise _invalid(f"prefill KV transfer parameters must not include '{key}'")
        return Role.PREFILL
    if remote_prefill:
        _check_decode(params)
        return Role.DECODE
    if any(key in params for key in RENDEZVOUS_FIELDS):
        raise _invalid("KV rendezvous fields require do_remote_prefill=true")
    return Role.AGGREGATED


_ROLE_MISMATCH = {
    Role.AGGREGATED: "aggregated mock server received disaggregated KV transfer parameters",
    Role.PREFILL: "prefill mock server requires do_remote_decode=true",
    Role.DECODE: "decode mock server requires a prefill KV transfer payload",
    Role.ENCODE: "encode mock server received KV transfer parameters",
}
ENCODE_NEEDS_MEDIA = "encode mock server requires media"


def check_role(server_mode: Role, request_role: Role) -> None:
    """Enforce docs/reference/mock.md#prefill-and-decode-emulation: the request's role must equal the server's mode.

    Raises:
        RequestRejected: ``FAILED_PRECONDITION`` with the server mode's message.
    """
    expected = Role.AGGREGATED if server_mode is Role.ENCODE else server_mode  # an encoder takes no KV handoff
    if request_role is not expected:
        raise RequestRejected(StatusCode.FAILED_PRECONDITION, _ROLE_MISMATCH[server_mode])


def prefill_terminal_params(request_uuid: str, request_id: str, prompt_len: int) -> struct_pb2.Struct:
    """The prefill terminal's ``finish_info.kv_transfer_params`` (docs/reference/mock.md#prefill-and-decode-emulation)."""
    chunks = -(-prompt_len // HANDOFF_CHUNK_TOKENS)
    params = struct_pb2.Struct()
    params.update(
        {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": f"mocker-prefill-{request_uuid}",
            "remote_host": "127.0.0.1",
            "remote_port": 0,
            "remote_block_ids": list(range(chunks)),
            "mocker_request_id": request_id,
        }
    )
    return params


def encode_terminal_params(request_id: str, media_identifiers: list[str]) -> struct_pb2.Struct:
    """The encode terminal's ``finish_info.ec_transfer_params`` (docs/reference/mock.md#prefill-and-decode-emulation)."""
    params = struct_pb2.Struct()
    params.update({"mocker_encode_request_id": request_id, "mm_hashes": list(media_identifiers)})
    return params
