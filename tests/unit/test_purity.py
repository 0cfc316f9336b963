"""The pure core never imports Trio or does I/O (docs/architecture.md "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trio_sidecar

ROOT = Path(trio_sidecar.__file__).parent
PURE = {
    "core",
    "core.completions",
    "core.lora_requests",
    "core.status",
    "core.errors",
    "core.config",
    "core.endpoint",
    "core.jsonstruct",
    "core.protocol",
    "core.model",
    "core.convert",
    "core.convert.request",
    "core.convert.response",
    "core.convert.batch",
    "core.multimodal",
    "core.mm_routing",
    "core.routing",
    "core.sampling_checks",
    "core.run_options",
    "core.tracecontext",
    "core.rl_requests",
    "core.health_policy",
    "core.stats",
    "dynamo.metrics",
    "dynamo.rotation",
}
FORBIDDEN_TOP = {"trio", "trio_util", "anyio", "asyncio", "socket", "purerpc", "h2", "zmq", "subprocess", "threading"}


def _path(module: str) -> Path:
    parts = module.split(".")
    package = ROOT.joinpath(*parts) / "__init__.py"
    return package if package.exists() else ROOT.joinpath(*parts[:-1], parts[-1] + ".py")


def _imports(module: str) -> list[tuple[str, int]]:
    """(absolute-ish name, level) of every import in the module."""
    tree = ast.parse(_path(module).read_text())
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                found.extend((f"{base}.{alias.name}" if base else alias.name, node.level) for alias in node.names)
            else:
                found.append((base, 0))
    return found


def _resolve(module: str, name: str, level: int) -> str:
    package = module.split(".")
    if not _path(module).name == "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*package, name]) if package else name


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_module_imports_only_pure_code(module: str) -> None:
    for name, level in _imports(module):
        if level == 0:
            assert name.split(".")[0] not in FORBIDDEN_TOP, f"{module} imports {name}"
            continue
        target = _resolve(module, name, level)
        # `from .x import y` may name a module (x.y) or an attribute of x.
        candidates = [target, target.rsplit(".", 1)[0]]
        ok = any(c in PURE or c.startswith("_proto") for c in candidates)
        assert ok, f"{module} imports {target}, which is not a pure module"


def test_every_core_module_is_checked_as_pure() -> None:
    core = ROOT / "core"
    found = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for path in core.rglob("*.py")
    }
    assert found == {m for m in PURE if m == "core" or m.startswith("core.")}
