#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole CPU test suite.
# GPU-only tests skip cleanly where CUDA is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
