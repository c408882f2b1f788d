"""MoE per-call probe (dev record, session 15): where does a bench-style forward+backward of the
grouped experts lose time to the host, at the moe_experts bench cases of the kernel registry?

    PYTHONPATH=$PWD/src:$PWD python benchmarks/results/kernels/h100_s15/moe_host_probe.py [OUT]

(a) per call (time_fwd_bwd, as benchmarks/kernels.py), pipelined (10 back to back / 10) and
    CUDA-graph replay, in one process;
(b) host time to enqueue each step while the GPU is kept busy (torch.cuda._sleep first, so no
    launch waits), median of 30: the whole fwd+bwd, the forward, the backward, and each step
    of the forward on its own;
(c) one per-call fwd+bwd under torch.profiler (CPU + CUDA): every kernel's launch (host) and
    start (GPU) relative to the first, and the GPU's idle gaps (> 3 us) with the kernel that
    ended each gap, so a gap is attributed to the host work before that kernel's launch.
One JSON line per result; all to OUT/moe_host_probe.json (OUT: argv[1], else $OUT, else /tmp).
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from megacpp.kernels.ops.moe import grouped as G
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import (
    _cotangents,
    _fwd_bwd,
    cuda_times_ms,
    time_fwd_bwd,
    time_fwd_bwd_graphed,
)

CASES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["e64_k8", "e16_k2"]
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT") or "/tmp")
rows: list[dict] = []


def say(row: dict) -> None:
    print(json.dumps(row), flush=True)
    rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "moe_host_probe.json").write_text(json.dumps(rows, indent=1))


def host_stats(fn, reps: int = 30, sleep_cycles: int = 50_000_000) -> dict[str, float]:
    """Host time (us: min, median, max of ``reps``) of ``fn`` while the GPU is busy with a long
    sleep (run 1: 50M cycles, ~25-35 ms; run 2: 20M), so no launch below waits."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def host_us(fn) -> float:
    return host_stats(fn)["median"]


def bench_case(case: str):
    """The grouped_mm backend and fresh bench inputs of one moe_experts case (seed 0)."""
    catalog, dev = default_catalog(), torch.device("cuda")
    surface = catalog.surface("moe_experts")
    gen = torch.Generator(device=dev).manual_seed(0)
    inp = surface.make_inputs(surface.cases[case], torch.bfloat16, dev, gen)
    return catalog.backend("moe_experts", "grouped_mm"), inp, surface.grad_args


def probe(case: str) -> None:
    from megacpp.kernels.ops.moe import triton as K

    dev = torch.device("cuda")
    backend, inp, grads = bench_case(case)
    t = time_fwd_bwd(backend.fn, inp, grads, dev, repeats=20)
    g = time_fwd_bwd_graphed(backend.fn, inp, grads, dev, repeats=20)
    cot = _cotangents(backend.fn, inp)

    def fb():
        _fwd_bwd(backend.fn, inp, grads, cot)

    def ten():
        for _ in range(10):
            fb()

    piped = statistics.median(cuda_times_ms(ten, warmup=1, iters=10)) / 10
    say({"case": case, "per_call_ms": t.median_ms, "pipelined_ms": piped,
         "replay_ms": g.median_ms})

    x, idx, w = inp["x"], inp["expert_idx"], inp["weights"]
    w_in, w_out = inp["w_in"], inp["w_out"]
    plan = G.dispatch_plan(idx, w_in.shape[0], w)
    xs = K.scatter_rows_triton(x.detach(), plan.inv)
    gu = torch._grouped_mm(xs, w_in.detach().transpose(-2, -1), offs=plan.offs)
    hid = K.swiglu_weighted_triton(gu, plan.w_sorted)
    ys = torch._grouped_mm(hid, w_out.detach().transpose(-2, -1), offs=plan.offs)
    steps = {
        "fwd_bwd": fb,
        "forward (backend.fn)": lambda: backend.fn(**inp),
        "forward (moe_experts_grouped)": lambda: G.moe_experts_grouped(x, idx, w, w_in, w_out),
        "dispatch_plan": lambda: G.dispatch_plan(idx, w_in.shape[0], w),
        "scatter_rows": lambda: K.scatter_rows_triton(x.detach(), plan.inv),
        "grouped_mm gate|up": lambda: torch._grouped_mm(
            xs, w_in.detach().transpose(-2, -1), offs=plan.offs),
        "swiglu": lambda: K.swiglu_weighted_triton(gu, plan.w_sorted),
        "grouped_mm down": lambda: torch._grouped_mm(
            hid, w_out.detach().transpose(-2, -1), offs=plan.offs),
        "gather_sum": lambda: K.gather_sum_triton(ys, plan.inv),
        "torch add_ (calibration)": lambda: xs.add_(0),
        "torch.empty (calibration)": lambda: torch.empty(16, device=dev),
    }
    for name, fn in steps.items():
        say({"case": case, "host_us": name, "us": host_us(fn)})
    outs = []

    def bwd_only():
        torch.autograd.grad(outs[-1], [inp[n] for n in grads], grad_outputs=cot)

    samples = []
    for _ in range(30):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        outs.append(backend.fn(**inp))
        t0 = time.perf_counter()
        bwd_only()
        samples.append((time.perf_counter() - t0) * 1e6)
        outs.clear()
    torch.cuda.synchronize()
    say({"case": case, "host_us": "backward (autograd.grad)", "us": statistics.median(samples)})

    # (c) timeline of one per-call fwd+bwd
    for _ in range(3):
        fb()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fb()
        torch.cuda.synchronize()
    trace = OUT / f"moe_trace_{case}.json"
    prof.export_chrome_trace(str(trace))
    ev = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e for e in ev
              if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    host0 = min(e["ts"] for e in ev if e.get("cat") == "cpu_op")
    t_first = kernels[0]["ts"]
    line, prev_end, idle = [], None, 0.0
    for i, k in enumerate(kernels):
        gap = 0.0 if prev_end is None else k["ts"] - prev_end
        idle += max(gap, 0.0)
        lk = launch.get(k["args"].get("correlation"))
        line.append({"i": i, "kernel": k["name"][:70], "start_us": k["ts"] - host0,
                     "dur_us": k["dur"], "gap_before_us": gap,
                     "launched_us": None if lk is None else lk["ts"] - host0})
        prev_end = k["ts"] + k["dur"]
    say({"case": case, "timeline": line, "gpu_span_us": prev_end - t_first,
         "gpu_idle_us": idle, "first_kernel_after_host_start_us": t_first - host0,
         "kernels": len(kernels)})
    top = sorted(((e.key, e.cpu_time_total) for e in prof.key_averages()),
                 key=lambda r: -r[1])[:25]
    say({"case": case, "cpu_ops_top": top})



def main() -> None:
    for case in CASES:
        probe(case)


if __name__ == "__main__":
    main()
