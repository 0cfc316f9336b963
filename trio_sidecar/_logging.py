"""Log output for the CLIs: rich for humans on a terminal, plain one-line records for machines, and Dynamo's
own log stream when Dynamo's environment asks for JSON (docs/observability.md#logs).

Every plain line carries a UTC ISO-8601 timestamp ending in ``Z``, as Dynamo's own (Rust ``tracing``) lines
do, so the two interleave in order whatever ``TZ`` says: ``2026-12-01T20:32:08.123456Z  INFO name: message``.

``trio-sidecar run`` honours Dynamo's logging environment for its own records:

- ``DYN_LOGGING_JSONL=1`` (or ``DYN_LOGGING_CONSOLE_FORMAT=jsonl``): every record, banner and error line is
  handed to Dynamo's logger (``dynamo._core.log_message``, what ``dynamo.runtime.logging.LogHandler`` uses),
  so stderr is one stream of Dynamo's JSON lines with Dynamo's fields (``time``, ``level``, ``target``,
  ``message``, ``log.file``, ``log.line``, ``log.target``; the logger name is ``log.target``).
- ``DYN_LOG`` sets the sidecar's level when neither ``--log-level`` nor ``TRIO_SIDECAR_LOG_LEVEL`` does: its
  bare directive (``DYN_LOG=debug``), or a ``trio_sidecar[.module]=level`` directive for the sidecar's
  loggers, as Rust's ``EnvFilter`` reads it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "UtcFormatter",
    "DynamoLogHandler",
    "configure_logging",
    "dyn_log_levels",
    "dynamo_json_requested",
    "emit",
    "notice",
    "print_error",
    "rich_wanted",
    "use_dynamo_logging",
    "utc_timestamp",
]

#: Python's level for each Rust ``tracing`` level name ``DYN_LOG`` may use (``trace`` has no Python level).
_DYN_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 1,
}

_bridge: DynamoLogHandler | None = None


def dynamo_json_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Dynamo's environment selects JSON lines (``DYN_LOGGING_JSONL`` true, or the jsonl console format)."""
    env = os.environ if environ is None else environ
    jsonl = env.get("DYN_LOGGING_JSONL", "").strip().lower() in ("1", "true")
    return jsonl or env.get("DYN_LOGGING_CONSOLE_FORMAT", "").strip().lower() == "jsonl"


def dyn_log_levels(value: str, *, logger: str = "trio_sidecar") -> dict[str, int]:
    """The Python levels ``DYN_LOG`` gives ``logger`` and its children: ``{logger name: level}``.

    ``"debug"`` → ``{"trio_sidecar": DEBUG}``; ``"info,trio_sidecar.engine=debug"`` → ``{"trio_sidecar": INFO,
    "trio_sidecar.engine": DEBUG}``. Directives for other targets, and names no level has, are ignored.
    """
    bare: dict[str, int] = {}
    levels: dict[str, int] = {}
    for directive in value.split(","):
        target, _, level = directive.strip().rpartition("=")
        number = _DYN_LEVELS.get(level.strip().lower())
        if number is None:
            continue
        name = target.strip().replace("::", ".")
        if not name:
            bare[logger] = number
        elif name == logger or name.startswith(logger + "."):
            levels[name] = number
    return bare | levels  # a directive naming the target wins over the bare one, whatever the order


class DynamoLogHandler(logging.Handler):
    """Hands records to Dynamo's Rust logger, which formats and filters them like Dynamo's own lines.

    Unlike ``dynamo.runtime.logging.LogHandler``, the record's logger name (``trio_sidecar.engine``) is its
    target, so ``DYN_LOG=info,trio_sidecar=debug`` selects the sidecar's records.
    """

    def __init__(self) -> None:
        super().__init__()
        from dynamo._core import log_message  # the optional Dynamo extra

        self._log_message = log_message
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._log_message(
                record.levelname.lower(), self.format(record), record.name, record.pathname, record.lineno
            )
        except Exception:
            self.handleError(record)


