#!/usr/bin/env python3
"""Build the tiny local model directory the Dynamo frontend needs (no weights, no downloads).

Usage: python scripts/make_tiny_model.py OUTPUT_DIR [--force]

The builder lives in the package (``trio_sidecar/mock/tiny_model.py``) so that ``trio-sidecar mock
--tiny-model DIR`` can create the directory itself; this script runs it from a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from trio_sidecar.mock.tiny_model import *  # noqa: E402,F403
from trio_sidecar.mock.tiny_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
