"""Session 32 probe: the host time at the head of the MoE's grouped forward, when the call
starts on an idle GPU (after a sync, as the bench's per-call timing does) and when it starts
with the GPU busy (a ``torch.cuda._sleep`` queued first, so the host runs ahead).

For each case: host microseconds from the call's start to the end of each step of the forward
(the steps called one after another as ``moe_experts_grouped`` does, without autograd), the
whole catalog call (``_lazy`` + ``torch.compiler.disable`` wrapper) and the bare function,
and the forward + backward; medians of REPS calls.

usage: python3 moe_head_probe.py OUT_JSON [--cases e64_k8,e16_k2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from megacpp.kernels.amp import autocast_operands, effective_dtype
from megacpp.kernels.ops.moe import grouped
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import _cotangents, _fwd_bwd

REPS = 30
SLEEP_CYCLES = 20_000_000  # ~10 ms at the H100's clock: the host stays ahead of the GPU


def steps(inp):
    """The forward's steps with a host stamp after each (ns)."""
    stamps = [("start", time.perf_counter_ns())]
    x, idx, wts, w_in, w_out = (inp[k] for k in ("x", "expert_idx", "weights", "w_in", "w_out"))
    (x,) = autocast_operands(x)
    compute = effective_dtype(w_in)
    effective_dtype(w_out)
    stamps.append(("autocast + dtypes", time.perf_counter_ns()))
    ops = grouped._ops(x.device)
    if hasattr(ops, "plan_permute"):  # session 32: the plan's second kernel permutes x
        plan, xs = ops.plan_permute(idx, w_in.shape[0], wts, x)
        stamps.append(("plan + permute", time.perf_counter_ns()))
    else:
        plan = grouped.dispatch_plan(idx, w_in.shape[0], wts)
        stamps.append(("dispatch_plan", time.perf_counter_ns()))
        xs = ops.scatter_rows(x, plan.inv)
        stamps.append(("scatter_rows", time.perf_counter_ns()))
    w_in, w_out = w_in.to(compute), w_out.to(compute)
    stamps.append(("weight casts", time.perf_counter_ns()))
    _, hidden = ops.gate_up_swiglu(xs, w_in, plan.offs, plan.w_sorted)
    stamps.append(("gate|up + SwiGLU GEMM", time.perf_counter_ns()))
    ys = ops.mm(hidden, w_out, plan.offs, True)
    stamps.append(("down GEMM", time.perf_counter_ns()))
    ops.gather_sum(ys, plan.inv)
    stamps.append(("gather_sum", time.perf_counter_ns()))
    return stamps


def run(case: str, out: dict) -> None:
    device = torch.device("cuda")
    cat = default_catalog()
    surface = cat.surface("moe_experts")
    fn = cat.backend("moe_experts", "grouped_mm").fn
    gen = torch.Generator(device=device).manual_seed(0)
    inp = surface.make_inputs(surface.cases[case], torch.bfloat16, device, gen)
    cot = _cotangents(fn, inp)
    for _ in range(3):
        _fwd_bwd(fn, inp, surface.grad_args, cot)
        steps(inp)
    torch.cuda.synchronize()
    res = {}
    for mode in ("idle", "busy"):
        per_step: dict[str, list[float]] = {}
        whole: dict[str, list[float]] = {"catalog fn (fwd)": [], "moe_experts_grouped (fwd)": [],
                                         "fwd+bwd": []}
        for _ in range(REPS):
            for name, call in (("steps", None), ("catalog fn (fwd)", lambda: fn(**inp)),
                               ("moe_experts_grouped (fwd)",
                                lambda: grouped.moe_experts_grouped(**inp)),
                               ("fwd+bwd", lambda: _fwd_bwd(fn, inp, surface.grad_args, cot))):
                torch.cuda.synchronize()
                if mode == "busy":
                    torch.cuda._sleep(SLEEP_CYCLES)
                if call is None:
                    st = steps(inp)
                    for (_, t0), (label, t1) in zip(st, st[1:]):
                        per_step.setdefault(label, []).append((t1 - st[0][1]) / 1e3)
                else:
                    t0 = time.perf_counter_ns()
                    call()
                    whole[name].append((time.perf_counter_ns() - t0) / 1e3)
                torch.cuda.synchronize()
        res[mode] = {"cumulative_us": {k: statistics.median(v) for k, v in per_step.items()},
                     "whole_us": {k: statistics.median(v) for k, v in whole.items()}}
    out[case] = res
    print(f"== {case}: host us from the call's start (median of {REPS}), idle GPU / busy GPU")
    for label in res["idle"]["cumulative_us"]:
        print(f"  {label:28s} {res['idle']['cumulative_us'][label]:8.1f} "
              f"{res['busy']['cumulative_us'][label]:8.1f}")
    for label in res["idle"]["whole_us"]:
        print(f"  {label:28s} {res['idle']['whole_us'][label]:8.1f} "
              f"{res['busy']['whole_us'][label]:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default="e64_k8,e16_k2")
    args = ap.parse_args()
    out: dict = {}
    for case in args.cases.split(","):
        run(case, out)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
