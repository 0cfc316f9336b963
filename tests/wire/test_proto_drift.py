"""The committed generated code is exactly what scripts/gen_protos.py produces from protos/."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "trio_sidecar" / "_proto"


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted([*directory.rglob("*.py"), *directory.rglob("*.pyi")])
        if "__pycache__" not in p.parts
    }


def test_regenerated_stubs_match_committed_bytes(tmp_path: pathlib.Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh, committed = _files(tmp_path), _files(COMMITTED)
    assert sorted(fresh) == sorted(committed)
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert drifted == [], f"generated code drifted from protos/: {drifted} (run make protos)"
