#!/usr/bin/env bash
# Idempotent setup: a project virtualenv in .venv with the pinned CPU torch, megacpp (editable)
# and its test extras, plus the Debian packages the C++ tooling needs.
#
# torch is installed *first* and pinned (torch==2.13.0): the package's own `torch>=2.11`
# range would otherwise resolve to the newest CUDA build and pull several GB of wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="${MEGACPP_TORCH_PIN:-torch==2.13.0}"
PY="${PYTHON:-python3}"
APT_PACKAGES=(g++ libboost-dev libssl-dev)

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*" >&2; }

# 1. Debian packages (HumanEval-X needs Boost and OpenSSL headers; the data benchmark reads
#    Boost headers). Only when something is missing, and only where we may install.
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    log "apt-get install ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    log "warning: missing Debian packages (${missing[*]}); tests that need them will skip"
  fi
fi

# 2. The virtualenv.
if [ ! -x .venv/bin/python ]; then
  "$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
    || { log "Python >= 3.11 is required"; exit 1; }
  log "creating .venv"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

# 3. torch first, pinned.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH_PIN#torch==}')" 2>/dev/null; then
  log "installing ${TORCH_PIN}"
  "${PIP[@]}" "$TORCH_PIN" 2> >(grep -v "is ignored" >&2)
fi

# 4. megacpp itself (editable) with its test extras. Re-run only when pyproject changed.
stamp=.venv/.megacpp-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing megacpp[dev]"
  "${PIP[@]}" -e ".[dev]" 2> >(grep -v "is ignored" >&2)
  touch "$stamp"
fi
log "ready: $(.venv/bin/megacpp version)"
