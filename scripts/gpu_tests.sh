#!/usr/bin/env bash
# The GPU test suite -- every test marked `gpu` -- in fixed groups, so that each group fits one
# 10-minute call of the GPU machine (the whole suite no longer does: Triton compiles every
# kernel variant on a cold cache). pytest-split balances the groups by the per-test durations
# measured on an H100 (tests/gpu_durations.json; tests it has no record of count as its mean).
#
#   usage: bash scripts/gpu_tests.sh GROUP [SPLITS] [pytest args...]   GROUP in 1..SPLITS (default 4)
#          bash scripts/gpu_tests.sh all [pytest args...]              the whole suite, one run
#
# Where no CUDA device is present every test skips (nothing is stored). Wheels under .whl/ are
# installed into /tmp/site first when pytest-split is not importable (the GPU machine has no
# network: carry .whl). Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '/^#   usage:/,/whole suite/p' "$0" | sed 's/^#  *//' >&2; exit 2; }
[ $# -ge 1 ] || usage
group=$1; shift
splits=4
if [ "$group" != all ]; then
  [[ "$group" =~ ^[1-9][0-9]*$ ]] || usage
  if [ $# -ge 1 ] && [[ "$1" =~ ^[1-9][0-9]*$ ]]; then splits=$1; shift; fi
  [ "$group" -le "$splits" ] || { echo "gpu_tests: group $group of $splits" >&2; exit 2; }
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pytest_split" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  fi
  "$PY" -c "import pytest_split" 2>/dev/null \
    || { echo "gpu_tests: pytest-split is not installed (pip install -e '.[dev]'; on a machine" \
              "without network, carry .whl filled by scripts/peer_wheels.sh)" >&2; exit 1; }
fi

# the modules that hold GPU tests (collecting only these: the serving and Megatron modules
# need packages the GPU machine does not have)
mapfile -t files < <(grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort)
[ "${#files[@]}" -gt 0 ] || { echo "gpu_tests: no module under tests/ has a gpu mark" >&2; exit 1; }

# The groups are fixed by tests/gpu_durations.json (pytest-split reads its durations and writes
# what it measured back to one path, so it runs on a copy): every group of one run of the
# suite splits by the same file. On a CUDA machine what this run measured is merged into
# $GPU_DURATIONS_OUT (default tests/gpu_durations.measured.json, not tracked); after a whole
# pass, move that over tests/gpu_durations.json to rebalance the groups.
split_file=tests/gpu_durations.json
measured=${GPU_DURATIONS_OUT:-tests/gpu_durations.measured.json}
work=$(mktemp /tmp/gpu_durations.XXXXXX.json)
trap 'rm -f "$work"' EXIT
if [ -f "$split_file" ]; then cp "$split_file" "$work"; else echo '{}' > "$work"; fi
args=(-q -m gpu -p no:cacheprovider --durations-path "$work")
if [ "$group" != all ]; then
  args+=(--splits "$splits" --group "$group" --splitting-algorithm duration_based_chunks)
fi
store=0
if "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  store=1  # only measured times: on a CPU machine every test skips
  args+=(--store-durations)
fi
"$PY" -m pytest "${args[@]}" "$@" "${files[@]}"
rc=$?
if [ "$store" = 1 ]; then
  if "$PY" - "$split_file" "$work" "$measured" <<'PYEOF'
import json, os, sys
split_file, work, measured = sys.argv[1:]
def read(path):
    return json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else {}
base, now, out = read(split_file), read(work), read(measured)
out.update({k: v for k, v in now.items() if base.get(k) != v})
with open(measured, "w") as f:
    json.dump(out, f, sort_keys=True, indent=4)
PYEOF
  then :; else
    echo "gpu_tests: could not merge the measured durations into $measured" >&2
    [ "$rc" = 0 ] && rc=1
  fi
fi
exit $rc
