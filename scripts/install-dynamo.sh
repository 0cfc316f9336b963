#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 (runtime bindings, frontend and native vLLM sidecar) into a venv.
#
# Usage: scripts/install-dynamo.sh VENV_PYTHON
#
# Why not `pip install ai-dynamo==1.6.1`: it depends on `aisimulate==0.13.0`, a placeholder sdist that
# downloads its real wheel from the vendor's own index at build time and fails without it. `aisimulate`
# is only imported by `dynamo.planner`, which this project never uses, so `ai-dynamo` is installed with
# `--no-deps` and its remaining dependencies are listed explicitly (docs/dynamo.md, "Installation").
# pip then warns that `aisimulate` is missing; that warning is harmless.
#
# Idempotent: when the pinned versions already import, it exits at once.
set -euo pipefail

if [ "$#" -ne 1 ]; then
  echo "usage: $0 VENV_PYTHON" >&2
  exit 2
fi
PY="$1"
VERSION="1.6.1"

installed() {
  "$PY" - "$VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
want = sys.argv[1]
assert version("ai-dynamo-runtime") == want and version("ai-dynamo") == want
for dist in ("aiohttp", "msgspec", "prometheus-client", "transformers", "tokenizers", "zstandard",
             "kubernetes", "redis", "tqdm", "pyzmq"):
    version(dist)
import dynamo.llm, dynamo.runtime  # noqa: F401  (the native module loads)
import dynamo.frontend  # noqa: F401
EOF
}

if installed; then
  echo "Dynamo ${VERSION} already installed in $("$PY" -c 'import sys; print(sys.prefix)')"
  exit 0
fi

PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
echo "==> installing ai-dynamo-runtime ${VERSION} (Dynamo's runtime bindings, ~100 MB)"
"${PIP[@]}" "ai-dynamo-runtime==${VERSION}"
echo "==> installing ai-dynamo ${VERSION} without its dependencies (the frontend and the native sidecar)"
"${PIP[@]}" --no-deps "ai-dynamo==${VERSION}"
echo "==> installing the frontend's dependencies (aiohttp, transformers, tokenizers, pyzmq, ...)"
echo "    note: pip may now print an ERROR that ai-dynamo requires aisimulate, which is not installed."
echo "    That is expected: aisimulate is only used by dynamo.planner, which trio-sidecar never imports."
"${PIP[@]}" 'aiohttp<4.0,>=3.14.3' certifi 'kubernetes<33.0.0,>=32.0.1' 'msgspec>=0.19.0' \
  'prometheus-client<1.0,>=0.23.1' 'pyzmq>=26.0.0' 'redis<9.0.0,>=6.2.0' tqdm 'transformers>=4.56.0' \
  'typing-extensions>=4.10.0' 'zstandard<1.0,>=0.23.0' tokenizers

if ! installed; then
  echo "error: Dynamo ${VERSION} did not import after installation" >&2
  exit 1
fi
echo "Dynamo ${VERSION} installed"
