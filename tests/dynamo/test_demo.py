"""The README's first command: ``examples/demo.py`` runs end to end and exits 0."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from dynamo_harness import REPO, require_dynamo

from trio_sidecar.mock.tiny_model import WORDS

pytestmark = pytest.mark.dynamo


def test_the_demo_streams_words_of_a_chat_completion_and_shuts_down_cleanly():
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
    # The assistant's line: six words of the tiny model's vocabulary (text_mode "words"), no token tags.
    answer = re.search(r"assistant: (.*?) finish_reason=", out)
    assert answer, out[-3000:]
    words = answer.group(1).split()
    assert len(words) == 6 and all(word in WORDS for word in words), words
    assert "<token:" not in out
    assert "finish_reason=length" in out
    assert "trio-sidecar exited 0" in out
    assert "stopped: trio-sidecar → 0, frontend → 0, mock → 0" in out
