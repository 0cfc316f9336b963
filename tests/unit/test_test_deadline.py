"""The suite's per-test deadline (tests/conftest.py): a hanging test fails with its name and where it waits.

Each case runs a small test file in a child pytest with this repository's conftest, a 1 s default deadline and
a 4 s one for slow tests, so a regression here shows up as a failed assertion, not as a hung suite.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

HANGING_TESTS = textwrap.dedent(
    """
    import time

    import pytest
    import trio


    async def test_trio_waits_forever():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.Event().wait, name="never-set event")


    async def test_trio_waits_forever_under_autojump(autojump_clock):
        await trio.sleep(3600)  # virtual time: passes at once
        await trio.Event().wait()


    def test_sync_sleeps_too_long():
        time.sleep(60)


    @pytest.mark.timeout(30)
    async def test_marker_extends_the_deadline():
        await trio.sleep(1.5)


    async def test_quick_test_passes():
        await trio.sleep(0)


    @pytest.mark.slow
    def test_slow_test_gets_the_slow_deadline():
        time.sleep(1.5)


    @pytest.mark.slow
    async def test_slow_test_still_has_a_deadline():
        await trio.Event().wait()
    """
)


@pytest.fixture(scope="module")
def child_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("deadline")
    shutil.copy(CONFTEST, directory / "conftest.py")
    (directory / "test_hanging.py").write_text(HANGING_TESTS)
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "trio_mode=true", str(directory)],
        cwd=directory,
        env={"PATH": "/usr/bin:/bin", "TRIO_SIDECAR_TEST_TIMEOUT": "1", "TRIO_SIDECAR_SLOW_TEST_TIMEOUT": "4"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return completed.stdout + completed.stderr


def test_a_hanging_trio_test_fails_with_its_name_and_the_line_it_waits_at(child_run: str) -> None:
    assert "test_hanging.py::test_trio_waits_forever did not finish within 1s" in child_run
    assert "never-set event" in child_run
    waits_at = HANGING_TESTS.splitlines().index("    async with trio.open_nursery() as nursery:") + 1
    assert f"test_hanging.py:{waits_at} in test_trio_waits_forever" in child_run


def test_the_autojump_clock_neither_fires_nor_hides_the_deadline(child_run: str) -> None:
    assert "test_trio_waits_forever_under_autojump did not finish within 1s" in child_run


def test_a_hanging_synchronous_test_fails_with_its_stack(child_run: str) -> None:
    assert "test_sync_sleeps_too_long did not finish within 1s" in child_run
    assert "time.sleep(60)" in child_run


def test_a_slow_test_gets_the_longer_slow_deadline_and_still_fails_when_it_hangs(child_run: str) -> None:
    assert "test_slow_test_gets_the_slow_deadline" not in child_run  # 1.5 s: within 4 s
    assert "test_slow_test_still_has_a_deadline did not finish within 4s" in child_run


def test_the_timeout_marker_overrides_the_default_and_quick_tests_pass(child_run: str) -> None:
    assert "4 failed, 3 passed" in child_run, child_run
