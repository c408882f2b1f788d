"""Where the time of the MoE grouped path, the fused linear CE and RMSNorm goes, and the
launch sweeps behind their settings, on one GPU, in one process.

    PYTHONPATH=src python benchmarks/moe_ce_probe.py [--out DIR] [--only rmsnorm,moe,lce]
                                                    [--write]

For each timed function it reports three numbers: ``ms`` as benchmarks/kernels.py times it
(one fwd+bwd between two events, the GPU idle at the start), ``pipelined_ms`` (10 fwd+bwd
enqueued back to back, events around all of them, / 10: the host's launch latency hidden
behind the previous iteration's GPU work) and ``kernel_ms`` (the profiler's sum of GPU kernel
time per fwd+bwd). ``ms`` >> ``kernel_ms`` means the host, not the GPU, sets the time.
The RMSNorm section sweeps the wide-row launch setting (rows per forward program, backward
tile, backward programs per SM) at 262144 x 1024, each candidate passed to the kernel as its
``config``; ``--write`` records the fastest in ops/rmsnorm/configs.json for this device.
Not part of the benchmark suite (benchmarks/kernels.py is).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from megacpp.kernels import timing
from megacpp.kernels.registry import default_catalog

RESULTS: dict[str, object] = {}
DEV = torch.device("cuda")


def _section(title: str, fn) -> None:
    print(f"\n=== {title}", flush=True)
    try:
        fn()
    except Exception:  # noqa: BLE001  (keep probing the other sections)
        traceback.print_exc()
        RESULTS[f"{title}/error"] = traceback.format_exc(limit=3)


def _step(fn, inputs, grad_args):
    cot = [torch.randn_like(o) for o in timing._differentiable(fn(**inputs))]
    return lambda: timing._fwd_bwd(fn, inputs, grad_args, cot)


def _pipelined_ms(step, n: int = 10) -> float:
    step()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / n


def _host_ms(step, n: int = 5) -> float:
    """Host time to enqueue one fwd+bwd (GPU drained first; no sync inside)."""
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(samples)[n // 2]


def _kernel_ms(step, label: str, out: Path | None, iters: int = 3) -> float:
    from torch.profiler import ProfilerActivity, profile

    from megacpp.kernels.profiling import device_rows

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in device_rows(events))
    if out is not None:
        (out / f"profile_{label}.txt").write_text(events.table(
            sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    return total / iters / 1e3


def measure(fn, inputs, grad_args, label: str, out: Path | None = None, profile: bool = True,
            repeats: int = 10) -> dict:
    t = timing.time_fwd_bwd(fn, inputs, grad_args, DEV, repeats=repeats)
    step = _step(fn, inputs, grad_args)
    row = {"ms": t.median_ms, "peak_gib": t.peak_extra_bytes / 2**30,
           "pipelined_ms": _pipelined_ms(step), "host_ms": _host_ms(step)}
    if profile:
        row["kernel_ms"] = _kernel_ms(step, label, out)
    print(label, json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
    return row


# -- RMSNorm --------------------------------------------------------------------------------------
def _rmsnorm_sweep(inputs: dict, grad_args: tuple, write: bool) -> dict:
    """fwd+bwd ms of each wide-row setting (the current one first); with ``write`` the
    fastest becomes this device's entry of ops/rmsnorm/configs.json."""
    from megacpp.kernels.launch import device_key, for_device
    from megacpp.kernels.ops.rmsnorm.configs import CONFIGS, write_config
    from megacpp.kernels.ops.rmsnorm.triton import rmsnorm_triton

    base = for_device(CONFIGS, DEV)
    candidates = [base] + [replace(base, fwd_rows=fr, bwd_tile=bt, bwd_programs_per_sm=pp)
                           for fr, bt, pp in ((1, 4, 4), (2, 4, 4), (8, 4, 4), (4, 1, 4),
                                              (4, 2, 4), (4, 8, 4), (4, 4, 2), (4, 4, 8),
                                              (4, 4, 16), (2, 2, 8))]
    times = {}
    for cfg in candidates:
        fn = functools.partial(rmsnorm_triton, config=cfg)
        key = f"f{cfg.fwd_rows}_t{cfg.bwd_tile}_p{cfg.bwd_programs_per_sm}"
        times[key] = timing.time_fwd_bwd(fn, inputs, grad_args, DEV, repeats=10).median_ms
        print(f"sweep {key}", round(times[key], 4), flush=True)
    best = min(zip(times.values(), range(len(candidates))))[1]
    if write:
        write_config(device_key(DEV), candidates[best])
        print(f"wrote {candidates[best]} for device {device_key(DEV)}", flush=True)
    return times


