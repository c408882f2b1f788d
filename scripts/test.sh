#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint, then run the whole CPU test suite.
# GPU-only tests skip cleanly where CUDA is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (ruff pinned in the dev extras, its default rules; pyproject has the settings)
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q "$@"
