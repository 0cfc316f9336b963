"""Generate the protobuf messages and purerpc service stubs from ``protos/``.

Usage: ``python scripts/gen_protos.py [OUTPUT_DIR]`` (default: ``trio_sidecar/_proto``).

Generated files are committed; ``tests/unit/test_proto_drift.py`` regenerates into a temporary
directory and fails on any byte of difference. The generators' absolute imports (``from vllm import
…``) are rewritten to package-absolute imports under ``trio_sidecar._proto`` so the package works
without touching ``sys.path``.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = "trio_sidecar._proto"
PROTOS = ("vllm/inference.proto", "vllm/control.proto", "grpc/health/v1/health.proto")
# Top-level proto packages whose generated modules live under PACKAGE.
LOCAL_ROOTS = ("vllm", "grpc.health")


def _rewrite_imports(text: str) -> str:
    for root in LOCAL_ROOTS:
        escaped = re.escape(root)
        text = re.sub(
            rf"^from {escaped}(\.[\w.]*)? import ",
            lambda m, root=root: f"from {PACKAGE}.{root}{m.group(1) or ''} import ",
            text,
            flags=re.M,
        )
        text = re.sub(
            rf"^import {escaped}(\.[\w.]+) as ",
            lambda m, root=root: f"import {PACKAGE}.{root}{m.group(1)} as ",
            text,
            flags=re.M,
        )
    return text


# purerpc 0.8.0's protoc plugin predates proto3 `optional` and does not declare the feature, so protoc
# refuses to run it on our protos. The stubs it emits only name messages, so optional fields do not affect
# them: this wrapper runs the stock plugin and declares FEATURE_PROTO3_OPTIONAL on its response.
_PLUGIN_WRAPPER = """\
import io, sys, types
from google.protobuf.compiler.plugin_pb2 import CodeGeneratorResponse
from purerpc.protoc_plugin import plugin

captured = io.BytesIO()
real_stdin, real_stdout = sys.stdin, sys.stdout
sys.stdin = types.SimpleNamespace(buffer=io.BytesIO(real_stdin.buffer.read()))
sys.stdout = types.SimpleNamespace(buffer=captured)
try:
    plugin.main()
finally:
    sys.stdin, sys.stdout = real_stdin, real_stdout
response = CodeGeneratorResponse.FromString(captured.getvalue())
response.supported_features |= CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
sys.stdout.buffer.write(response.SerializeToString())
"""


def generate(out_dir: pathlib.Path) -> None:
    import tempfile

    import grpc_tools
    from grpc_tools import protoc

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="trio-sidecar-protoc-"))
    plugin = tmp / "protoc-gen-purerpc"
    plugin.write_text(f"#!{sys.executable}\n{_PLUGIN_WRAPPER}")
    plugin.chmod(0o755)

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-purerpc={plugin}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",  # type stubs: the messages' fields for the type checker
        f"--purerpc_out={out_dir}",
        *[str(PROTO_ROOT / p) for p in PROTOS],
    ]
    try:
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for path in sorted([*out_dir.rglob("*.py"), *out_dir.rglob("*.pyi")]):
        path.write_text(_rewrite_imports(path.read_text()))
    # Package markers so the generated modules import as a package.
    for directory in [out_dir, *sorted(p for p in out_dir.rglob("*") if p.is_dir())]:
        init = directory / "__init__.py"
        if not init.exists():
            init.write_text("")


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "trio_sidecar" / "_proto"
    generate(target)
