"""Mamba-3 _group_sum probe (dev record, session 15): the parent's kernel (split half-rows,
2-byte interleaved stores) against this tree's (whole head rows, one interleaved row store),
at the nam56r-350m step shape (B 8, L 2048, 24 heads of d_state 64) and the bench shape
(B 8, L 4096, 32 heads of d_state 128), over rows per program and warps.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s15/group_sum_probe.py \
        OLD_TRITON_PY OUT_JSON
OLD_TRITON_PY: the parent tree's src/megacpp/kernels/ops/mamba3_scan/triton.py.
"""

import importlib.util
import json
import statistics
import sys

import torch
import triton

from megacpp.kernels.ops.mamba3_scan import triton as new
from megacpp.kernels.timing import cuda_times_ms

spec = importlib.util.spec_from_file_location("old_mamba3_triton", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
rows = []
for B, L, H, N in ((8, 2048, 24, 64), (8, 4096, 32, 128)):
    n2b = N // 2
    dqh = torch.randn(B, L, H, 2 * n2b, device="cuda").to(torch.bfloat16)
    dkh = torch.randn_like(dqh)
    n_rows = B * L
    moved = 2 * (dqh.numel() * 2 + n_rows * N * 2)
    ref = None
    for name, mod in (("old", old), ("new", new)):
        for rows_per, warps in ((4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (32, 8)):
            dq = torch.empty(n_rows, N, device="cuda", dtype=torch.bfloat16)
            dk = torch.empty_like(dq)

            grid = (triton.cdiv(n_rows, rows_per),)
            args = (dqh, dkh, dq, dk, n_rows, H, N)
            meta = {"ROWS": rows_per, "HGP": triton.next_power_of_2(H), "N2B": n2b,
                    "num_warps": warps}

            def launch(kernel=mod._group_sum, grid=grid, args=args, meta=meta):
                for _ in range(10):
                    kernel[grid](*args, **meta)

            us = statistics.median(cuda_times_ms(launch, warmup=2, iters=20)) * 100
            if ref is None:
                ref = dq.float().clone()
            row = {"shape": [B, L, H, N], "kernel": name, "rows": rows_per, "warps": warps,
                   "us": us, "TB/s": moved / us / 1e6,
                   "max_diff_vs_first": float((dq.float() - ref).abs().max())}
            rows.append(row)
            print(json.dumps(row), flush=True)
with open(sys.argv[2], "w") as f:
    json.dump(rows, f, indent=1)
