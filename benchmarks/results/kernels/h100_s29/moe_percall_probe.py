"""Session 29 probe: where the MoE bench row's per-call time goes beyond its graph replay.

For each bench case (e64_k8, e16_k2) of the chosen ``grouped_mm`` backend: the per-call and
replayed times as ``benchmarks/kernels.py`` takes them, the host time of one fwd+bwd (wall time
of the Python call, the GPU idle at its start) and of the forward and backward apart, then one
call under ``torch.profiler`` (CPU + CUDA): each kernel in launch order with the host time of
its launch, its GPU start and duration, and the idle time before it, relative to the call's
start event. A kernel whose GPU start follows its launch closely waited on the host.

usage: python3 moe_percall_probe.py OUT_DIR [--cases e64_k8,e16_k2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import (
    _cotangents,
    _differentiable,
    _fwd_bwd,
    time_fwd_bwd,
    time_fwd_bwd_graphed,
)


def host_times(fn, inputs, grad_args, cot, reps=20):
    """Median wall ms of the whole Python call, its forward and its backward (GPU idle at the
    start of each call; a sync after each)."""
    whole, fwd, bwd = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = _differentiable(fn(**inputs))
        t1 = time.perf_counter()
        torch.autograd.grad(outs, [inputs[n] for n in grad_args], grad_outputs=cot,
                            allow_unused=True)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        whole.append((t2 - t0) * 1e3)
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
    return {k: statistics.median(v) for k, v in (("call", whole), ("fwd", fwd), ("bwd", bwd))}


def timeline(fn, inputs, grad_args, cot, trace_path: Path):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            with record_function(f"call{i}"):
                _fwd_bwd(fn, inputs, grad_args, cot)
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    calls = sorted((e for e in events if e.get("name", "").startswith("call")
                    and e.get("ph") == "X" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    last = calls[-1]
    t0, t1 = last["ts"], last["ts"] + last["dur"]
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                      and e.get("ph") == "X"), key=lambda e: e["ts"])
    rows, prev_end = [], None
    for k in kernels:
        launch = launches.get(k["args"].get("correlation"))
        if launch is None or not (t0 <= launch["ts"] <= t1):
            continue
        gap = None if prev_end is None else k["ts"] - prev_end
        rows.append({"kernel": k["name"][:70], "launch_us": launch["ts"] - t0,
                     "launch_cost_us": launch["dur"], "gpu_start_us": k["ts"] - t0,
                     "gpu_us": k["dur"], "idle_before_us": gap,
                     "waited_on_host_us": k["ts"] - (launch["ts"] + launch["dur"])})
        prev_end = k["ts"] + k["dur"]
    return rows, {"cpu_call_us": last["dur"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default="e64_k8,e16_k2")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    surface = default_catalog().surface("moe_experts")
    fn = default_catalog().backend("moe_experts", "grouped_mm").fn
    result = {}
    for case in args.cases.split(","):
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = surface.make_inputs(surface.cases[case], torch.bfloat16, device, gen)
        per_call = time_fwd_bwd(fn, inputs, surface.grad_args, device, repeats=20).median_ms
        replay = time_fwd_bwd_graphed(fn, inputs, surface.grad_args, device, repeats=20).median_ms
        cot = _cotangents(fn, inputs)
        host = host_times(fn, inputs, surface.grad_args, cot)
        rows, meta = timeline(fn, inputs, surface.grad_args, cot, args.out / f"{case}.trace.json")
        idle = sum(r["idle_before_us"] or 0 for r in rows)
        busy = sum(r["gpu_us"] for r in rows)
        result[case] = {"per_call_ms": per_call, "replay_ms": replay, "host_ms": host,
                        "profiled_kernels_us": busy, "profiled_idle_between_us": idle,
                        "first_kernel_start_us": rows[0]["gpu_start_us"] if rows else None,
                        **meta, "kernels": rows}
        print(f"== {case}: per call {per_call:.3f} ms, replay {replay:.3f} ms; host call "
              f"{host['call']:.3f} (fwd {host['fwd']:.3f}, bwd {host['bwd']:.3f}) ms; profiled: "
              f"kernels {busy:.0f} us, idle between {idle:.0f} us, first kernel at "
              f"{result[case]['first_kernel_start_us']:.0f} us")
        print(f"{'kernel':70s} {'launch':>8s} {'cost':>6s} {'start':>8s} {'gpu':>7s} "
              f"{'idle':>6s} {'wait':>7s}")
        for r in rows:
            print(f"{r['kernel']:70s} {r['launch_us']:8.0f} {r['launch_cost_us']:6.0f} "
                  f"{r['gpu_start_us']:8.0f} {r['gpu_us']:7.1f} "
                  f"{(r['idle_before_us'] or 0):6.1f} {r['waited_on_host_us']:7.0f}")
    (args.out / "moe_percall_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
