"""The shell blocks of README.md and docs/**/*.md run as written, in a fresh clone, so the docs cannot rot.

Convention (docs/contributing.md, "Documented commands"): every ```bash / ```sh / ```console block in
README.md and docs/**/*.md is preceded by one marker line saying how this test treats it:

``<!-- doc-test: run -->``
    Run as a bash script (``set -euo pipefail``) in the clone's root; it must exit 0 within 5 minutes.
``<!-- doc-test: run retry=SECONDS -->``
    The same, retried every second until it succeeds or SECONDS pass (a request to servers that an earlier
    ``background`` block is still starting).
``<!-- doc-test: background -->``
    Servers (lines ending in ``&``): started in a process group of their own, kept while the rest of the
    file's blocks run, checked to be still alive, then stopped with SIGTERM (SIGKILL after 30 s) by that
    group's id.
``<!-- doc-test: dry-run -->``
    Installs and other slow or recursive commands (``make install``, ``make test``): each ``make ...`` line
    runs as ``make -n ...`` (the targets and their prerequisites exist and the recipe expands), ``source F``
    needs F to exist, and any other line's program must exist in the clone or on PATH. The installs
    themselves run in CI (``make test`` creates the very environment this test uses).
``<!-- doc-test: skip: REASON -->``
    Not run here, for the stated reason (a GPU, a real vLLM server, Kubernetes, Docker, another test that
    already runs it).

A ```python block is illustrative unless it carries a marker: ``run`` (or ``run retry=SECONDS``) runs it
with the environment's ``python`` in the clone's root, with the same port rewrites; ``skip: REASON`` says why
not. In a guide of runnable programs (:data:`RUNNABLE_GUIDES`) every python block must carry one.

The fresh clone is ``git clone`` of the repository's committed HEAD. It reuses the running test
environment: ``.venv`` is a symlink to it, its ``bin`` leads PATH and PYTHONPATH points at the clone, so
``trio-sidecar`` and ``python`` run the clone's code without installing anything. The only rewrites of a
block are its well-known ports (50051, 8000 and the other literal ports of the table below), mapped to free
loopback ports so that concurrent runs never collide; Dynamo's hosts are pinned to 127.0.0.1 and its file
discovery to a private directory through the environment, as docs/deployment.md recommends.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from trio_sidecar._devtools import local

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")))
SHELL_LANGS = ("bash", "sh", "shell", "console")
PYTHON_LANGS = ("python",)
#: Guides whose every python block is a program the test runs (or skips for a stated reason).
RUNNABLE_GUIDES = ("docs/embedded.md",)
PORTS = ("50051", "8000")

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->\s*$")

pytestmark = pytest.mark.docs


@attrs.frozen
class Block:
    path: str
    line: int
    lang: str
    text: str
    mode: str | None  # "run", "background", "dry-run", "skip"; None: no marker
    retry: float = 0.0
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _parse_marker(text: str) -> tuple[str | None, float, str]:
    if text.startswith("skip:"):
        return "skip", 0.0, text[5:].strip()
    words = text.split()
    if not words or words[0] not in ("run", "background", "dry-run"):
        return None, 0.0, f"unknown doc-test marker {text!r}"
    retry = 0.0
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key != "retry" or not value.isdigit():
            return None, 0.0, f"unknown doc-test option {word!r}"
        retry = float(value)
    return words[0], retry, ""


def extract_blocks(path: str) -> list[Block]:
    """Every fenced block of ``path`` with the marker on the line just above it (blank lines allowed)."""
    source = (REPO / path).read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(source):
        before = source[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        mode, retry, reason = _parse_marker(marker.group(1)) if marker else (None, 0.0, "")
        blocks.append(
            Block(path, source.count("\n", 0, match.start()) + 1, match.group(1), match.group(2), mode, retry, reason)
        )
    return blocks


def shell_blocks(path: str) -> list[Block]:
    return [b for b in extract_blocks(path) if b.lang in SHELL_LANGS]


def python_blocks(path: str) -> list[Block]:
    """The marked python blocks of ``path`` (in a runnable guide: all of them, a missing marker included)."""
    blocks = [b for b in extract_blocks(path) if b.lang in PYTHON_LANGS]
    if path in RUNNABLE_GUIDES:
        return blocks
    return [b for b in blocks if b.mode is not None or b.reason]


def runnable_blocks(path: str) -> list[Block]:
    """The shell and marked python blocks of ``path``, in document order."""
    return sorted([*shell_blocks(path), *python_blocks(path)], key=lambda b: b.line)


def test_every_python_block_with_a_marker_is_run_or_skipped():
    bad = [
        f"{b.where} ({b.mode or b.reason or 'no marker'})"
        for path in DOCS
        for b in python_blocks(path)
        if b.mode not in ("run", "skip") or (b.mode == "skip" and not b.reason)
    ]
    assert not bad, "python blocks must be marked run or skip: REASON: " + ", ".join(bad)
    for guide in RUNNABLE_GUIDES:
        assert any(b.mode == "run" for b in python_blocks(guide)), f"{guide} runs no python block"


def test_every_shell_block_in_the_docs_says_how_it_is_tested():
    unmarked = [
        b.where + (f" ({b.reason})" if b.reason else "") for path in DOCS for b in shell_blocks(path) if b.mode is None
    ]
    assert not unmarked, "shell blocks without a valid <!-- doc-test: ... --> marker: " + ", ".join(unmarked)
    skipped = [b for path in DOCS for b in shell_blocks(path) if b.mode == "skip"]
    assert all(b.reason for b in skipped), [b.where for b in skipped if not b.reason]


def test_the_extractor_reads_markers_modes_and_options(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- doc-test: run retry=30 -->\n```bash\ncurl -sf x\n```\n\n"
        "<!-- doc-test: skip: needs a GPU -->\n```sh\nnvidia-smi\n```\n"
        "text\n```bash\nunmarked\n```\n<!-- doc-test: bogus -->\n```bash\nx\n```\n```python\nprint()\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    blocks = shell_blocks("doc.md")
    assert [(b.mode, b.retry, b.reason, b.line) for b in blocks] == [
        ("run", 30.0, "", 2),
        ("skip", 0.0, "needs a GPU", 7),
        (None, 0.0, "", 11),
        (None, 0.0, "unknown doc-test marker 'bogus'", 15),
    ]


# --- running the blocks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("the docs test needs git and a git checkout of the repository")
    target = tmp_path_factory.mktemp("fresh") / "trio-sidecar"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(target)], check=True, timeout=120)
    (target / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return target


def _environment(clone: Path, workdir: Path) -> dict[str, str]:
    env = local.dynamo_env(workdir / "file-kv")
    env.pop("DYN_DISCOVERY_BACKEND", None)  # the documented flags must say it themselves
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # "offline" must hold without these switches
        env.pop(key, None)
    env["PATH"] = f"{clone / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(clone)
    env["TMPDIR"] = str(workdir)
    return env


def _with_free_ports(text: str, ports: dict[str, str]) -> str:
    return re.sub(r"(?<![\d.])(" + "|".join(PORTS) + r")(?!\d)", lambda m: ports[m.group(1)], text)


def _script(block: Block, ports: dict[str, str]) -> str:
    text = _with_free_ports(block.text, ports)
    if block.lang in PYTHON_LANGS:  # (a quoted here-document: the shell expands nothing in it)
        return f"set -euo pipefail\npython - <<'DOC_TEST_PYTHON'\n{text}\nDOC_TEST_PYTHON\n"
    return "set -euo pipefail\n" + text + "\n"


def _dry_run(block: Block, clone: Path, env: dict[str, str]) -> None:
    for raw in block.text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if words[0] == "make":
            result = subprocess.run(
                ["make", "-n", *words[1:]], cwd=clone, env=env, capture_output=True, text=True, timeout=60
            )
            assert result.returncode == 0, f"{block.where}: `make -n {' '.join(words[1:])}`: {result.stderr}"
        elif words[0] in ("source", "."):
            assert (clone / words[1]).exists(), f"{block.where}: {words[1]} does not exist"
        else:
            program = words[0]
            found = (clone / program).is_file() if "/" in program else shutil.which(program, path=env["PATH"])
            assert found, f"{block.where}: `{program}` is neither in the clone nor on PATH"


def _run(block: Block, clone: Path, env: dict[str, str], ports: dict[str, str], log: Path) -> None:
    deadline = time.monotonic() + max(block.retry, 0.0)
    while True:
        with open(log, "ab") as out:
            out.write(f"\n### {block.where}\n".encode())
            out.flush()
            result = subprocess.run(
                ["bash", "-c", _script(block, ports)],
                cwd=clone,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
        if result.returncode == 0 or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    assert result.returncode == 0, f"{block.where} exited {result.returncode}:\n{log.read_text()[-4000:]}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(proc: subprocess.Popen, grace: float = 30.0) -> int | None:
    """SIGTERM to the block's own process group (its id is the PID this test started); the servers in it
    shut down gracefully; whatever is left after ``grace`` gets SIGKILL. Returns the shell's exit code."""
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        proc.poll()  # reap the shell itself; its children are reaped by init once it is gone
        time.sleep(0.1)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(10)


