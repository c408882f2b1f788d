#!/usr/bin/env bash
# The quality benchmark (docs/quality.md) in two GPU calls of at most 9.5 minutes each on one
# 4-GPU machine, run back to back:
#   call 1:  OUT=$OUT bash benchmarks/quality_calls.sh 1   corpus build + learning-rate sweep
#   call 2:  OUT=$OUT bash benchmarks/quality_calls.sh 2   final runs + HumanEval-X sampling
#                                                         (+ scoring where the toolchain is) + report
# Carry .device-carry/quality (benchmarks/quality_corpus.py pack, ~39 MiB) and the wheels of
# scripts/peer_wheels.sh that the data build needs (datasketch, tree-sitter, tree-sitter-cpp;
# WHEELS names their folder, default .whl) in both calls: with the repository they must stay
# under the 64 MiB that travel.
# Between the calls, unpack call 1's quality-call1.tgz and put its out/sweep.json at
# benchmarks/results/quality/h100/sweep.json: call 2 uses it when the machine it gets is a
# fresh one (its own copy of call 1's outputs gone); it then rebuilds the corpus first and
# trains for MINUTES_AFTER_REBUILD instead of MINUTES.
# Knobs (environment): MINUTES (4.5), SWEEP_MINUTES (2), MINUTES_AFTER_REBUILD (3), DEADLINE
# (seconds the whole call may take, 555).
set -uo pipefail
cd "$(dirname "$0")/.."
CALL=${1:?usage: OUT=DIR bash benchmarks/quality_calls.sh 1|2}
OUT=${OUT:?set OUT to the device output folder}
MINUTES=${MINUTES:-4.5}
SWEEP_MINUTES=${SWEEP_MINUTES:-2}
DEADLINE=${DEADLINE:-555}
W=.device-carry/quality-run  # ignored: kept between back-to-back calls on the same machine
DATA=$W/data/quality
START=$SECONDS

WHEELS=${WHEELS:-.whl}  # only datasketch, tree-sitter and tree-sitter-cpp are needed here
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl 2>&1 | tail -2
export PYTHONPATH=src:/tmp/site
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader

build_corpus() {
  local torch_include
  torch_include=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
  timeout 300 python3 benchmarks/quality_corpus.py build --carry .device-carry/quality \
      --out "$DATA" --workers $(( $(nproc) - 4 )) --extra "torch-include=$torch_include" \
      2>&1 | grep -v '^\s*$' | tail -30
  cp "$W"/data/quality_build_report.json "$W"/data/quality_corpus_manifest.json "$OUT"/ 2>/dev/null
  [ -f "$DATA/_COMPLETE" ] || { echo "error: the corpus build failed"; exit 1; }
}

left() { echo $(( DEADLINE - (SECONDS - START) )); }
PROBLEMS=.device-carry/quality/humaneval-x-cpp.jsonl.gz  # copied there by quality_corpus.py pack

case $CALL in
  1)
    build_corpus
    python3 benchmarks/quality.py --data "$DATA" --out "$W/out" --work "$W/work" \
        --phases sweep report --minutes "$MINUTES" --sweep-minutes "$SWEEP_MINUTES" \
        --grace-s 90 --deadline-s "$(left)" --bundle "$OUT/quality-call1.tgz"
    ;;
  2)
    if [ ! -f "$DATA/_COMPLETE" ]; then
      echo "call 1's dataset is not on this machine (a fresh one): rebuilding the corpus"
      build_corpus
      MINUTES=${MINUTES_AFTER_REBUILD:-3}
    fi
    SWEEP=benchmarks/results/quality/h100/sweep.json
    [ -f "$W/out/sweep.json" ] && SWEEP=$W/out/sweep.json
    python3 benchmarks/quality.py --data "$DATA" --out "$W/out" --work "$W/work" \
        --phases final sample score report --minutes "$MINUTES" \
        --sweep-minutes "$SWEEP_MINUTES" --sweep-json "$SWEEP" \
        --grace-s 90 --deadline-s "$(left)" --problems "$PROBLEMS" --bundle "$OUT/quality.tgz"
    ;;
  *) echo "usage: OUT=DIR bash benchmarks/quality_calls.sh 1|2" >&2; exit 2 ;;
esac
echo "call $CALL took $(( SECONDS - START )) s"
