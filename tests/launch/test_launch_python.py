"""The launch scripts' choice of Python: the repository's .venv when present, else python3, and a clear
message naming what is missing (no hardware, no servers: the check runs before anything starts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A Python with nothing installed (no trio-sidecar, no Dynamo)."""
    target = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False).create(target)
    return target / "bin" / "python"


@pytest.mark.parametrize("script", ["agg.sh", "disagg.sh", "agg_kv_router.sh"])
def test_a_python_without_the_packages_is_named_with_what_is_missing(script, bare_python, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=str(bare_python), TMPDIR=str(tmp_path))
    result = subprocess.run(
        ["bash", str(REPO / "launch" / script), "--mock"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"[launch] error: PYTHON={bare_python} lacks trio-sidecar, ai-dynamo-runtime 1.6.1, ai-dynamo 1.6.1 "
        f"(the frontend), tokenizers; run `make install` in {REPO} (it creates .venv with trio-sidecar and "
        "Dynamo 1.6.1), or set PYTHON to a Python that has them"
    )
    assert list(tmp_path.glob("trio-sidecar-launch.*")) == []  # nothing was started or created


def test_without_python_and_without_a_venv_python3_is_checked_and_the_message_says_both(tmp_path, bare_python):
    """A copy of the scripts in a checkout that has no .venv; python3 on PATH is a bare interpreter."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "launch", checkout / "launch")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(bare_python)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(tmp_path))
    result = subprocess.run(
        ["bash", str(checkout / "launch" / "agg.sh"), "--mock"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"[launch] error: python3 (there is no {checkout}/.venv) lacks trio-sidecar, ai-dynamo-runtime 1.6.1, "
        f"ai-dynamo 1.6.1 (the frontend), tokenizers; run `make install` in {checkout} (it creates .venv with "
        "trio-sidecar and Dynamo 1.6.1), or set PYTHON to a Python that has them"
    )
