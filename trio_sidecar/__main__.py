"""``python -m trio_sidecar`` / the ``trio-sidecar`` script."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trio-sidecar`` with ``argv`` (default ``sys.argv[1:]``) and return its exit code."""
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:  # SIGINT while the CLI's modules are still being imported
        sys.stderr.write("interrupted by SIGINT before serving; exiting with code 130\n")
        return 130
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
