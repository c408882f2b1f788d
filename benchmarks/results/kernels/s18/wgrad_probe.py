"""wgrad probe (dev record, session 18): the MoE expert weight gradients, ours vs CUTLASS.

For the nam56r-350m step's MoE (d 768, 16 experts top-2, ffn 272) and the kernel benchmark's
two moe_experts cases (e64: d 1024, 64 experts top-8, ffn 512; e16: 16 top-2, ffn 2048), both
weight gradients of one layer:

  dw_in  [E, 2F, D] = dgate_up[rows_e]^T x_sorted[rows_e]
  dw_out [E, D, F]  = dy_sorted[rows_e]^T hidden[rows_e]   (ours: hidden^T dy, stored transposed)

timed by CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median):

  cutlass       torch._grouped_mm (bf16 out), as the MoE called it before 296c696
  cutlass+cast  the same plus the cast to float32 that autograd ran for float32 masters
  ours fp32     grouped_wgrad_triton writing float32 (the path under autocast now)
  ours bf16     grouped_wgrad_triton writing bf16 (bf16 weights, as in the kernel benchmark)

over a few launch settings (each set as the only one in WGRAD_CONFIGS), each checked against
the float32 cast of the CUTLASS result (relative error).

    PYTHONPATH=src python benchmarks/results/kernels/s18/wgrad_probe.py [OUT]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton

from megacpp.kernels.ops.moe import triton as K

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT") or "/tmp")
SHAPES = {"step": {"tokens": 16384, "d": 768, "experts": 16, "k": 2, "f": 272},
          "e64": {"tokens": 16384, "d": 1024, "experts": 64, "k": 8, "f": 512},
          "e16": {"tokens": 16384, "d": 1024, "experts": 16, "k": 2, "f": 2048}}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the first is the committed default
CONFIGS = [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
           (128, 128, 64, 8, 4), (64, 256, 64, 4, 4), (256, 128, 64, 8, 3),
           (128, 256, 32, 8, 5), (64, 128, 64, 4, 5)]


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def case(tokens, d, experts, k, f, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=g, device="cuda").topk(k, -1).indices
    offs = torch.bincount(idx.reshape(-1), minlength=experts).cumsum(0).to(torch.int32)
    n = tokens * k

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    dgu, xs, hid, dy = r(n, 2 * f), r(n, d), r(n, f), r(n, d)
    gm = torch._grouped_mm
    return {  # name: (cutlass thunk, our operands (a, b, transpose_out), flops)
        "dw_in": (lambda: gm(dgu.t(), xs, offs=offs), (dgu, xs, False), 2 * n * 2 * f * d),
        "dw_out": (lambda: gm(dy.t(), hid, offs=offs), (hid, dy, True), 2 * n * f * d),
    }, offs


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    rows = []
    for shape, dims in SHAPES.items():
        gemms, offs = case(**dims)
        for name, (cutlass, (a, b, t_out), flops) in gemms.items():
            ref = cutlass().float()
            row = {"case": f"{shape} {name}", "flops": flops,
                   "cutlass_us": bench(cutlass) * 1e3,
                   "cutlass_cast_us": bench(lambda c=cutlass: c().float()) * 1e3}
            for cfg in CONFIGS:
                K.WGRAD_CONFIGS = (dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps",
                                            "num_stages"), cfg, strict=True)),)
                key = "x".join(map(str, cfg))
                try:
                    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                        out = K.grouped_wgrad_triton(a, b, offs, dt, transpose_out=t_out)
                        row[f"{key}_{tag}_err"] = rel(out, ref)
                        row[f"{key}_{tag}_us"] = bench(
                            lambda dt=dt, a=a, b=b, o=offs, t=t_out: K.grouped_wgrad_triton(a, b, o, dt,
                                                                 transpose_out=t)) * 1e3
                except Exception as exc:  # noqa: BLE001 (a sweep: record and go on)
                    row[f"{key}_failed"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
            (OUT / "wgrad_probe.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'case':14s} {'cutlass':>9s} {'+cast':>9s}  best ours fp32 (config)   "
          f"default fp32   best ours bf16")
    for r in rows:
        fp32 = {k[:-8]: v for k, v in r.items() if k.endswith("_fp32_us")}
        bf16 = {k[:-8]: v for k, v in r.items() if k.endswith("_bf16_us")}
        best32, best16 = min(fp32, key=fp32.get), min(bf16, key=bf16.get)
        dflt = "x".join(map(str, CONFIGS[0]))
        print(f"{r['case']:14s} {r['cutlass_us']:8.1f}u {r['cutlass_cast_us']:8.1f}u  "
              f"{fp32[best32]:7.1f}u ({best32:14s}) {fp32.get(dflt, float('nan')):8.1f}u  "
              f"{bf16[best16]:7.1f}u ({best16})  err {r.get(best32 + '_fp32_err', 0):.1e}")


if __name__ == "__main__":
    main()
