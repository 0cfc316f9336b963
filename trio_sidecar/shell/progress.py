"""Startup progress: failed attempts and their last cause, for the "still waiting" lines of ``run``.

The connect loop (:mod:`.pool`) and the readiness wait (:mod:`.discovery`) call :func:`note_failure` for
every failed attempt. When a caller tracks a phase (``with tracking(StartupProgress()) as p:``), the calls
made in that task and in the tasks it starts land in ``p`` (a context variable: Trio tasks inherit their
parent's context); otherwise they are no-ops, so the embedded API pays nothing.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import attrs

from .diagnostics import short_cause

__all__ = ["StartupProgress", "note_failure", "tracking"]


@attrs.define
class StartupProgress:
    """Failed attempts so far and the last cause (a short label such as ``connection refused``)."""

    attempts: int = 0
    last_cause: str | None = None
    last_detail: str | None = None

    def failed(self, cause: str) -> None:
        self.attempts += 1
        self.last_detail = cause
        self.last_cause = short_cause(cause)


_CURRENT: contextvars.ContextVar[StartupProgress | None] = contextvars.ContextVar(
    "trio_sidecar_startup_progress", default=None
)


def note_failure(cause: str) -> None:
    """Record one failed attempt in the phase being tracked, if any."""
    progress = _CURRENT.get()
    if progress is not None:
        progress.failed(cause)


@contextmanager
def tracking(progress: StartupProgress) -> Iterator[StartupProgress]:
    """Collect :func:`note_failure` calls of this task (and of tasks started inside) into ``progress``."""
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
