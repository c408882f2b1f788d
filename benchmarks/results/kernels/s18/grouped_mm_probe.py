"""Grouped-GEMM probe (dev record, session 18): the nam56r-350m step's six MoE GEMMs.

The step's MoE (d 768, 16 experts top-2, expert ffn 272, 16384 tokens -> 32768 routed rows)
runs its six grouped GEMMs through ``torch._grouped_mm`` (CUTLASS, sm90: 128x256x64 tiles,
cluster 2x1) at 215-400 TFLOP/s, where the step's dense GEMMs run at ~650. The 272 / 544
wide sides waste most of a 256-wide tile. For each GEMM this times, by CUDA-graph replay
(``triton.testing.do_bench_cudagraph``, median):

  eager     torch._grouped_mm as the MoE calls it now
  trans     the same product computed transposed (C^T = B^T A^T, so the narrow side falls
            on the tile's 128-wide M), eager
  inductor  torch.compile(mode="max-autotune-no-cudagraphs") of the call: Inductor picks
            between the ATen kernel and its Triton grouped-GEMM template by timing them

and checks each against eager (relative max error; bf16 output rounding).

    python benchmarks/results/kernels/s18/grouped_mm_probe.py [OUT] [--no-inductor]
        [--shapes=step,e64,e16]   (default: step)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

OUT = Path(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-")
           else os.environ.get("OUT") or "/tmp")
INDUCTOR = "--no-inductor" not in sys.argv
# the step's MoE, and the kernel benchmark's two moe_experts cases (registry.py)
SHAPES = {"step": {"tokens": 16384, "d": 768, "experts": 16, "k": 2, "f": 272},
          "e64": {"tokens": 16384, "d": 1024, "experts": 64, "k": 8, "f": 512},
          "e16": {"tokens": 16384, "d": 1024, "experts": 16, "k": 2, "f": 2048}}
PICK = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--shapes=")), "step")
gm = torch._grouped_mm

for knob in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, knob):
        setattr(torch._dynamo.config, knob, 256)


def routed_offs(tokens: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Group ends of a random top-k routing (near balanced, as the aux-free bias keeps it),
    each group's size rounded to a multiple of 8 rows: a ragged-N output (the transposed
    forms) needs 16-byte group widths, else ``_grouped_mm`` asserts on the device."""
    idx = torch.rand(tokens, experts, generator=gen, device="cuda").topk(k, -1).indices
    counts = torch.bincount(idx.reshape(-1), minlength=experts) // 8 * 8
    counts[-1] = tokens * k - counts[:-1].sum()
    return counts.cumsum(0).to(torch.int32)


