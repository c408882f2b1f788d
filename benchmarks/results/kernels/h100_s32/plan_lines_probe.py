"""Session 32 probe: host time of each line of ``plan_triton`` and ``_grouped_mm`` (their bodies
copied here with a stamp after each line), called on an idle GPU after a sync, median of 50.

usage: python3 plan_lines_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from megacpp.kernels.ops.moe import grouped
from megacpp.kernels.ops.moe import triton as mk
from megacpp.kernels.registry import default_catalog


def plan_lines(expert_idx, weights, n_experts):
    s = [time.perf_counter_ns()]
    n = expert_idx.numel()
    ids, w = expert_idx.reshape(-1), weights.detach().reshape(-1)
    ids, w = ids.contiguous(), w.contiguous()
    s.append(time.perf_counter_ns())
    e_pad = max(16, triton.next_power_of_2(n_experts))
    sub = min(mk.PLAN_BLOCK, max(16, 8192 // e_pad))
    n_blocks = triton.cdiv(n, mk.PLAN_BLOCK)
    s.append(time.perf_counter_ns())
    idx64 = torch.empty(2, n, device=ids.device, dtype=torch.int64)
    buf32 = torch.empty(n_blocks * e_pad + e_pad, device=ids.device, dtype=torch.int32)
    counts, offs = buf32[: n_blocks * e_pad], buf32[n_blocks * e_pad:][:n_experts]
    w_sorted = torch.empty(n, device=ids.device, dtype=torch.float32)
    s.append(time.perf_counter_ns())
    mk._expert_counts_kernel[(n_blocks,)](ids, counts, n, E_PAD=e_pad, BLOCK=mk.PLAN_BLOCK,
                                          SUB=sub, num_warps=4)
    s.append(time.perf_counter_ns())
    mk._plan_scatter_kernel[(n_blocks,)](
        ids, w, counts, idx64[0], idx64[1], w_sorted, offs, n, n_blocks, n_experts, E_PAD=e_pad,
        BLOCK=mk.PLAN_BLOCK, SUB=sub, RB=max(1, 4096 // e_pad), NB_CONST=mk._const(n_blocks),
        num_warps=4)
    s.append(time.perf_counter_ns())
    r = idx64[0], idx64[1].view(expert_idx.shape), offs, w_sorted
    s.append(time.perf_counter_ns())
    return s, r


def gemm_lines(a, w, offs, w_sorted):
    s = [time.perf_counter_ns()]
    cfg = mk.SWIGLU_CONFIGS[(w.shape[1], a.shape[1])]
    ok = mk.grouped_swiglu_ok(a, w)
    s.append(time.perf_counter_ns())
    a, w = a.contiguous(), w.contiguous()
    rows, k = a.shape
    experts = w.shape[0]
    n = w.shape[1]
    out = torch.empty(rows, n, device=a.device, dtype=a.dtype)
    hidden = torch.empty(rows, n // 2, device=a.device, dtype=a.dtype)
    s.append(time.perf_counter_ns())
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    da = TensorDescriptor.from_tensor(a, [bm, bk])
    dw = TensorDescriptor.from_tensor(w, [1, bn, bk])
    s.append(time.perf_counter_ns())
    grid = (triton.cdiv(n // 2, bn) * (triton.cdiv(rows, bm) + experts),)
    mk._grouped_mm_kernel[grid](
        da, dw, out, offs, w_sorted, hidden, experts, n, k, out.stride(0), hidden.stride(0),
        TRANS_B=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        E_PAD=max(16, triton.next_power_of_2(experts)), SWIGLU=True,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    s.append(time.perf_counter_ns())
    return s, ok


def report(name, labels, runs):
    print(name)
    for i, label in enumerate(labels):
        d = statistics.median((r[i + 1] - r[i]) / 1e3 for r in runs)
        print(f"  {label:40s} {d:7.1f} us")


def main():
    dev = torch.device("cuda")
    cat = default_catalog()
    surface = cat.surface("moe_experts")
    gen = torch.Generator(device=dev).manual_seed(0)
    inp = surface.make_inputs(surface.cases["e64_k8"], torch.bfloat16, dev, gen)
    idx, wts, w_in = inp["expert_idx"], inp["weights"], inp["w_in"]
    plan = grouped.dispatch_plan(idx, 64, wts)
    xs = mk.scatter_rows_triton(inp["x"], plan.inv)
    runs_p, runs_g, runs_d = [], [], []
    for i in range(53):
        torch.cuda.synchronize()
        sp, _ = plan_lines(idx, wts, 64)
        torch.cuda.synchronize()
        sg, _ = gemm_lines(xs, w_in, plan.offs, plan.w_sorted)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        grouped.dispatch_plan(idx, 64, wts)
        t1 = time.perf_counter_ns()
        if i >= 3:
            runs_p.append(sp)
            runs_g.append(sg)
            runs_d.append([t0, t1])
    report("plan_triton (idle GPU)", ["reshape + contiguous", "sizes", "3 x empty + views",
                                      "_expert_counts_kernel launch",
                                      "_plan_scatter_kernel launch", "returned views"], runs_p)
    report("dispatch_plan as called", ["whole"], runs_d)
    report("gate|up GEMM (idle GPU)", ["config + grouped_swiglu_ok", "contiguous + 2 x empty",
                                       "2 x TensorDescriptor", "launch"], runs_g)


if __name__ == "__main__":
    main()
