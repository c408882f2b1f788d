"""Development probe for the MoE grouped path and the fused linear cross-entropy (issue #6):
a torch.profiler table of each, component timings and the variant sweeps behind the chosen
defaults (chunk size, dW tile config, CE grid), on one GPU, in one process.

    PYTHONPATH=src python benchmarks/moe_ce_probe.py [--old DIR] [--out DIR] [--quick]

``--old DIR`` may hold earlier versions (old_moe_grouped.py, old_linear_ce.py) to time side
by side. Not part of the benchmark suite (benchmarks/kernels.py is); numbers it prints are
development evidence.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import cuda_times_ms, time_fwd_bwd

RESULTS: dict[str, object] = {}


def _ms(fn, repeats: int = 20) -> float:
    return statistics.median(cuda_times_ms(fn, warmup=3, iters=repeats))


def _load(path: Path, name: str):
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(title: str, fn) -> None:
    print(f"\n=== {title}", flush=True)
    try:
        fn()
    except Exception:  # noqa: BLE001  (keep probing the other sections)
        traceback.print_exc()
        RESULTS[f"{title}/error"] = traceback.format_exc(limit=3)


def _profile(fn, label: str, out: Path, rows: int = 22) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
    (out / f"profile_{label}.txt").write_text(table)
    print(table)


def _fwd_bwd(fn, inputs, grad_args):
    """One fwd+bwd as benchmarks/kernels.py times it (fixed cotangents, no loss reduction)."""
    from megacpp.kernels import timing

    cot = [torch.randn_like(o) for o in timing._differentiable(fn(**inputs))]
    return lambda: timing._fwd_bwd(fn, inputs, grad_args, cot)


def _dense_rates(inputs, flops: float) -> dict:
    """The six GEMMs of the MoE case run dense (all rows to one expert), and the old
    benchmark's single M x 4096 x 1024 forward GEMM of the same FLOPs."""
    n = inputs["expert_idx"].numel()
    two_f, d = inputs["w_in"].shape[1:]
    f = two_f // 2
    shapes = [(n, d), (two_f, d), (d, f), (n, f), (n, d), (n, two_f)]
    x, w1, w2, h, dy, da = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    gemm_ms = {
        "fwd_gate_up": _ms(lambda: x @ w1.t()), "fwd_down": _ms(lambda: h @ w2.t()),
        "bwd_dh": _ms(lambda: dy @ w2), "bwd_dw2": _ms(lambda: dy.t() @ h),
        "bwd_dx": _ms(lambda: da @ w1), "bwd_dw1": _ms(lambda: da.t() @ x)}
    m = max(256, int(flops / 3 / (2 * 4096 * 1024)))
    a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    return {"dense_gemm_ms": gemm_ms,
            "dense_same_gemms_tflops": flops / sum(gemm_ms.values()) / 1e9,
            "dense_equiv_old_tflops": 2 * m * 4096 * 1024 / _ms(lambda: a @ b) / 1e9}


