"""Every private h2/hpack/hyperframe/purerpc access stays in the protocol modules of ``trio_sidecar/transport``.

The I/O layer (``_connection``, ``_client``, ``_server``, ...) talks to ``GrpcProtocol``'s surface only, so
the h2 pin (3.2.0) is that one module's concern. Checked statically on the sources: the private names the
libraries define or use (``_data_to_send``, ``_inbound_flow_control_window_manager``, ...) and the h2
connection object itself (``h2_connection``) must not appear as an attribute outside the protocol modules
(``_protocol.py`` and the modules it is built from: ``_events``, ``_h2``, ``_fast``, ``_decompress``), and
the libraries' internals must not be imported there.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import trio_sidecar.transport

TRANSPORT = pathlib.Path(trio_sidecar.transport.__file__).parent
PROTOCOL_MODULES = frozenset({"_protocol.py", "_events.py", "_h2.py", "_fast.py", "_decompress.py"})
LIBRARIES = ("h2", "hpack", "hyperframe", "purerpc")
# purerpc's public API the I/O layer may use: the configuration object and the generated services' metadata.
ALLOWED_IMPORTS = frozenset({"purerpc.grpclib.config", "purerpc.rpc"})
# Public names that still reach below the surface: h2's connection and purerpc's per-stream read buffers.
FORBIDDEN_ATTRIBUTES = frozenset({"h2_connection", "message_read_buffers"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _library_private_names() -> frozenset[str]:
    """Private attribute and method names the libraries define or use anywhere in their sources."""
    names: set[str] = set()
    for package in LIBRARIES:
        root = pathlib.Path(importlib.import_module(package).__file__).parent  # type: ignore[arg-type]
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and _private(node.attr):
                    names.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                    names.add(node.name)
    return frozenset(names)


def _own_names(trees: list[ast.Module]) -> frozenset[str]:
    """Names the I/O layer defines on its own objects (methods, ``self.x = ...``, ``__slots__``)."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                names.update(
                    c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
    return frozenset(names)


def violations(tree: ast.Module, forbidden: frozenset[str]) -> list[str]:
    """What in ``tree`` reaches below ``GrpcProtocol``'s surface, as ``line: text`` strings."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in forbidden or node.attr in FORBIDDEN_ATTRIBUTES):
            found.append(f"{node.lineno}: attribute {node.attr}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES and alias.name not in ALLOWED_IMPORTS:
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in LIBRARIES and node.module not in ALLOWED_IMPORTS:
                found.append(f"{node.lineno}: from {node.module} import ...")
    return found


def _io_layer() -> dict[str, ast.Module]:
    return {
        path.name: ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(TRANSPORT.glob("*.py"))
        if path.name not in PROTOCOL_MODULES
    }


@pytest.fixture(scope="module")
def forbidden() -> frozenset[str]:
    return _library_private_names() - _own_names(list(_io_layer().values()))


def test_only_the_protocol_module_touches_h2_hpack_and_purerpc_internals(forbidden: frozenset[str]) -> None:
    modules = _io_layer()
    assert {"_connection.py", "_client.py", "_server.py"} <= modules.keys()
    found = {name: violations(tree, forbidden) for name, tree in modules.items()}
    assert {name: lines for name, lines in found.items() if lines} == {}


@pytest.mark.parametrize(
    "source",
    [
        "h2conn = conn.protocol.h2_connection",
        "manager = self.protocol.h2_connection._inbound_flow_control_window_manager",
        "queued = len(h2conn._data_to_send)",
        "window._bytes_processed += length",
        "outbound = h2conn._stream_id_is_outbound(stream_id)",
        "pending = buffer._message_length",
        "import h2.exceptions",
        "from purerpc.grpclib.buffers import MessageReadBuffer",
    ],
)
def test_the_check_flags_an_access_below_the_surface(forbidden: frozenset[str], source: str) -> None:
    assert violations(ast.parse(source), forbidden)


def test_the_check_accepts_the_surface(forbidden: frozenset[str]) -> None:
    source = (
        "from purerpc.grpclib.config import GRPCConfiguration\n"
        "if conn.protocol.acknowledge(stream_id, length):\n"
        "    conn.protocol.send_trailers(stream_id, [])\n"
        "queued = self.protocol.output_size()\n"
    )
    assert violations(ast.parse(source), forbidden) == []
