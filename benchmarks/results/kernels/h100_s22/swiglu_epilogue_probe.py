"""The MoE's gate|up GEMM with the weighted SwiGLU in its epilogue (grouped_swiglu_triton)
against the GEMM then the SwiGLU kernel (grouped_mm_triton + swiglu_weighted_triton), at the
nam56r step's shape (16384 tokens, 16 experts top-2, d 768, ffn 272), for a few launch
settings of the fused kernel (hidden columns per program, warps, stages); results checked
against the two-kernel path (max |diff| / max |ref| of gate|up and hidden). Time: 50 calls
back to back between two CUDA events, the median of 5 such runs. Session 22.

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s22/swiglu_epilogue_probe.py OUT.json
"""

import json
import statistics
import sys
from functools import partial

import torch

from megacpp.kernels.ops.moe import triton as K
from megacpp.kernels.ops.moe.grouped import dispatch_plan

SETTINGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
]


def timed_us(fn) -> float:
    for _ in range(5):
        fn()
    runs = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(begin.elapsed_time(end) / 50 * 1e3)
    return statistics.median(runs)


def diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def two_kernels(x_sorted, w_in, offs, w_sorted):
    gate_up = K.grouped_mm_triton(x_sorted, w_in, offs, True)
    return gate_up, K.swiglu_weighted_triton(gate_up, w_sorted)


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    tokens, d, experts, top_k, ffn = 16384, 768, 16, 2, 272
    idx = torch.randn(tokens, experts, device=dev, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=dev, generator=gen) + 0.1
    plan = dispatch_plan(idx, experts, weights)
    x = torch.randn(tokens, d, device=dev, generator=gen).bfloat16()
    x_sorted = K.scatter_rows_triton(x, plan.inv)
    w_in = (torch.randn(experts, 2 * ffn, d, device=dev, generator=gen) * 0.05).bfloat16()
    args = (x_sorted, w_in, plan.offs, plan.w_sorted)
    rows = [{"what": "gemm+swiglu", "config": K.GROUPED_CONFIGS[(2 * ffn, d)],
             "us": round(timed_us(partial(two_kernels, *args)), 2)},
            {"what": "gemm", "config": K.GROUPED_CONFIGS[(2 * ffn, d)],
             "us": round(timed_us(partial(K.grouped_mm_triton, *args[:3], True)), 2)}]
    print(json.dumps(rows[0]), json.dumps(rows[1]), sep="\n", flush=True)
    want = two_kernels(*args)
    saved = dict(K.SWIGLU_CONFIGS)
    try:
        for cfg in SETTINGS:
            K.SWIGLU_CONFIGS[(2 * ffn, d)] = cfg
            got = K.grouped_swiglu_triton(*args)
            rows.append({"what": "fused", "config": cfg,
                         "us": round(timed_us(partial(K.grouped_swiglu_triton, *args)), 2),
                         "err_gate_up": diff(got[0], want[0]), "err_hidden": diff(got[1], want[1])})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        K.SWIGLU_CONFIGS.clear()
        K.SWIGLU_CONFIGS.update(saved)
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
