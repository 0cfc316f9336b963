"""What a bug report needs: ``trio-sidecar --version`` and ``trio-sidecar env`` (docs/reference/sidecar.md#version-and-environment).

``__version__`` in ``trio_sidecar/__init__.py`` is the one source of the version: ``pyproject.toml`` reads it
(``[tool.setuptools.dynamic]``), and so do the installed distribution's metadata and the mock's
``ServerInfo.engine_version``.

``env`` is the sidecar's counterpart of ``vllm collect-env``: one ``name: value`` line per fact, in a fixed
order, so a report can be pasted and compared line by line. Nothing here imports the Dynamo bindings, Trio or
the transport: versions are read from the installed distributions' metadata, so ``env`` works (and says
``not installed``) where the sidecar itself would not start.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from . import __version__

__all__ = [
    "VLLM_PROTOCOL",
    "DEPENDENCIES",
    "git_commit",
    "protocol_digest",
    "version_lines",
    "environment_lines",
    "print_report",
]

#: The vLLM wire protocol the sidecar and the mock speak (docs/reference/wire.md).
VLLM_PROTOCOL = "vllm.Inference + vllm.Control split gRPC services, vLLM 0.32/0.33 schema (vLLM >= 0.27.0)"

#: The distributions a report lists, in order: the runtime dependencies that shape behaviour on the wire
#: and towards Dynamo, then the optional ones.
DEPENDENCIES = (
    "trio",
    "purerpc",
    "h2",
    "hpack",
    "hyperframe",
    "protobuf",
    "trio-util",
    "attrs",
    "cattrs",
    "tokenizers",
    "ai-dynamo-runtime",
    "ai-dynamo",
    "opentelemetry-api",
)

_PACKAGE = Path(__file__).resolve().parent
_PROTOS = ("vllm/inference.proto", "vllm/control.proto")


def _distribution_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str | None:
    """The commit the package was built or installed from, when it can be known.

    A pip install from a VCS URL records it (``direct_url.json``); a checkout (an editable install, or
    ``PYTHONPATH``) is asked with ``git``, and ``-dirty`` is appended when its tracked files differ. ``None``
    for a wheel from an index.
    """
    try:
        direct = metadata.distribution("trio-sidecar").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        direct = None
    if direct:
        try:
            commit = json.loads(direct).get("vcs_info", {}).get("commit_id")
        except ValueError:
            commit = None
        if isinstance(commit, str) and commit:
            return commit
    checkout = _PACKAGE.parent
    if not (checkout / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def protocol_digest() -> str:
    """The first 12 hex digits of the SHA-256 of the shipped ``vllm`` .proto files: the exact wire revision."""
    digest = hashlib.sha256()
    for name in _PROTOS:
        digest.update((_PACKAGE / "protos" / name).read_bytes())
    return digest.hexdigest()[:12]


def version_lines() -> list[str]:
    """``--version``: ``trio-sidecar {version}`` (and `` (commit {sha})`` when known), then the versions that
    decide behaviour (Python, the transport, protobuf, the Dynamo bindings) and the vLLM protocol revision."""
    commit = git_commit()
    first = f"trio-sidecar {__version__}"
    if commit:
        first += f" (commit {commit[:12]}{'-dirty' if commit.endswith('-dirty') else ''})"
    stack = ", ".join(
        [f"Python {platform.python_version()}"]
        + [
            f"{name} {_distribution_version(name)}"
            for name in ("trio", "purerpc", "h2", "protobuf", "ai-dynamo-runtime")
        ]
    )
    return [first, stack, f"vLLM protocol: {_protocol()}"]


def _protocol() -> str:
    try:
        return f"{VLLM_PROTOCOL}; protos sha256 {protocol_digest()}"
    except OSError:  # a package without its .proto files
        return VLLM_PROTOCOL


def environment_lines() -> list[str]:
    """``trio-sidecar env``'s report, one ``name: value`` line each."""
    lines = [
        f"trio-sidecar: {__version__}",
        f"commit: {git_commit() or 'unknown (not installed from a git checkout or VCS URL)'}",
        f"vLLM protocol: {_protocol()}",
        f"Python: {platform.python_version()} ({platform.python_implementation()}) {sys.executable}",
        f"platform: {platform.platform()}",
    ]
    lines += [f"{name}: {_distribution_version(name)}" for name in DEPENDENCIES]
    return lines


def print_report(lines: Sequence[str]) -> None:
    """Print a report (``--version``, ``env``) to stdout. A reader that closed the pipe early
    (``trio-sidecar --version | head -n1``) is not an error: the rest is dropped, and stdout points at
    /dev/null so the interpreter's last flush cannot fail either."""
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
