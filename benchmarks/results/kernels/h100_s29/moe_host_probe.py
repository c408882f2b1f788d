"""Session 29 probe: the host cost of each step of the MoE's grouped forward and backward.

Each step is called ``REPS`` times back to back without a sync (the GPU falls behind, so the
wall time per call is the host's), at the e64_k8 bench case, after a warm-up; plus the host
cost of the pieces a Triton launch is made of (a trivial kernel, a tensor descriptor, the
capability check) and of one whole forward and backward.

usage: python3 moe_host_probe.py OUT_JSON [--case e64_k8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from megacpp.kernels.ops.moe import grouped
from megacpp.kernels.ops.moe import triton as mk
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import _cotangents, _differentiable

REPS = 200


@triton.jit
def _noop(X, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i, mask=i < n), mask=i < n)


def host_us(fn, reps: int = REPS) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--case", default="e64_k8")
    args = ap.parse_args()
    device = torch.device("cuda")
    surface = default_catalog().surface("moe_experts")
    fn = default_catalog().backend("moe_experts", "grouped_mm").fn
    gen = torch.Generator(device=device).manual_seed(0)
    inp = surface.make_inputs(surface.cases[args.case], torch.bfloat16, device, gen)
    x, idx, wts, w_in, w_out = (inp[k] for k in ("x", "expert_idx", "weights", "w_in", "w_out"))
    e = w_in.shape[0]
    plan = grouped.dispatch_plan(idx, e, wts)
    xs = mk.scatter_rows_triton(x, plan.inv)
    gu, hid = mk.grouped_swiglu_triton(xs, w_in, plan.offs, plan.w_sorted)
    ys = grouped.grouped_mm_torch(hid, w_out, plan.offs, True)
    small = torch.zeros(1024, device=device)
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = {
        "triton noop kernel (3 args)": lambda: _noop[(1,)](small, 1024, BLOCK=1024),
        "torch.empty [N, D]": lambda: torch.empty(xs.shape, device=device, dtype=xs.dtype),
        "torch add_ (one aten op)": lambda: small.add_(1),
        "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(xs, [128, 64]),
        "get_device_capability": lambda: torch.cuda.get_device_capability(device),
        "_ops(device)": lambda: grouped._ops(device),
        "dispatch_plan (2 launches)": lambda: grouped.dispatch_plan(idx, e, wts),
        "scatter_rows_triton": lambda: mk.scatter_rows_triton(x, plan.inv),
        "grouped_swiglu_triton": lambda: mk.grouped_swiglu_triton(xs, w_in, plan.offs,
                                                                  plan.w_sorted),
        "torch._grouped_mm (down)": lambda: grouped.grouped_mm_torch(hid, w_out, plan.offs, True),
        "gather_sum_triton": lambda: mk.gather_sum_triton(ys, plan.inv),
        "forward (moe_experts_grouped)": lambda: fn(**inp),
    }
    out = {}
    for name, f in rows.items():
        out[name] = host_us(f, 50 if name.startswith("forward") else REPS)
        print(f"{name:40s} {out[name]:8.1f} us host per call", flush=True)
    cot = _cotangents(fn, inp)

    def fwd_bwd():
        outs = _differentiable(fn(**inp))
        torch.autograd.grad(outs, [inp[n] for n in surface.grad_args], grad_outputs=cot)

    out["forward + backward"] = host_us(fwd_bwd, 50)
    print(f"{'forward + backward':40s} {out['forward + backward']:8.1f} us host per call")
    args.out.write_text(json.dumps({"case": args.case, "host_us": out}, indent=1))
    # where the forward + backward's host time goes, by Python function (cProfile, 50 calls)
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