def cases(tokens=16384, d=768, experts=16, k=2, f=272, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = tokens * k

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    offs = routed_offs(tokens, experts, k, g)
    xs, hid, dy, dgu = r(n, d), r(n, f), r(n, d), r(n, 2 * f)
    w_in, w_out = r(experts, 2 * f, d) * d**-0.5, r(experts, d, f) * f**-0.5
    # name: (eager thunk, transposed thunk returning the eager layout's transpose, flops)
    return offs, {
        "fwd gate|up  [N,D]@[E,D,2F]": (
            lambda: gm(xs, w_in.transpose(-2, -1), offs=offs),
            lambda: gm(w_in, xs.t(), offs=offs),  # [2F, N]
            2 * n * d * 2 * f),
        "fwd down     [N,F]@[E,F,D]": (
            lambda: gm(hid, w_out.transpose(-2, -1), offs=offs),
            lambda: gm(w_out, hid.t(), offs=offs),  # [D, N]
            2 * n * f * d),
        "bwd dhidden  [N,D]@[E,D,F]": (
            lambda: gm(dy, w_out, offs=offs),
            lambda: gm(w_out.transpose(-2, -1), dy.t(), offs=offs),  # [F, N]
            2 * n * d * f),
        "bwd dw_out   [D,N]@[N,F]": (
            lambda: gm(dy.t(), hid, offs=offs),
            lambda: gm(hid.t(), dy, offs=offs),  # [E, F, D]
            2 * n * d * f),
        "bwd dx       [N,2F]@[E,2F,D]": (
            lambda: gm(dgu, w_in, offs=offs),
            lambda: gm(w_in.transpose(-2, -1), dgu.t(), offs=offs),  # [D, N]
            2 * n * 2 * f * d),
        "bwd dw_in    [2F,N]@[N,D]": (
            lambda: gm(dgu.t(), xs, offs=offs),
            lambda: gm(xs.t(), dgu, offs=offs),  # [E, D, 2F]
            2 * n * 2 * f * d),
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def compiled(thunk):
    """A fresh function object per GEMM, compiled with max-autotune."""
    def call():
        return thunk()
    return torch.compile(call, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192**3 / bench(lambda: a @ a) / 1e9
    dense = torch.randn(32768, 768, device="cuda", dtype=torch.bfloat16)
    wd = torch.randn(768, 544, device="cuda", dtype=torch.bfloat16)
    dense_rate = 2 * 32768 * 768 * 544 / bench(lambda: dense @ wd) / 1e9
    print(f"8192^3 bf16 matmul {peak:.0f} TFLOP/s; dense [32768,768]@[768,544] "
          f"{dense_rate:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in PICK.split(","):
        offs, gemms = cases(**SHAPES[shape])
        print(shape, SHAPES[shape], "offs", offs.tolist(), flush=True)
        for name, (eager, trans, flops) in gemms.items():
            rows.append(probe(f"{shape} {name}", eager, trans, flops))
            (OUT / "grouped_mm_probe.json").write_text(json.dumps(
                {"peak_tflops": peak, "dense_tflops": dense_rate, "rows": rows}, indent=1))
    report(rows)


def probe(name, eager, trans, flops) -> dict:
    ref = eager()
    row = {"gemm": name, "flops": flops}
    row["eager_ms"] = bench(eager)
    t_out = trans()
    row["trans_err"] = rel_err(t_out.transpose(-2, -1), ref)
    row["trans_ms"] = bench(trans)
    if INDUCTOR:
        t0 = time.time()
        try:
            fn = compiled(eager)
            c_out = fn()
            row["compile_s"] = time.time() - t0
            row["inductor_err"] = rel_err(c_out, ref)
            row["inductor_ms"] = bench(fn)
        except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
            row["inductor_failed"] = f"{type(exc).__name__}: {exc}"[:300]
    for key in ("eager", "trans", "inductor"):
        if f"{key}_ms" in row:
            row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
    print(json.dumps(row), flush=True)
    return row


def report(rows: list[dict]) -> None:
    print(f"\n{'gemm':38s} {'eager':>14s} {'transposed':>14s} {'inductor':>14s}")
    for r in rows:
        cells = [f"{r[k + '_ms'] * 1e3:6.1f}us {r[k + '_tflops']:4.0f}" if k + "_ms" in r
                 else f"{'-':>14s}" for k in ("eager", "trans", "inductor")]
        print(f"{r['gemm']:38s} " + " ".join(cells))
    for shape in sorted({r["gemm"].split()[0] for r in rows}):
        mine = [r for r in rows if r["gemm"].split()[0] == shape]
        tot = {k: sum(r.get(f"{k}_ms", float("nan")) for r in mine)
               for k in ("eager", "trans", "inductor")}
        best = sum(min(r.get(f"{k}_ms", 1e9) for k in ("eager", "trans", "inductor"))
                   for r in mine)
        print(f"{shape}: sum of the six (ms): eager {tot['eager']:.3f}, transposed "
              f"{tot['trans']:.3f}, inductor {tot['inductor']:.3f}, best of each {best:.3f}")


if __name__ == "__main__":
    main()
