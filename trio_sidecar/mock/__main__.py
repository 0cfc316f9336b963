"""``python -m trio_sidecar.mock``: the same as ``trio-sidecar mock``."""

import sys

if __name__ == "__main__":
    try:
        from trio_sidecar.mock.cli import main

        code = main()
    except KeyboardInterrupt:  # SIGINT before the Trio run took the signals over: one line, no traceback
        sys.stderr.write("interrupted by SIGINT before serving; exiting with code 130\n")
        code = 130
    sys.exit(code)