def use_dynamo_logging(environ: Mapping[str, str] | None = None) -> bool:
    """Route this process's log lines to Dynamo's logger when Dynamo's environment asks for JSON lines.

    Called by ``trio-sidecar run`` before anything is printed. Returns whether the bridge is on (it stays off
    when the Dynamo bindings are not installed: the usage error about the missing extra is then plain text).
    """
    global _bridge
    if _bridge is None and dynamo_json_requested(environ):
        try:
            _bridge = DynamoLogHandler()
        except ImportError:
            return False
    return _bridge is not None


def rich_wanted() -> bool:
    """Rich output (colours, tables, live status) only on a terminal, and never into Dynamo's log stream."""
    return _bridge is None and sys.stderr.isatty()


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


def configure_logging(
    level: str | None, *, logger: str = "trio_sidecar", environ: Mapping[str, str] | None = None
) -> None:
    """Attach one stderr handler to ``logger`` (idempotent) and set its level.

    ``level`` (the command's ``--log-level``/``TRIO_SIDECAR_LOG_LEVEL``) wins; ``None`` takes the level from
    ``DYN_LOG`` (per logger, see :func:`dyn_log_levels`), else ``info``. With Dynamo's logger in use
    (:func:`use_dynamo_logging`) the handler is :class:`DynamoLogHandler`, and an explicit ``level`` is added to
    ``DYN_LOG`` as a ``trio_sidecar=level`` directive so that Dynamo's filter lets those records through too.
    On a TTY the handler is rich's (colours, aligned columns, UTC time); otherwise a plain
    ``StreamHandler`` with :class:`UtcFormatter`, so that log collectors and tests see whole, unwrapped
    lines.
    """
    env = os.environ if environ is None else environ
    target = logging.getLogger(logger)
    if level is not None:
        target.setLevel(getattr(logging, level.upper(), logging.INFO))
        if _bridge is not None and environ is None:
            # Read by Dynamo's logger when it first initializes (the runtime is not created yet).
            dyn_log = os.environ.get("DYN_LOG", "").strip()
            os.environ["DYN_LOG"] = ",".join(filter(None, [dyn_log or "info", f"{logger}={level.lower()}"]))
    else:
        levels = dyn_log_levels(env.get("DYN_LOG", ""), logger=logger)
        target.setLevel(levels.pop(logger, logging.INFO))
        for name, number in levels.items():
            logging.getLogger(name).setLevel(number)
    if any(getattr(h, "_trio_sidecar", False) for h in target.handlers):
        return
    handler: logging.Handler
    if _bridge is not None:
        handler = _bridge
    elif sys.stderr.isatty():
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

    Plain text in the :class:`UtcFormatter` layout, written with a single ``write`` so that it is safe to
    call from a signal-triggered path too; a record for Dynamo's logger when it is in use.
    """
    record = logging.LogRecord(name, level, __file__, 0, text, None, None)
    if _bridge is not None:
        _bridge.handle(record)
        return
    sys.stderr.write(UtcFormatter().format(record) + "\n")
    sys.stderr.flush()


def notice(text: str, *, level: int = logging.WARNING) -> None:
    """A bare line on stderr (exit notices that predate logging), or a record for Dynamo's logger when in use."""
    if _bridge is not None:
        emit(text, level=level)
        return
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def print_error(message: str, *, hint: str | None = None) -> None:
    """The CLIs' one-line failure report: ``error: {message}`` (and ``; hint: {hint}``) on stderr.

    Bold red on a terminal; plain text otherwise (rich markup in the message is never interpreted); an
    ``ERROR`` record for Dynamo's logger when it is in use.
    """
    text = f"error: {message}" + (f"; hint: {hint}" if hint else "")
    if _bridge is not None:
        emit(text, level=logging.ERROR)
        return
    from rich.console import Console

    Console(file=sys.stderr, soft_wrap=True).print(text, markup=False, highlight=False, style="bold red")
