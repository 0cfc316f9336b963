"""Wait, from Trio, until the services Dynamo's runtime connects to at startup accept TCP connections.

Why: Dynamo 1.6.1 builds its ``DistributedRuntime`` in a native call that keeps the GIL while it retries an
unreachable etcd (up to ``ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS``, 120 s by default). During that call no
Python code runs in the process — not the signal handlers, not the "still waiting" lines — so SIGINT and
SIGTERM would be ignored for two minutes. Checking reachability first keeps every wait on the Trio side,
where signals are honoured at once; the runtime is created only when its services answer.

The services and their settings are Dynamo's own: ``ETCD_ENDPOINTS`` (comma-separated URLs, default
``http://localhost:2379``) for the ``etcd`` discovery backend, and ``NATS_SERVER`` (default
``nats://localhost:4222``) when the request or event plane is ``nats``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import attrs
import trio

from ..core.config import WorkerOptions
from ..core.errors import SidecarError, format_duration
from ..shell.diagnostics import describe_exception, round_duration
from ..shell.progress import note_failure

__all__ = ["Prerequisite", "PrerequisiteUnreachable", "prerequisites", "wait_reachable"]

DEFAULT_ETCD = "http://localhost:2379"
DEFAULT_NATS = "nats://localhost:4222"
DEFAULT_ETCD_TIMEOUT = 120.0
ATTEMPT_TIMEOUT = 2.0
RETRY_INTERVAL = 1.0


class PrerequisiteUnreachable(SidecarError):
    """A service Dynamo's runtime needs did not accept connections in time (exit 1)."""


@attrs.frozen
class Prerequisite:
    name: str  # "etcd"
    setting: str  # the environment variable that names it
    urls: tuple[str, ...]
    addresses: tuple[tuple[str, int], ...]
    timeout: float
    hint: str


def _addresses(urls: Sequence[str], default_port: int) -> tuple[tuple[str, int], ...]:
    found = []
    for url in urls:
        parts = urlsplit(url if "://" in url else f"tcp://{url}")
        try:
            port = parts.port or default_port
        except ValueError:
            continue
        if parts.hostname:
            found.append((parts.hostname, port))
    return tuple(found)


def _timeout(environ: Mapping[str, str]) -> float:
    try:
        value = float(environ.get("ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS", DEFAULT_ETCD_TIMEOUT))
    except ValueError:
        return DEFAULT_ETCD_TIMEOUT
    return value if value > 0 and math.isfinite(value) else DEFAULT_ETCD_TIMEOUT


def prerequisites(options: WorkerOptions, environ: Mapping[str, str] = os.environ) -> list[Prerequisite]:
    """The services the runtime will connect to at startup, per the options and Dynamo's variables."""
    needed = []
    if options.discovery_backend == "etcd":
        urls = tuple(u.strip() for u in environ.get("ETCD_ENDPOINTS", DEFAULT_ETCD).split(",") if u.strip())
        needed.append(
            Prerequisite(
                "etcd",
                "ETCD_ENDPOINTS",
                urls,
                _addresses(urls, 2379),
                _timeout(environ),
                "start etcd, point ETCD_ENDPOINTS at it, or use --discovery-backend file on a single host",
            )
        )
    if options.request_plane == "nats" or options.event_plane == "nats":
        urls = tuple(u.strip() for u in environ.get("NATS_SERVER", DEFAULT_NATS).split(",") if u.strip())
        needed.append(
            Prerequisite(
                "NATS",
                "NATS_SERVER",
                urls,
                _addresses(urls, 4222),
                _timeout(environ),
                "start NATS, point NATS_SERVER at it, or use the tcp request plane and the zmq event plane",
            )
        )
    return [p for p in needed if p.addresses]


async def wait_reachable(prerequisite: Prerequisite) -> None:
    """Return once one of the prerequisite's addresses accepts a TCP connection.

    Every failed round is recorded with :func:`..progress.note_failure`.

    Raises:
        PrerequisiteUnreachable: none accepted a connection within ``prerequisite.timeout``.
    """
    start = trio.current_time()
    deadline = start + prerequisite.timeout
    cause = "no connection attempt finished"
    while True:
        for host, port in prerequisite.addresses:
            with trio.move_on_after(min(ATTEMPT_TIMEOUT, max(deadline - trio.current_time(), 0.01))):
                try:
                    stream = await trio.open_tcp_stream(host, port)
                except OSError as exc:
                    cause = describe_exception(exc)
                else:
                    await stream.aclose()
                    return
                continue
            cause = f"connecting to {host}:{port} timed out"
        note_failure(cause)
        now = trio.current_time()
        if now >= deadline:
            raise PrerequisiteUnreachable(
                f"{prerequisite.name} at {', '.join(prerequisite.urls)} ({prerequisite.setting}) is not reachable "
                f"after {format_duration(round_duration(now - start))}: {cause}"
            )
        await trio.sleep(min(RETRY_INTERVAL, deadline - now))
