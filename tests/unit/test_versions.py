"""The version has one source (``trio_sidecar.__version__``) that the build and the installed metadata read,
and ``--version``/``env`` print what a bug report needs: the version and commit, Python, the transport,
protobuf and Dynamo versions, and the vLLM protocol revision."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import trio_sidecar
from trio_sidecar.cli import main
from trio_sidecar.versions import DEPENDENCIES, environment_lines, git_commit, protocol_digest

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_reads_the_version_from_the_package_and_declares_none_of_its_own():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "trio_sidecar.__version__"}


def test_the_installed_distribution_reports_the_package_version():
    assert metadata.version("trio-sidecar") == trio_sidecar.__version__


def test_version_names_the_commit_python_transport_dynamo_and_protocol(capsys: pytest.CaptureFixture[str]):
    assert main(["--version"]) == 0
    first, stack, protocol = capsys.readouterr().out.splitlines()
    commit = git_commit()
    assert commit is not None  # the tests run from a git checkout
    assert first == f"trio-sidecar {trio_sidecar.__version__} (commit {commit[:12]}" + (
        "-dirty)" if commit.endswith("-dirty") else ")"
    )
    assert stack.startswith(f"Python {platform.python_version()}, ")
    for name in ("trio", "purerpc", "h2", "protobuf", "ai-dynamo-runtime"):
        try:
            expected = metadata.version(name)
        except metadata.PackageNotFoundError:  # the quick loop (make test-fast) runs without Dynamo
            expected = "not installed"
        assert f"{name} {expected}" in stack
    assert protocol.startswith("vLLM protocol: vllm.Inference + vllm.Control") and protocol_digest() in protocol


def test_the_commit_is_the_checkouts_head():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert (git_commit() or "").removesuffix("-dirty") == head.stdout.strip()


def test_protocol_digest_changes_with_the_proto_files():
    digest = protocol_digest()
    assert re.fullmatch(r"[0-9a-f]{12}", digest)
    import hashlib

    whole = hashlib.sha256(
        (REPO / "protos/vllm/inference.proto").read_bytes() + (REPO / "protos/vllm/control.proto").read_bytes()
    )
    assert digest == whole.hexdigest()[:12]


def test_env_lists_one_line_per_fact_and_says_not_installed(capsys: pytest.CaptureFixture[str]):
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == environment_lines()
    facts = dict(line.split(": ", 1) for line in lines)
    assert facts["trio-sidecar"] == trio_sidecar.__version__
    assert facts["Python"].startswith(platform.python_version())
    for name in DEPENDENCIES:
        try:
            expected = metadata.version(name)
        except metadata.PackageNotFoundError:
            expected = "not installed"
        assert facts[name] == expected


@pytest.mark.dynamo
def test_env_reports_the_installed_dynamo_bindings(capsys: pytest.CaptureFixture[str]):
    assert main(["env"]) == 0
    facts = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert facts["ai-dynamo-runtime"] == "1.6.1"


def test_env_takes_no_arguments(capsys: pytest.CaptureFixture[str]):
    assert main(["env", "--json"]) == 2
    assert "takes no arguments" in capsys.readouterr().err


def test_env_runs_as_a_process_without_importing_dynamo():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from trio_sidecar.cli import main; main(['env']); print('dynamo' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out[0] == f"trio-sidecar: {trio_sidecar.__version__}" and out[-1] == "False"


@pytest.mark.parametrize("argv", [["--version"], ["env"], ["mock", "--version"]])
def test_a_report_into_a_closed_pipe_ends_with_0_and_no_traceback(argv: list[str]):
    # `trio-sidecar --version | head -n1`: the reader may be gone before the report is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "trio_sidecar", *argv], stdout=write_end, stderr=subprocess.PIPE, timeout=60
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr.decode()) == (0, "")
