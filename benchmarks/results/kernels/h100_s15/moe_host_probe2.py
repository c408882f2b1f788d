"""MoE host-time probe, second call (dev record, session 15): cProfile of the bench-style
forward+backward with the GPU kept busy, and per-launch host costs (min / median / max of 50).

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s15/moe_host_probe2.py OUT
(The case setup and host timer were merged into moe_host_probe.py after the run; same measure.)
"""

import cProfile
import functools
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from moe_host_probe import bench_case, host_stats  # the sibling record (run 1)

from megacpp.kernels.ops.moe import grouped as G
from megacpp.kernels.registry import _lazy
from megacpp.kernels.timing import _cotangents, _fwd_bwd

OUT = Path(sys.argv[1])
CASE = sys.argv[2] if len(sys.argv) > 2 else "e64_k8"


def host_stats_run2(fn) -> dict:
    return host_stats(fn, reps=50, sleep_cycles=20_000_000)


def main() -> None:
    from megacpp.kernels.ops.moe import triton as K

    dev = torch.device("cuda")
    backend, inp, grads = bench_case(CASE)
    cot = _cotangents(backend.fn, inp)
    x, idx, w, w_in = inp["x"], inp["expert_idx"], inp["weights"], inp["w_in"]
    plan = G.dispatch_plan(idx, w_in.shape[0], w)
    xs = K.scatter_rows_triton(x.detach(), plan.inv)
    gu = torch._grouped_mm(xs, w_in.detach().transpose(-2, -1), offs=plan.offs)
    noop = _lazy("math", "fabs")
    res = {}
    for name, fn in {
        "fwd_bwd": lambda: _fwd_bwd(backend.fn, inp, grads, cot),
        "dispatch_plan": lambda: G.dispatch_plan(idx, w_in.shape[0], w),
        "scatter_rows": lambda: K.scatter_rows_triton(x.detach(), plan.inv),
        "swiglu": lambda: K.swiglu_weighted_triton(gu, plan.w_sorted),
        "gather_sum": lambda: K.gather_sum_triton(xs, plan.inv),
        "lazy no-op (disable + import)": lambda: noop(1.0),
        "torch.compiler.disable no-op": functools.partial(torch.compiler.disable(abs), 1.0),
        "x.detach()": lambda: x.detach(),
        "torch.empty 256 MB": lambda: torch.empty(xs.shape, device=dev, dtype=xs.dtype),
    }.items():
        res[name] = host_stats_run2(fn)
        print(name, res[name], flush=True)
    # back-to-back launches of one kernel (no sleep between): the steady launch cost
    for name, fn in {"swiglu x20": lambda: K.swiglu_weighted_triton(gu, plan.w_sorted),
                     "gather_sum x20": lambda: K.gather_sum_triton(xs, plan.inv)}.items():
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        res[name + " (per launch)"] = (time.perf_counter() - t0) * 1e6 / 20
        torch.cuda.synchronize()
        print(name, res[name + " (per launch)"], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"moe_host_probe2_{CASE}.json").write_text(json.dumps(res, indent=1))

    prof = cProfile.Profile()
    for _ in range(20):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        prof.enable()
        _fwd_bwd(backend.fn, inp, grads, cot)
        prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    (OUT / f"moe_cprofile_{CASE}.txt").write_text(s.getvalue())
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