RUNNABLE = [path for path in DOCS if any(b.mode in ("run", "background", "dry-run") for b in runnable_blocks(path))]


@pytest.mark.dynamo
@pytest.mark.parametrize("path", RUNNABLE)
def test_the_documented_commands_work_in_a_fresh_clone(path, clone, tmp_path):
    import importlib.util

    if importlib.util.find_spec("dynamo.frontend") is None:
        pytest.fail("Dynamo 1.6.1 is not installed (make install)")
    env = _environment(clone, tmp_path)
    ports = {port: str(local.free_port()) for port in PORTS}
    log = tmp_path / "blocks.log"
    background: list[tuple[Block, subprocess.Popen, float]] = []
    codes: list[tuple[Block, int | None]] = []
    try:
        for block in runnable_blocks(path):
            if block.mode == "dry-run":
                _dry_run(block, clone, env)
            elif block.mode == "run":
                _run(block, clone, env, ports, log)
            elif block.mode == "background":
                _end_background(background, log, codes)  # one set of servers at a time (shared ports)
                out = open(log, "ab")  # noqa: SIM115 - closed with the file handle of the child below
                out.write(f"\n### {block.where} (background)\n".encode())
                out.flush()
                proc = subprocess.Popen(
                    ["bash", "-c", _script(block, ports) + "wait\n"],
                    cwd=clone,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                out.close()
                background.append((block, proc, time.monotonic()))
        _end_background(background, log, codes)
    finally:
        codes += [(block, _stop_group(proc)) for block, proc, _ in reversed(background)]
    for block, code in codes:
        assert code in (0, 143, -signal.SIGTERM), f"{block.where} stopped with {code}:\n{log.read_text()[-4000:]}"


def _end_background(background: list, log: Path, codes: list) -> None:
    """Check that the running servers are still alive (after at least 3 s), then stop them."""
    while background:
        block, proc, started = background.pop()
        time.sleep(max(0.0, started + 3.0 - time.monotonic()))
        alive = proc.poll() is None
        codes.append((block, _stop_group(proc)))
        assert alive, f"{block.where} ended early:\n{log.read_text()[-4000:]}"
