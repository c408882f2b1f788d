#!/usr/bin/env bash
# The README's main-job command: set up (idempotent), then `megacpp quickstart`: build a
# corpus from the C++ headers on this machine, train the tiny model on the CPU, sample from
# it, and print where the checkpoint, plots and receipt are. Extra arguments go to quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/megacpp quickstart "$@"
