"""``python -m trio_sidecar.mock``: the same as ``trio-sidecar mock``."""

import sys

if __name__ == "__main__":
    try:
        from trio_sidecar.mock.cli import main
    except KeyboardInterrupt:  # SIGINT while the modules are still being imported: one line, no traceback
        sys.stderr.write("interrupted by SIGINT before serving; exiting with code 130\n")
        sys.exit(130)
    sys.exit(main())
