"""Launch-setting sweep and per-kernel breakdown of the Triton gated delta rule (one GPU).

    PYTHONPATH=src python benchmarks/gated_delta_tune.py --out tune.json [--quick]

For each shape: every kernel's registers / spills, the CUDA-time breakdown per kernel (ours
and fla's when importable, from torch.profiler), then a coordinate sweep of CONFIG (one
kernel's setting varied at a time, the others at their defaults), each variant checked
against the defaults' outputs and gradients and timed fwd+bwd (median of do_bench). Prints
the best setting per kernel; CONFIG in ops/gated_delta/triton.py is set from these runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import defaultdict

import torch
import triton
from triton.testing import do_bench

import megacpp.kernels.ops.gated_delta.triton as gdt
from megacpp.kernels.registry import default_catalog

SHAPES = {"nam56r_4k": "nam56r_4k", "h16_d128_4k": "h16_d128_4k"}
SWEEP = {
    "fwd_intra": [{"num_warps": w, "num_stages": s} for w in (4, 8) for s in (1, 2)],
    "fwd_state": [{"BV": bv, "num_warps": w, "num_stages": s}
                  for bv in (32, 64) for w in (4, 8) for s in (1, 2, 3)],
    "fwd_out": [{"BV": bv, "num_warps": w, "num_stages": 2} for bv in (32, 64, 128)
                for w in (4, 8)],
    "bwd_dv_local": [{"BV": bv, "num_warps": w, "num_stages": 2} for bv in (32, 64, 128)
                     for w in (4, 8)],
    "bwd_state": [{"BV": bv, "num_warps": w, "num_stages": s}
                  for bv in (32, 64) for w in (4, 8) for s in (1, 2, 3)],
    "bwd_val": [{"BV": bv, "num_warps": w, "num_stages": s}
                for bv in (32, 64) for w in (4, 8) for s in (1, 2)],
    "bwd_key": [{"BKS": bk, "BV": bv, "num_warps": w, "num_stages": s}
                for bk in (32, 64) for bv in (32, 64) for w in (4, 8) for s in (1, 2)],
    "bwd_fin": [{"BKS": bk, "num_warps": w, "num_stages": 1} for bk in (32, 64) for w in (4, 8)],
}
_STATE_QUICK = [{"BV": 32, "num_warps": 4, "num_stages": 1}, {"BV": 32, "num_warps": 4, "num_stages": 2},
                {"BV": 64, "num_warps": 4, "num_stages": 2}, {"BV": 32, "num_warps": 8, "num_stages": 2},
                {"BV": 32, "num_warps": 4, "num_stages": 3}]
QUICK = {
    "fwd_intra": [{"num_warps": 4, "num_stages": 1}, {"num_warps": 8, "num_stages": 1}],
    "fwd_state": _STATE_QUICK,
    "fwd_out": [{"BV": 64, "num_warps": 4, "num_stages": 2}, {"BV": 128, "num_warps": 8, "num_stages": 2},
                {"BV": 32, "num_warps": 4, "num_stages": 2}],
    "bwd_dv_local": [{"BV": 64, "num_warps": 4, "num_stages": 2},
                     {"BV": 128, "num_warps": 8, "num_stages": 2}],
    "bwd_state": _STATE_QUICK,
    "bwd_val": [{"BV": 64, "num_warps": 8, "num_stages": 2}, {"BV": 32, "num_warps": 4, "num_stages": 2},
                {"BV": 64, "num_warps": 4, "num_stages": 1}],
    "bwd_key": [{"BKS": 64, "BV": 32, "num_warps": 8, "num_stages": 2},
                {"BKS": 64, "BV": 32, "num_warps": 4, "num_stages": 2},
                {"BKS": 32, "BV": 64, "num_warps": 4, "num_stages": 2},
                {"BKS": 64, "BV": 64, "num_warps": 8, "num_stages": 1},
                # one slice of K = 128 (BKS is clamped to the head's K)
                {"BKS": 128, "BV": 32, "num_warps": 8, "num_stages": 2},
                {"BKS": 128, "BV": 32, "num_warps": 4, "num_stages": 2}],
    "bwd_fin": [{"BKS": 64, "num_warps": 8, "num_stages": 1}, {"BKS": 64, "num_warps": 4, "num_stages": 1},
                {"BKS": 32, "num_warps": 4, "num_stages": 1}],
}


def _inputs(case: str) -> dict:
    surface = default_catalog().surface("gated_delta")
    gen = torch.Generator("cuda").manual_seed(0)
    return surface.make_inputs(surface.cases[case], torch.bfloat16, torch.device("cuda"), gen)


def _fwd_bwd(inputs: dict, do: torch.Tensor):
    args = {n: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and
            t.is_floating_point() else t for n, t in inputs.items()}
    o, _ = gdt.gated_delta_rule_triton(**args)
    grads = torch.autograd.grad(o, [args[n] for n in ("q", "k", "v", "g", "beta")], do)
    return [o, *grads]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float("nan") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


def _resources(inputs: dict, do: torch.Tensor) -> dict:
    """Registers, spills and shared memory of each kernel as compiled for these inputs."""
    seen = {}
    original = gdt._Launcher.__call__

    def spy(self, kernel, name, per_chunk, *args, **const):
        compiled = original(self, kernel, name, per_chunk, *args, **const)  # slices= included
        seen[name] = {"regs": compiled.n_regs, "spills": compiled.n_spills,
                      "smem": compiled.metadata.shared}
        return compiled

    gdt._Launcher.__call__ = spy
    try:
        _fwd_bwd(inputs, do)
    finally:
        gdt._Launcher.__call__ = original
    return seen


def _breakdown(fn, steps: int = 5) -> dict[str, float]:
    """CUDA microseconds per fwd+bwd of each kernel name under ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:  # kernels and copies only
            total = getattr(evt, "device_time_total", None) or evt.cuda_time_total
            times[evt.key[:60]] += total / steps
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _fla_fn(inputs: dict, do: torch.Tensor):
    from megacpp.kernels.peers import fla_chunk_gated_delta_rule

    def run():
        args = {n: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and
                t.is_floating_point() else t for n, t in inputs.items()}
        o, _ = fla_chunk_gated_delta_rule(**args)
        torch.autograd.grad(o, [args[n] for n in ("q", "k", "v", "g", "beta")], do)
    return run