# -- MoE ------------------------------------------------------------------------------------------
def moe(out: Path, old_dir: Path | None, quick: bool) -> None:
    from megacpp.kernels.ops.moe.grouped import moe_experts_grouped

    surface = default_catalog().surface("moe_experts")
    old = _load(old_dir / "old_moe_grouped.py", "old_moe") if old_dir else None
    for case in ("e64_k8", "e16_k2"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs = surface.make_inputs(surface.cases[case], torch.bfloat16, "cuda", gen)
        flops = surface.flops(inputs)
        row = {}
        variants = {"new": moe_experts_grouped}
        if old is not None:
            variants["old"] = old.moe_experts_grouped
        for name, fn in variants.items():
            t = time_fwd_bwd(fn, inputs, surface.grad_args, torch.device("cuda"), repeats=15)
            row[name] = {"ms": t.median_ms, "tflops": flops / t.median_ms / 1e9,
                         "peak_gib": t.peak_extra_bytes / 2**30}
        row.update(_dense_rates(inputs, flops))
        RESULTS[f"moe/{case}"] = row
        print(case, json.dumps(row, indent=1), flush=True)
        if not quick:
            _profile(_fwd_bwd(moe_experts_grouped, inputs, surface.grad_args), f"moe_{case}", out)
        del inputs
        torch.cuda.empty_cache()


# -- linear cross-entropy -------------------------------------------------------------------------
def _chunk_components(lce, h_c, w, labels_c, g) -> dict:
    """One chunk's steps: logits GEMM, CE kernel variants, dh GEMM, dW fp32 addmm vs planes."""
    (c, d), v = h_c.shape, w.shape[0]
    logits = h_c @ w.t()
    grad = (torch.randn(c, v, device="cuda", generator=g) * 1e-4).bfloat16()
    dh = torch.empty(c, d, device="cuda", dtype=torch.bfloat16)
    dw32 = torch.zeros(v, d, device="cuda")
    hi = torch.zeros(v, d, device="cuda", dtype=torch.int16)
    lo = torch.zeros_like(hi)
    r = {"logits_mm": _ms(lambda: torch.mm(h_c, w.t(), out=logits)),
         "dh_mm": _ms(lambda: torch.mm(grad, w, out=dh)),
         "dw_addmm_fp32": _ms(lambda: torch.addmm(dw32, grad.t(), h_c, out_dtype=torch.float32,
                                                  out=dw32)),
         "dw_planes_default": _ms(lambda: lce.accumulate_weight_grad(hi, lo, grad, h_c))}
    inv_n = torch.ones(1, device="cuda")
    losses = torch.empty(c, device="cuda")
    for label, programs in (("rows", c), ("1/sm", 132), ("2/sm", 264), ("4/sm", 528)):
        for warps in (8, 16):
            def ce(programs=programs, warps=warps):
                lce._ce_rows[(programs,)](logits, labels_c, losses, inv_n, c, logits.stride(0),
                                          -100, n_cols=v, BLOCK=4096, WRITE_GRAD=True,
                                          num_warps=warps)
            r[f"ce_{label}_w{warps}"] = _ms(ce)
    return r


def lce_components(out: Path) -> None:
    from megacpp.kernels.ops.linear_ce import triton as lce

    g = torch.Generator(device="cuda").manual_seed(0)
    t, d, v = 16384, 1024, 65536
    h = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    labels = torch.randint(0, v, (t,), device="cuda", generator=g)
    res = {}
    for c in (512, 768, 1024, 2048):
        res[c] = _chunk_components(lce, h[:c], w, labels[:c], g)
        print(c, json.dumps(res[c]), flush=True)
        torch.cuda.empty_cache()
    RESULTS["lce/components"] = res

    c = 768
    grad = (torch.randn(c, v, device="cuda", generator=g) * 1e-4).bfloat16()
    hi = torch.zeros(v, d, device="cuda", dtype=torch.int16)
    lo = torch.zeros_like(hi)
    sweep = {}
    configs = [  # BM, BN, BK, warps, stages, tma, maxnreg
        (128, 128, 64, 8, 3, True, 0), (128, 128, 64, 8, 4, True, 0),
        (128, 128, 64, 8, 3, True, 128), (128, 128, 64, 8, 2, True, 128),
        (128, 256, 64, 8, 3, True, 0), (256, 128, 64, 8, 3, True, 0),
        (128, 128, 64, 4, 3, True, 0), (128, 64, 64, 4, 4, True, 0),
        (128, 128, 64, 8, 3, False, 0), (128, 256, 64, 8, 3, False, 0)]
    for bm, bn, bk, warps, stages, tma, maxnreg in configs:
        cfg = {"BM": bm, "BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages,
               "tma": tma, "maxnreg": maxnreg}
        key = f"{bm}x{bn}x{bk}_w{warps}_s{stages}" + ("_tma" if tma else "") + (
            f"_r{maxnreg}" if maxnreg else "")
        try:
            sweep[key] = _ms(lambda cfg=cfg: lce.accumulate_weight_grad(hi, lo, grad, h[:c], cfg))
        except Exception as exc:  # noqa: BLE001  (out of shared memory etc.)
            sweep[key] = repr(exc)[:120]
        print(key, sweep[key], flush=True)
    RESULTS["lce/dw_sweep_c768"] = sweep


def lce_end_to_end(out: Path, old_dir: Path | None, quick: bool) -> None:
    from megacpp.kernels.ops.linear_ce import triton as lce
    from megacpp.kernels.ops.linear_ce.reference import linear_cross_entropy_torch
    from megacpp.kernels.peers import liger_linear_cross_entropy

    surface = default_catalog().surface("linear_cross_entropy")
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = surface.make_inputs(surface.cases["bench"], torch.bfloat16, "cuda", gen)
    flops = surface.flops(inputs)
    res = {}

    def record(name, fn):
        t = time_fwd_bwd(fn, inputs, surface.grad_args, torch.device("cuda"), repeats=10)
        res[name] = {"ms": t.median_ms, "peak_gib": t.peak_extra_bytes / 2**30,
                     "tflops": flops / t.median_ms / 1e9}
        print(name, json.dumps(res[name]), flush=True)

    for c in (640, 768, 896, 1024):
        record(f"new_c{c}", lambda c=c, **kw: lce.linear_cross_entropy_triton(**kw, chunk_tokens=c))
    record("new_default", lce.linear_cross_entropy_triton)
    old = _load(old_dir / "old_linear_ce.py", "old_lce") if old_dir else None
    if old is not None:
        record("old_default", old.linear_cross_entropy_triton)
    record("torch_plain", linear_cross_entropy_torch)
    try:
        record("liger", liger_linear_cross_entropy)
    except ImportError as exc:
        res["liger"] = repr(exc)
    RESULTS["lce/end_to_end"] = res
    if not quick:
        _profile(_fwd_bwd(lce.linear_cross_entropy_triton, inputs, surface.grad_args), "lce", out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/moe_ce_probe"))
    parser.add_argument("--quick", action="store_true", help="no profiler tables")
    parser.add_argument("--only", default="moe,lce_components,lce")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "moe" in only:
        _section("moe", lambda: moe(args.out, args.old, args.quick))
    if "lce_components" in only:
        _section("lce_components", lambda: lce_components(args.out))
    if "lce" in only:
        _section("lce", lambda: lce_end_to_end(args.out, args.old, args.quick))
    (args.out / "probe.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
