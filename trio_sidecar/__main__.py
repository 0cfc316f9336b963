"""``python -m trio_sidecar`` / the ``trio-sidecar`` script."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trio-sidecar`` with ``argv`` (default ``sys.argv[1:]``) and return its exit code."""
    try:
        from .cli import main as cli_main

        return cli_main(argv)
    except KeyboardInterrupt:  # SIGINT before the CLI installed its own handlers (its modules still loading)
        sys.stderr.write("interrupted by SIGINT before serving; exiting with code 130\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
