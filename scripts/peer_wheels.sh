#!/usr/bin/env bash
# Fill .whl/ with the wheels the GPU machine needs and cannot download (it has no network): the
# peers the kernel bench measures against (mamba_ssm, Liger, fla), pytest-split for
# scripts/gpu_tests.sh, torchao for FP8 training (parallel.float8), and the pure-Python /
# binary packages megacpp imports that its image lacks. Carry .whl to the machine; scripts/gpu_tests.sh and the call scripts under
# benchmarks/results install it with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#
#   usage: bash scripts/peer_wheels.sh [PYTHON_VERSION]   (the GPU machine's Python, default 3.12)
#
# torch, triton and numpy are the machine's own and are not fetched. mamba_ssm has no wheel on
# PyPI: its sdist is built here as a pure-Python wheel (MAMBA_SKIP_CUDA_BUILD; its Mamba-3 SISO
# op is plain Triton, and megacpp.kernels.peers imports it without the package __init__),
# which needs torch installed here (run scripts/setup.sh first). Idempotent: a wheel already in
# .whl/ is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

PYV=${1:-3.12}
[[ "$PYV" =~ ^3\.[0-9]+$ ]] || { echo "peer_wheels: Python version like 3.12, got '$PYV'" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "peer_wheels: no $PY (run scripts/setup.sh first)" >&2; exit 1; }
log() { printf '\033[1;34m[peer_wheels]\033[0m %s\n' "$*" >&2; }
mkdir -p .whl

# the peers pinned to the versions the committed bench rows and receipts were measured with;
# megacpp's own imports at the versions its CPU CI resolves
PURE=(liger-kernel==0.8.5 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
      pytest-split==0.11.0 datasketch==2.0.0)
# torchao: parallel.float8 (abi3 wheel with CUDA extensions; 0.18 loads them on torch >= 2.11)
BINARY=(tree-sitter==0.26.1 tree-sitter-cpp==0.23.4 torchao==0.18.0)

log "pure-Python wheels: ${PURE[*]}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  -d .whl "${PURE[@]}" 2> >(grep -v "is ignored" >&2)
log "binary wheels for CPython $PYV, manylinux x86_64: ${BINARY[*]}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYV" --implementation cp --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl "${BINARY[@]}" 2> >(grep -v "is ignored" >&2)

if ! compgen -G ".whl/mamba_ssm-2.3.2.post1-*.whl" >/dev/null; then
  log "mamba_ssm 2.3.2.post1: building a pure-Python wheel from its sdist"
  "$PY" -m pip install -q --disable-pip-version-check wheel 2> >(grep -v "is ignored" >&2)
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$PY" -m pip wheel -q \
    --disable-pip-version-check --no-deps --no-build-isolation -w .whl mamba-ssm==2.3.2.post1 \
    2> >(grep -v "is ignored" >&2)
fi
# mamba_ssm's Mamba-3 MIMO op is TileLang: the versions its metadata pins (tilelang 0.1.15
# fails to lower its kernels). Opt-in (MIMO_PEER=1): together 76 MB, over one call's 64 MiB
# carry, so they land in two folders to carry in two calls of one warm machine and install
# together after the second: .whl-mimo/a (tilelang), .whl-mimo/b (its compiled dependencies).
if [ "${MIMO_PEER:-0}" = 1 ]; then
  log "mamba_ssm MIMO peer (TileLang) wheels into .whl-mimo/a and .whl-mimo/b"
  mkdir -p .whl-mimo/a .whl-mimo/b
  for spec in "a tilelang==0.1.8" "b apache-tvm-ffi==0.1.9" "b z3-solver==4.15.4.0" \
              "b torch-c-dlpack-ext==0.1.5"; do
    set -- $spec
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$PYV" --implementation cp --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
      -d ".whl-mimo/$1" "$2" 2> >(grep -v "is ignored" >&2)
  done
fi
# TRL's GRPOTrainer, the peer of `megacpp posttrain grpo` (benchmarks/grpo_trl.py): opt-in
# (TRL_PEER=1), into .whl-trl; the GPU image has transformers, accelerate, pandas and pyarrow
# but not these. Install them into their own --target so the GPU suite's site stays as is.
if [ "${TRL_PEER:-0}" = 1 ]; then
  log "TRL peer wheels into .whl-trl"
  mkdir -p .whl-trl
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYV" --implementation cp --platform manylinux2014_x86_64 \
    -d .whl-trl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    2> >(grep -v "is ignored" >&2)
fi
log "ready: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
ls .whl >&2
