"""The MoE's SwiGLU fused into its grouped GEMMs, against the separate kernels, at the nam56r
step's shape (16384 tokens, 16 experts top-2, d 768, ffn 272) and the bench's e64_k8 (64 top-8,
d 1024, ffn 512) and e16_k2 (16 top-2, d 1024, ffn 2048), for a few launch settings:

* backward: d hidden with the SwiGLU's backward in its epilogue (grouped_dswiglu_triton)
  against the tree's path (the d-hidden GEMM -- Triton where GROUPED_CONFIGS serves it, else
  torch._grouped_mm -- then swiglu_weighted_backward_triton);
* forward (bench shapes; the step's is already fused): gate|up with the SwiGLU in its
  epilogue (grouped_swiglu_triton) against torch._grouped_mm / the Triton GEMM then
  swiglu_weighted_triton.

Results are checked against the separate path (max |diff| / max |ref|). Time: 20 calls back to
back between two CUDA events, the median of 5 such runs. Writes OUT.json and a bench receipt
next to it. Session 23.

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s23/swiglu_fusion_probe.py OUT.json
"""

import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

from megacpp.kernels.ops.moe import triton as K
from megacpp.kernels.ops.moe.grouped import dispatch_plan, grouped_mm_torch
from megacpp.receipts import write_receipt

SHAPES = {  # name -> tokens, d, experts, top_k, ffn
    "step": (16384, 768, 16, 2, 272),
    "e64_k8": (16384, 1024, 64, 8, 512),
    "e16_k2": (16384, 1024, 16, 2, 2048),
}
BWD = [  # d hidden + SwiGLU backward: the (BLOCK_N, warps, stages) tried at BLOCK_M 128, BLOCK_K 64
    (64, 8, 3), (64, 8, 4), (32, 4, 3), (32, 4, 4), (32, 8, 3),
]
FWD = [(64, 8, 3), (128, 8, 3), (64, 8, 4), (128, 8, 4)]  # gate|up + SwiGLU: hidden columns


def cfg(bn, warps, stages, bm=128):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "num_warps": warps, "num_stages": stages}


def timed_us(fn) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(begin.elapsed_time(end) / 20 * 1e3)
    return statistics.median(runs)


def diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def mm(a, w, offs, trans_b):
    fn = K.grouped_mm_triton if K.grouped_mm_ok(a, w, trans_b) else grouped_mm_torch
    return fn(a, w, offs, trans_b)


def separate_bwd(dy, w_out, offs, gate_up, w_sorted, order):
    dh = mm(dy, w_out, offs, False)
    return K.swiglu_weighted_backward_triton(gate_up, w_sorted, dh, order, torch.float32)


def separate_fwd(x_sorted, w_in, offs, w_sorted):
    gate_up = mm(x_sorted, w_in, offs, True)
    return gate_up, K.swiglu_weighted_triton(gate_up, w_sorted)


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    rows, metrics = [], {}

    def say(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name, (tokens, d, experts, top_k, ffn) in SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        idx = torch.rand(tokens, experts, device=dev, generator=gen).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device=dev, generator=gen) + 0.1
        plan = dispatch_plan(idx, experts, weights)
        n = tokens * top_k
        x_sorted = torch.randn(n, d, device=dev, generator=gen).bfloat16()
        dy = torch.randn(n, d, device=dev, generator=gen).bfloat16()
        w_in = (torch.randn(experts, 2 * ffn, d, device=dev, generator=gen) * d**-0.5).bfloat16()
        w_out = (torch.randn(experts, d, ffn, device=dev, generator=gen) * ffn**-0.5).bfloat16()
        fwd_args = (x_sorted, w_in, plan.offs, plan.w_sorted)
        gate_up, _ = separate_fwd(*fwd_args)
        bwd_args = (dy, w_out, plan.offs, gate_up, plan.w_sorted, plan.order)
        base = timed_us(partial(separate_bwd, *bwd_args))
        say({"shape": name, "what": "bwd separate", "us": round(base, 2),
             "gemm": "triton" if K.grouped_mm_ok(dy, w_out, False) else "torch"})
        metrics[f"{name}/bwd_separate_us"] = base
        want = separate_bwd(*bwd_args)
        saved = dict(K.DSWIGLU_CONFIGS)
        try:
            for bn, warps, stages in BWD:
                K.DSWIGLU_CONFIGS[(ffn, d)] = cfg(bn, warps, stages)
                got = K.grouped_dswiglu_triton(*bwd_args, torch.float32)
                us = timed_us(partial(K.grouped_dswiglu_triton, *bwd_args, torch.float32))
                say({"shape": name, "what": "bwd fused", "config": [bn, warps, stages],
                     "us": round(us, 2), "err_dgate_up": diff(got[0], want[0]),
                     "err_dweights": diff(got[1], want[1])})
                metrics[f"{name}/bwd_fused_n{bn}_w{warps}_s{stages}_us"] = us
        finally:
            K.DSWIGLU_CONFIGS.clear()
            K.DSWIGLU_CONFIGS.update(saved)
        if name == "step":
            continue
        base = timed_us(partial(separate_fwd, *fwd_args))
        say({"shape": name, "what": "fwd separate", "us": round(base, 2),
             "gemm": "triton" if K.grouped_mm_ok(x_sorted, w_in, True) else "torch"})
        metrics[f"{name}/fwd_separate_us"] = base
        want = separate_fwd(*fwd_args)
        saved = dict(K.SWIGLU_CONFIGS)
        try:
            for bn, warps, stages in FWD:
                K.SWIGLU_CONFIGS[(2 * ffn, d)] = cfg(bn, warps, stages)
                got = K.grouped_swiglu_triton(*fwd_args)
                us = timed_us(partial(K.grouped_swiglu_triton, *fwd_args))
                say({"shape": name, "what": "fwd fused", "config": [bn, warps, stages],
                     "us": round(us, 2), "err_gate_up": diff(got[0], want[0]),
                     "err_hidden": diff(got[1], want[1])})
                metrics[f"{name}/fwd_fused_n{bn}_w{warps}_s{stages}_us"] = us
        finally:
            K.SWIGLU_CONFIGS.clear()
            K.SWIGLU_CONFIGS.update(saved)
        del x_sorted, dy, gate_up, want, got
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s23/swiglu_fusion_probe.py",
                   "dtype": "bfloat16"}, metrics, [out])


if __name__ == "__main__":
    main()
