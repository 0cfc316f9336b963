#!/usr/bin/env bash
# Build the wheel and the sdist, install the wheel into a clean venv, and smoke-test what a user gets.
#
# Usage: scripts/check-dist.sh BUILD_PYTHON [OUT_DIR]
#
#   BUILD_PYTHON  a Python with the `build` package (the test extra has it): .venv/bin/python
#   OUT_DIR       where the wheel and sdist go (default: a temporary directory, removed afterwards)
#
# Checks: both artifacts build; the wheel installs with its `mock` extra into a new venv (its dependencies
# come from the package index); `trio-sidecar --version` prints the project version (from
# trio_sidecar/__init__.py, the one source) and `trio-sidecar env` reports it; the .proto files and LICENSE
# are installed; the documented offline recipe, `trio-sidecar mock --tiny-model DIR --listen 127.0.0.1:0`,
# builds the tiny model, prints its listening line and exits 0 on SIGTERM. The mock is the only process
# started, it binds 127.0.0.1 only, and it is stopped by its PID.
set -euo pipefail

if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
  echo "usage: $0 BUILD_PYTHON [OUT_DIR]" >&2
  exit 2
fi
PY=$1
cd "$(dirname "$0")/.."
WORK=$(mktemp -d "${TMPDIR:-/tmp}/trio-sidecar-dist.XXXXXX")
MOCK_PID=
cleanup() {
  if [ -n "$MOCK_PID" ] && kill -0 "$MOCK_PID" 2>/dev/null; then
    kill -KILL "$MOCK_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
OUT=${2:-$WORK/dist}
mkdir -p "$OUT"

echo "==> building the sdist, then the wheel from the sdist, into $OUT"
"$PY" -m build --outdir "$OUT" . >"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; exit 1; }
VERSION=$("$PY" -c 'import ast, sys
tree = ast.parse(open("trio_sidecar/__init__.py").read())
print(next(n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__version__"))')
WHEEL=$(ls "$OUT"/trio_sidecar-"$VERSION"-*.whl)
SDIST=$(ls "$OUT"/trio_sidecar-"$VERSION".tar.gz)
echo "    $(basename "$WHEEL"), $(basename "$SDIST")"
tar -tzf "$SDIST" >"$WORK/sdist.list"
grep -q "/LICENSE$" "$WORK/sdist.list" || { echo "error: the sdist has no LICENSE" >&2; exit 1; }

echo "==> installing the wheel with its mock extra into a clean venv"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --disable-pip-version-check "$WHEEL[mock]" >"$WORK/pip.log" 2>&1 ||
  { tail -n 40 "$WORK/pip.log" >&2; echo "error: installing the wheel failed" >&2; exit 1; }
if [ ! -x "$WORK/venv/bin/trio-sidecar" ]; then
  tail -n 40 "$WORK/pip.log" >&2
  ls -l "$WORK/venv/bin" >&2
  echo "error: the wheel installed no trio-sidecar script" >&2
  exit 1
fi

report=$("$WORK/venv/bin/trio-sidecar" --version)
got=${report%%$'\n'*}
[ "$got" = "trio-sidecar $VERSION" ] || { echo "error: --version printed '$got'" >&2; exit 1; }
echo "    $got"
"$WORK/venv/bin/trio-sidecar" env >"$WORK/env.out"
grep -qx "trio-sidecar: $VERSION" "$WORK/env.out" || { echo "error: trio-sidecar env printed:" >&2; cat "$WORK/env.out" >&2; exit 1; }
grep -qx "ai-dynamo-runtime: not installed" "$WORK/env.out" || { echo "error: env in a venv without Dynamo:" >&2; cat "$WORK/env.out" >&2; exit 1; }
(cd "$WORK" && "$WORK/venv/bin/python" - <<'EOF')
from importlib.metadata import distribution
from importlib.resources import files

protos = files("trio_sidecar") / "protos"
for name in ("vllm/inference.proto", "vllm/control.proto", "grpc/health/v1/health.proto"):
    assert (protos / name).is_file(), f"{name} is not in the installed package"
dist = distribution("trio-sidecar")
assert dist.metadata["License-Expression"] == "Apache-2.0", dist.metadata["License-Expression"]
assert any(str(f).endswith("LICENSE") for f in dist.files), "LICENSE is not installed"
print("    protos and LICENSE installed")
EOF

echo "==> starting the installed mock with its tiny model (the offline recipe) on 127.0.0.1:0"
"$WORK/venv/bin/trio-sidecar" mock --tiny-model "$WORK/tiny-model" --listen 127.0.0.1:0 >"$WORK/mock.out" 2>"$WORK/mock.err" &
MOCK_PID=$!
for _ in $(seq 1 300); do
  grep -q "^trio-sidecar mock listening on 127.0.0.1:" "$WORK/mock.out" && break
  kill -0 "$MOCK_PID" 2>/dev/null || break
  sleep 0.1
done
if ! grep -q "^trio-sidecar mock listening on 127.0.0.1:" "$WORK/mock.out"; then
  echo "error: the installed mock did not start" >&2
  cat "$WORK/mock.err" >&2
  exit 1
fi
echo "    $(cat "$WORK/mock.out")"
[ -s "$WORK/tiny-model/tokenizer.json" ] || { echo "error: --tiny-model built no tokenizer.json" >&2; exit 1; }
kill -TERM "$MOCK_PID"
status=0
wait "$MOCK_PID" || status=$?
MOCK_PID=
[ "$status" -eq 0 ] || { echo "error: the mock exited $status after SIGTERM" >&2; cat "$WORK/mock.err" >&2; exit 1; }
echo "==> dist check passed"
