"""Small helpers shared by the transport's client and server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collapse_single_exception"]


@contextmanager
def collapse_single_exception() -> Iterator[None]:
    """Re-raise a lone exception out of a nursery's ExceptionGroup as itself.

    Trio's strict exception groups wrap even a single failure; the transport's policy (like
    trio-websocket's) is that one failure never reaches callers as an ExceptionGroup.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
            inner = group.exceptions[0]
            if not isinstance(inner, BaseExceptionGroup):
                raise inner from inner.__cause__
            group = inner
        raise
