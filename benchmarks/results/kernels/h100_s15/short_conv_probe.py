"""short_conv launch-shape probe (dev record, session 15): CUDA-graph replay of the Triton
forward+backward at the nam56r case for several (tokens, channels, warps) per program, with the
torch.compile donor in the same process.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s15/short_conv_probe.py OUT \
        [loop]
"""

import json
import sys

import torch

from megacpp.kernels.ops.short_conv import triton as K
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import time_fwd_bwd_graphed

catalog, dev = default_catalog(), torch.device("cuda")
surface = catalog.surface("short_conv")
inp = surface.make_inputs(surface.cases["nam56r"], torch.bfloat16, dev,
                          torch.Generator(device=dev).manual_seed(0))
rows = []
peer = catalog.backend("short_conv", "torch_compile").fn
rows.append({"backend": "torch_compile",
             "replay_ms": time_fwd_bwd_graphed(peer, inp, surface.grad_args, dev).median_ms})
print(json.dumps(rows[-1]), flush=True)
SHAPES = ((32, 128, 4), (64, 128, 4), (64, 64, 4), (16, 256, 4), (32, 256, 8), (64, 128, 8),
          (128, 64, 4))  # run 10 (two-pass backward at deec526)
if len(sys.argv) > 2:  # run 11: with _short_conv_dacc looping over DACC_BLOCKS token blocks
    SHAPES = tuple((bt, bc, w, tpp) for bt, bc, w in ((32, 128, 4), (64, 64, 4), (32, 64, 4))
                   for tpp in (1, 4, 8))
for bt, bc, warps, *tpp in SHAPES:
    K.BLOCK_T, K.BLOCK_C, K.NUM_WARPS = bt, bc, warps
    if tpp:
        K.DACC_BLOCKS = tpp[0]
    ms = time_fwd_bwd_graphed(K.short_conv_triton, inp, surface.grad_args, dev).median_ms
    rows.append({"backend": "triton", "BT": bt, "BC": bc, "warps": warps,
                 "dacc_blocks": K.DACC_BLOCKS if tpp else None, "replay_ms": ms})
    print(json.dumps(rows[-1]), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
