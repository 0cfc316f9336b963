"""The README's first command: ``examples/demo.py`` runs end to end and exits 0."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from dynamo_harness import REPO, require_dynamo

pytestmark = pytest.mark.dynamo


def test_the_demo_streams_a_chat_completion_and_shuts_down_cleanly():
    require_dynamo()
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--max-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Model discovered through vllm.Control" in out
    assert len(re.findall(r"<token:\d+>", out)) == 6
    assert "finish_reason=length" in out
    assert "trio-sidecar exited 0" in out
    assert "stopped: trio-sidecar → 0, frontend → 0, mock → 0" in out
