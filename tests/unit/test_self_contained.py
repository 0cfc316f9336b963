"""The repository stands alone: no reference points outside it, and every documentation reference resolves.

Code, tests and docs cite the repository's own docs (``docs/reference/*.md`` and the other files in
``docs/``) by file and heading anchor, or public upstream sources. This test fails on a citation of the
design notes the project was built from (they are not part of a clone), and on a relative markdown link or
a ``docs/<file>.md#<anchor>`` citation whose file or heading does not exist. CHANGELOG.md keeps its history as
written and is exempt from the first check.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Built from pieces so that this file does not match itself.
_SECTION_SIGN = "\u00a7"
_EXTERNAL_REFERENCE = re.compile(
    "|".join(
        [
            re.escape("shared" + "/spec"),
            re.escape(_SECTION_SIGN),
            r"[Cc]larifications?(?:\.md)?\s*#\d+",
            re.escape("clarifications" + ".md"),
        ]
    )
)
_EXEMPT = {"CHANGELOG.md"}
_SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", "_proto"}


@cache
def tracked_files() -> tuple[Path, ...]:
    """The tracked files (``git ls-files``), or every file outside caches when this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        paths = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.endswith(".egg-info")]
            paths.extend(Path(dirpath) / name for name in filenames)
    return tuple(sorted(p for p in paths if p.is_file()))


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_tracked_file_cites_material_outside_the_repository():
    offenders = []
    for path in tracked_files():
        if rel(path) in _EXEMPT:
            continue
        text = read_text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if _EXTERNAL_REFERENCE.search(line):
                offenders.append(f"{rel(path)}:{number}: {line.strip()[:120]}")
    assert not offenders, "cite docs/ or a public source instead:\n" + "\n".join(offenders)


# --- markdown links and docs citations -------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CITATION = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md)(?:#([\w-]+))?")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with inline code removed."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, _INLINE_CODE.sub("", line)))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: link text kept, markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = read_text(path) or ""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def check_target(target: Path, anchor: str | None) -> str | None:
    """A problem with ``target#anchor``, or None."""
    if not target.exists():
        return "no such file"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no heading with anchor #{anchor}"
    return None


def markdown_docs() -> list[Path]:
    return [p for p in tracked_files() if p.suffix == ".md" and (rel(p) == "README.md" or rel(p).startswith("docs/"))]


def test_the_github_slug_matches_githubs_anchors():
    assert github_slug("Security: vLLM's gRPC port is unauthenticated") == "security-vllms-grpc-port-is-unauthenticated"
    assert github_slug("Tiny model (`scripts/make_tiny_model.py OUTPUT_DIR`)") == (
        "tiny-model-scriptsmake_tiny_modelpy-output_dir"
    )
    assert github_slug("The h2 3.2.0 WINDOW_UPDATE race") == "the-h2-320-window_update-race"


def test_the_readme_and_docs_exist_and_have_links():
    docs = {rel(p) for p in markdown_docs()}
    assert {
        "README.md",
        "docs/performance.md",
        "docs/reference/sidecar.md",
        "docs/reference/mock.md",
        "docs/reference/wire.md",
        "docs/reference/worker.md",
    } <= docs
    readme = read_text(ROOT / "README.md") or ""
    assert len(_LINK.findall(readme)) >= 10  # the link checker below actually sees links


def test_every_relative_markdown_link_in_the_readme_and_docs_resolves():
    broken = []
    for path in markdown_docs():
        for number, line in prose_lines(read_text(path) or ""):
            for href in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", href):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = href.partition("#")
                target = (path.parent / file_part).resolve() if file_part else path
                problem = check_target(target, anchor or None)
                if problem:
                    broken.append(f"{rel(path)}:{number}: ({href}) {problem}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_citation_in_code_and_docs_resolves():
    broken = []
    cited = 0
    for path in tracked_files():
        if rel(path) in _EXEMPT:
            continue
        text = read_text(path)
        if text is None or "docs/" not in text:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for file_part, anchor in _CITATION.findall(line):
                cited += 1
                problem = check_target(ROOT / file_part, anchor or None)
                if problem:
                    broken.append(f"{rel(path)}:{number}: {file_part}#{anchor} {problem}")
    assert cited >= 100  # comments and docstrings cite docs/ throughout; a pattern that finds none is broken
    assert not broken, "citations that do not resolve:\n" + "\n".join(broken)
