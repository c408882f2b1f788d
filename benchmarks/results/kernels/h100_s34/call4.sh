#!/usr/bin/env bash
# Session 34, call 4: the wheels scripts/peer_wheels.sh builds, on the GPU machine. Installs
# .whl as the call scripts do, imports every package in it, lists the catalog (every donor row
# should qualify), and runs `megacpp kernels check` on the surfaces with donor peers (each
# qualifying backend, the peers included, against the float64 reference).
#   usage: bash benchmarks/results/kernels/h100_s34/call4.sh   (carrying .whl)
set -u
D=$OUT/call4; mkdir -p $D
python3 --version
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
python3 - <<'PY' 2>&1 | tee $D/imports.log
import importlib
for name in ("liger_kernel", "fla", "einops", "pytest_split", "datasketch", "tree_sitter",
             "tree_sitter_cpp", "scipy"):
    try:
        mod = importlib.import_module(name)
        print(name, "ok", getattr(mod, "__version__", ""))
    except Exception as exc:
        print(name, "FAILED", type(exc).__name__, exc)
from megacpp.kernels.peers import _mamba3_siso_module
print("mamba_ssm mamba3_siso_combined ok", _mamba3_siso_module().__name__)
PY
python3 -m megacpp kernels list --json > $D/kernels_list.json 2> $D/kernels_list.err
echo "kernels list exit $?"
python3 - $D/kernels_list.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows.get("backends", rows) if isinstance(rows, dict) else rows
for r in rows:
    if r.get("role") == "donor":
        print(r.get("surface"), r.get("backend") or r.get("name"), "qualifies:", r.get("qualifies", r.get("here")))
PY
timeout 400 python3 -m megacpp kernels check -s mamba3_scan -s gated_delta \
  -s linear_cross_entropy -s rmsnorm > $D/kernels_check.log 2>&1
echo "kernels check exit $?"; tail -40 $D/kernels_check.log