def rmsnorm(out: Path, write: bool) -> None:
    catalog = default_catalog()
    surface = catalog.surface("rmsnorm")
    res = {}
    for tokens, dim in ((16384, 1024), (262144, 1024), (65536, 4096)):
        gen = torch.Generator(device=DEV).manual_seed(0)
        inputs = surface.make_inputs({"tokens": tokens, "dim": dim}, torch.bfloat16, DEV, gen)
        moved = surface.bytes_moved(inputs)
        for backend in ("triton_fused", "torch_compile", "reference"):
            key = f"{tokens}x{dim}/{backend}"
            try:
                row = measure(catalog.backend("rmsnorm", backend).fn, inputs, surface.grad_args,
                              f"rms_{tokens}x{dim}_{backend}", out, profile=True)
            except Exception as exc:  # noqa: BLE001
                res[key] = repr(exc)[:300]
                print(key, res[key], flush=True)
                continue
            for k in ("ms", "pipelined_ms", "kernel_ms"):
                row[k.replace("ms", "gbs")] = moved / row[k] / 1e6
            res[key] = row
        if tokens == 262144:  # launch-setting sweep of ours at the big case
            res["sweep"] = _rmsnorm_sweep(inputs, surface.grad_args, write)
        del inputs
        torch.cuda.empty_cache()
    RESULTS["rmsnorm"] = res


# -- MoE ------------------------------------------------------------------------------------------
def moe(out: Path, write: bool) -> None:
    from megacpp.kernels.ops.moe_experts.grouped import moe_experts_grouped
    from megacpp.kernels.ops.moe_experts.reference import moe_experts_reference

    surface = default_catalog().surface("moe_experts")
    for case in ("e64_k8", "e16_k2"):
        gen = torch.Generator(device=DEV).manual_seed(0)
        inputs = surface.make_inputs(surface.cases[case], torch.bfloat16, DEV, gen)
        flops = surface.flops(inputs)
        row = {"grouped": measure(moe_experts_grouped, inputs, surface.grad_args,
                                  f"moe_{case}", out)}
        row["reference"] = timing.time_fwd_bwd(moe_experts_reference, inputs,
                                               surface.grad_args, DEV, repeats=5).median_ms
        row["x_loop"] = row["reference"] / row["grouped"]["ms"]
        row["tflops"] = flops / row["grouped"]["ms"] / 1e9
        RESULTS[f"moe/{case}"] = row
        print(case, json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()


# -- linear cross-entropy -------------------------------------------------------------------------
def lce(out: Path, write: bool) -> None:
    from megacpp.kernels.ops.linear_cross_entropy import triton as lce_mod
    from megacpp.kernels.ops.linear_cross_entropy.reference import linear_cross_entropy_torch
    from megacpp.kernels.peers import liger_linear_cross_entropy

    surface = default_catalog().surface("linear_cross_entropy")
    gen = torch.Generator(device=DEV).manual_seed(0)
    inputs = surface.make_inputs(surface.cases["bench"], torch.bfloat16, DEV, gen)
    res = {}

    def record(name, fn, profile=False):
        try:
            res[name] = measure(fn, inputs, surface.grad_args, f"lce_{name}", out, profile)
        except Exception as exc:  # noqa: BLE001
            res[name] = repr(exc)[:300]
            print(name, res[name], flush=True)

    record("default", lce_mod.linear_cross_entropy_triton, profile=True)
    for c in (768, 960, 1024, 2048):
        record(f"chunk{c}", lambda c=c, **kw: lce_mod.linear_cross_entropy_triton(
            **kw, chunk_tokens=c))
    record("torch_plain", linear_cross_entropy_torch, profile=True)
    record("liger", liger_linear_cross_entropy)
    RESULTS["lce"] = res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/moe_ce_probe"))
    parser.add_argument("--only", default="lce,moe,rmsnorm")
    parser.add_argument("--write", action="store_true",
                        help="record the RMSNorm sweep's fastest setting for this device")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name, fn in (("lce", lce), ("moe", moe), ("rmsnorm", rmsnorm)):
        if name in only:
            _section(name, lambda fn=fn: fn(args.out, args.write))
            (args.out / "probe.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
