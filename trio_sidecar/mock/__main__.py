"""``python -m trio_sidecar.mock``: the same as ``trio-sidecar mock``."""

import sys

from trio_sidecar.mock.cli import main

if __name__ == "__main__":
    sys.exit(main())
