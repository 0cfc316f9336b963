"""SIGINT/SIGTERM for the CLIs outside Trio's own signal handling.

Three stages, so that a signal is honoured in every phase of a command's life:

1. From process start to the Trio run (imports, argument parsing): :func:`install_interrupt_handlers`
   makes both signals raise :class:`Interrupted`; the CLI's entry point turns that into one line and exit
   code 128 + the signal number (130, 143), never a traceback.
2. Just before ``trio.run``: :func:`hold_signals` only records them (raising inside Trio's scheduler would
   corrupt it); the command's first task takes them over with ``trio.open_signal_receiver`` and replays
   what :func:`held` returns.
3. After the Trio run the worker installs its own "exit 1 at once" handlers (``exit_on_late_signals``).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "SIGNALS",
    "Interrupted",
    "install_interrupt_handlers",
    "restore_handlers",
    "hold_signals",
    "held",
    "forget_held",
    "interrupted_code",
    "interrupted_exit",
]

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_held: list[int] = []


class Interrupted(BaseException):
    """SIGINT/SIGTERM before the command's Trio run took the signals over."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    # Also recorded: the exception can be raised inside code that swallows it (a ``__del__`` or a weakref
    # callback during an import, where Python only prints "Exception ignored"); stage 2 then replays it.
    _held.append(signum)
    raise Interrupted(signum)


def _quiet_unraisable(args: Any) -> None:
    # A swallowed Interrupted is recorded above and replayed, so Python's "Exception ignored in ..." traceback
    # for it is noise on the operator's terminal; anything else goes to the hook that was there before.
    if isinstance(args.exc_value, Interrupted):
        return
    _previous_unraisablehook(args)


_previous_unraisablehook: Callable[[Any], None] = sys.unraisablehook


def _hold(signum: int, _frame: object) -> None:
    _held.append(signum)


def install_interrupt_handlers() -> dict[int, Any]:
    """Stage 1. Returns the previous handlers (empty when not on the main thread, e.g. embedded use)."""
    previous: dict[int, Any] = {}
    try:
        for signum in SIGNALS:
            previous[signum] = signal.signal(signum, _raise_interrupted)
    except ValueError:  # signal only works in the main thread
        return {}
    global _previous_unraisablehook
    if sys.unraisablehook is not _quiet_unraisable:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _quiet_unraisable
    return previous


def restore_handlers(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`install_interrupt_handlers` replaced, unless someone changed them since
    (the worker's late-signal handlers must stay for the interpreter's exit)."""
    ours: tuple[Callable[..., Any], ...] = (_raise_interrupted, _hold)
    for signum, handler in previous.items():
        if signal.getsignal(signum) in ours:
            signal.signal(signum, handler)
    if previous and sys.unraisablehook is _quiet_unraisable:
        sys.unraisablehook = _previous_unraisablehook


def hold_signals() -> None:
    """Stage 2: record SIGINT/SIGTERM instead of raising (no-op off the main thread). A stage-1 signal whose
    :class:`Interrupted` was swallowed stays recorded, so the command's first task replays it."""
    try:
        for signum in SIGNALS:
            signal.signal(signum, _hold)
    except ValueError:
        pass


def forget_held() -> None:
    """The stage-1 signal was handled (its :class:`Interrupted` reached the entry point)."""
    _held.clear()


def held() -> list[int]:
    """The signals recorded by :func:`hold_signals` and not yet taken (the list is emptied)."""
    taken = list(_held)
    _held.clear()
    return taken


def interrupted_code(signum: int) -> int:
    """128 + the signal number, as shells report a process ended by that signal (130, 143)."""
    return 128 + int(signum)


def interrupted_exit(signum: int, where: str = "before serving") -> int:
    """Print the one-line notice for a signal that ended the command early; return its exit code."""
    from ._logging import notice

    code = interrupted_code(signum)
    notice(f"interrupted by {signal.Signals(signum).name} {where}; exiting with code {code}")
    return code