def sweep_shape(case: str, quick: bool, sweep: bool = True) -> dict:
    inputs = _inputs(case)
    do = torch.randn_like(inputs["v"])
    result = {"case": case, "defaults": copy.deepcopy(gdt.CONFIG)}
    base = _fwd_bwd(inputs, do)
    result["resources"] = _resources(inputs, do)
    result["base_ms"] = do_bench(lambda: _fwd_bwd(inputs, do), warmup=50, rep=300,
                                 return_mode="median")
    result["base_ms_again"] = do_bench(lambda: _fwd_bwd(inputs, do), warmup=50, rep=300,
                                       return_mode="median")
    result["breakdown_us"] = _breakdown(lambda: _fwd_bwd(inputs, do))
    try:
        fla_run = _fla_fn(inputs, do)
        result["fla_ms"] = do_bench(fla_run, warmup=50, rep=300, return_mode="median")
        result["fla_breakdown_us"] = _breakdown(fla_run)
    except Exception as exc:  # noqa: BLE001 -- report why the peer did not run
        result["fla_error"] = repr(exc)[:300]
    print(json.dumps({k: result[k] for k in ("case", "base_ms", "base_ms_again")}), flush=True)
    print(json.dumps(result["resources"]), flush=True)
    print(json.dumps(result.get("fla_ms")), flush=True)
    best, trials = {}, []
    for name, configs in (QUICK if quick else SWEEP).items() if sweep else ():
        default = dict(gdt.CONFIG[name])
        scores = []
        for cfg in configs:
            gdt.CONFIG[name] = cfg
            try:
                out = _fwd_bwd(inputs, do)
                err = max(_rel(a, b) for a, b in zip(out, base))
                ms = do_bench(lambda: _fwd_bwd(inputs, do), warmup=25, rep=150,
                              return_mode="median")
            except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory
                err, ms = float("nan"), float("inf")
                print(f"{name} {cfg}: {repr(exc)[:200]}", flush=True)
            trials.append({"kernel": name, "config": cfg, "ms": ms, "max_rel_vs_default": err})
            if err < 1e-3:  # same function; a larger gap means a bug in that setting
                scores.append((ms, cfg))
            print(f"{name:13} {cfg} {ms:.4f} ms  err {err:.1e}", flush=True)
        gdt.CONFIG[name] = default
        best[name] = min(scores, key=lambda s: s[0]) if scores else None
    result["trials"], result["best"] = trials, best
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", default=",".join(SHAPES),
                        help="comma-separated gated_delta cases of the catalog (e.g. nam56r_8k)")
    parser.add_argument("--no-sweep", action="store_true", help="breakdown and fla only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    for case in args.cases.split(","):
        results.append(sweep_shape(case, args.quick, not args.no_sweep))
        with open(args.out, "w") as f:  # after every case: a run cut short keeps what it has
            json.dump({"triton": triton.__version__, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    for r in results:
        print(r["case"], f"ours {r['base_ms']:.3f} ms", f"fla {r.get('fla_ms')}",
              json.dumps(r["breakdown_us"])[:600])
        for name, b in r["best"].items():
            print(f"  best {name:13} {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
