"""Log output for the CLIs: rich for humans on a terminal, plain one-line records for machines.

Every line carries a UTC ISO-8601 timestamp ending in ``Z``, as Dynamo's own (Rust ``tracing``) lines do,
so the two interleave in order whatever ``TZ`` says: ``2026-12-01T20:32:08.123456Z  INFO name: message``.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

__all__ = ["UtcFormatter", "configure_logging", "emit", "utc_timestamp"]


def utc_timestamp(created: float) -> str:
    """``created`` (seconds since the epoch) as ``YYYY-MM-DDTHH:MM:SS.ffffffZ``."""
    return datetime.fromtimestamp(created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class UtcFormatter(logging.Formatter):
    """``{UTC timestamp} {LEVEL:>5} {logger}: {message}``, Dynamo's column layout."""

    def format(self, record: logging.LogRecord) -> str:
        level = "WARN" if record.levelname == "WARNING" else record.levelname
        text = f"{utc_timestamp(record.created)} {level:>5} {record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[0] is not None:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _rich_time(moment: datetime) -> Any:
    # RichHandler passes a naive local datetime; astimezone() interprets it as local time.
    from rich.text import Text

    return Text(moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z")


def configure_logging(level: str, *, logger: str = "trio_sidecar") -> None:
    """Attach one stderr handler to ``logger`` (idempotent) and set its level.

    On a TTY the handler is rich's (colours, aligned columns, UTC time); otherwise a plain
    ``StreamHandler`` with :class:`UtcFormatter`, so that log collectors and tests see whole, unwrapped
    lines.
    """
    target = logging.getLogger(logger)
    target.setLevel(getattr(logging, level.upper(), logging.INFO))
    if any(getattr(h, "_trio_sidecar", False) for h in target.handlers):
        return
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(
            console=Console(stderr=True),
            show_path=False,
            rich_tracebacks=False,
            log_time_format=_rich_time,
            omit_repeated_times=False,
        )
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(UtcFormatter())
    setattr(handler, "_trio_sidecar", True)  # noqa: B010 - marks the handler as this module's
    target.addHandler(handler)


def emit(text: str, *, name: str = "trio_sidecar", level: int = logging.INFO) -> None:
    """Write one timestamped line to stderr whatever the configured log level (banners, exit notices).

    Plain text in the :class:`UtcFormatter` layout; written with a single ``write`` so that it is safe to
    call from a signal-triggered path too.
    """
    record = logging.LogRecord(name, level, __file__, 0, text, None, None)
    sys.stderr.write(UtcFormatter().format(record) + "\n")
    sys.stderr.flush()


def print_error(message: str, *, hint: str | None = None) -> None:
    """The CLIs' one-line failure report: ``error: {message}`` (and ``; hint: {hint}``) on stderr.

    Bold red on a terminal; plain text otherwise (rich markup in the message is never interpreted).
    """
    from rich.console import Console

    text = f"error: {message}" + (f"; hint: {hint}" if hint else "")
    Console(file=sys.stderr, soft_wrap=True).print(text, markup=False, highlight=False, style="bold red")
