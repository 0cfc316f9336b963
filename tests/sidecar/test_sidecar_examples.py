"""The examples run as subprocesses and exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, COLUMNS="120", NO_COLOR="1", TERM="dumb", PYTHONIOENCODING="utf-8")
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, str(EXAMPLES / name), *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, output
    return output


async def test_embedded_stream_prints_the_completion():
    output = await run_example("embedded_stream.py", "--max-tokens", "5")
    assert "length" in output
    assert output.count("<token:") == 5


async def test_cancel_midstream_shows_the_counters_going_to_zero():
    output = await run_example("cancel_midstream.py")
    assert "finish_reason cancelled" in output
    assert "usage 4+3" in output
    assert "the mock's work went to zero" in output
    drained = next(line for line in output.splitlines() if "drained" in line)
    assert [cell for cell in re.split(r"[│|\s]+", drained) if cell] == ["drained", "0", "0", "0", "1"]


async def test_disaggregated_image_flows_prefill_handoff_decode():
    output = await run_example("disaggregated.py")
    assert "_dynamo_sidecar_multimodal_prompt_token_ids" in output
    assert "finish_reason length" in output
    assert "usage 20+6=26" in output


@pytest.mark.parametrize("name", ["embedded_stream.py", "cancel_midstream.py", "disaggregated.py"])
def test_examples_have_a_docstring_and_a_main_guard(name):
    source = (EXAMPLES / name).read_text()
    assert source.startswith('"""')
    assert 'if __name__ == "__main__":' in source
    assert subprocess.run([sys.executable, "-m", "py_compile", str(EXAMPLES / name)], check=False).returncode == 0
