"""Log output for the CLIs: rich for humans on a terminal, plain one-line records for machines."""

from __future__ import annotations

import logging
import sys

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, *, logger: str = "trio_sidecar") -> None:
    """Attach one stderr handler to ``logger`` (idempotent) and set its level.

    On a TTY the handler is rich's (colours, aligned columns); otherwise a plain ``StreamHandler`` so that
    log collectors and tests see whole, unwrapped lines.
    """
    target = logging.getLogger(logger)
    target.setLevel(getattr(logging, level.upper(), logging.INFO))
    if any(getattr(h, "_trio_sidecar", False) for h in target.handlers):
        return
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    handler._trio_sidecar = True  # type: ignore[attr-defined]
    target.addHandler(handler)
