"""Small helpers shared by the transport's client and server (and the rest of the package)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collapse_single_exception"]


@contextmanager
def collapse_single_exception() -> Iterator[None]:
    """Re-raise a lone exception out of a nursery's ExceptionGroup as itself, with its own context.

    Trio's strict exception groups wrap even a single failure; the project's policy (like
    trio-websocket's) is that one failure never reaches callers as an ExceptionGroup. Nested groups of one
    exception each are unwrapped too; a group with several exceptions is re-raised unchanged.

    The exception keeps its ``__cause__``, ``__context__`` and ``__suppress_context__`` as they were when
    it was raised inside the group (re-raising it here would otherwise make the group its context).
    """
    try:
        yield
    except BaseExceptionGroup as group:
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if isinstance(inner, BaseExceptionGroup):
            raise
        cause, context, suppress = inner.__cause__, inner.__context__, inner.__suppress_context__
        try:
            raise inner
        finally:
            inner.__cause__, inner.__context__, inner.__suppress_context__ = cause, context, suppress
            del inner, group
