#!/usr/bin/env bash
# The README's main-job command: set up (idempotent), then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if .venv/bin/megacpp quickstart --help >/dev/null 2>&1; then
  exec .venv/bin/megacpp quickstart "$@"
fi
# Until the trainer lands `megacpp quickstart`, the main job is describing the flagship model.
exec .venv/bin/megacpp model describe NAM56R "$@"
