#!/usr/bin/env bash
# Session 29, third device call (carry .whl): FlashAttention's varlen kernels for the document
# attention of packed rows against the flex row and the causal kernel (varlen_probe.py); which
# varlen API torch has here.   usage: bash benchmarks/results/kernels/h100_s29/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s29_call3; mkdir -p $D
python3 -c "
import inspect, torch
print(torch.__version__)
try:
    import torch.nn.attention.varlen as m; print(inspect.signature(m.varlen_attn))
except Exception as e: print('no varlen module:', e)
print(torch.ops.aten._flash_attention_forward.default._schema)
print(torch.ops.aten._flash_attention_backward.default._schema)
" 2>&1 | tee $D/api.log
PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 400 python3 benchmarks/results/kernels/h100_s29/varlen_probe.py \
    $D/varlen_probe.json > $D/varlen_probe.log 2>&1; grep -v -i warn $D/varlen_probe.log | tail -30
tar czf "$OUT/s29_call3.tgz" -C /tmp s29_call3
