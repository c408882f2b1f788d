"""Kernel benchmark: ours vs reference vs peer, fwd+bwd, on one GPU, in one process.

    PYTHONPATH=src python benchmarks/kernels.py --out benchmarks/results/kernels
    python benchmarks/kernels.py --plot benchmarks/results/kernels/kernels.json   # PNG only

Measures the device ceilings first (a 1 GiB device-to-device copy, counting bytes read plus
written; an 8192^3 bf16 matmul), then every surface with a fast backend at its bench case(s).
Prints a table, writes ``kernels.json``, one ``bench`` receipt per surface/case and
``kernels.png`` (when matplotlib is importable; else rerun with --plot where it is).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megacpp.kernels.catalog import device_facts, rejection
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import time_fwd_bwd

BENCH = {  # surface -> (cases, backends in table order)
    "rmsnorm": (["bench"], ["triton_fused", "torch_compile", "reference"]),
    "linear_cross_entropy": (["bench"], ["triton_chunked", "torch_plain", "liger"]),
    "moe_experts": (["e64_k8", "e16_k2"], ["grouped_mm", "reference"]),
    "attention": (["bench"], ["sdpa_flash", "reference"]),
}


def _median_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def ceilings() -> dict[str, float]:
    """Copy bandwidth (GB/s, read+write) and bf16 matmul rate (TFLOP/s) on random data."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b)
    return {"copy_gbs": 2 * src.numel() * 4 / copy_ms / 1e6, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}


def dense_equivalent_tflops(flops: float) -> float:
    """Rate of one dense bf16 GEMM doing ``flops`` (square-ish M x 4096 x 1024 shape)."""
    m = max(256, int(flops / 3 / (2 * 4096 * 1024)))
    a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    return 2 * m * 4096 * 1024 / _median_ms(lambda: a @ b) / 1e9


def run(out: Path) -> list[dict]:
    catalog, device = default_catalog(), torch.device("cuda")
    facts = device_facts(device)
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s")
    rows = []
    for name, (cases, backends) in BENCH.items():
        surface = catalog.surface(name)
        for case in cases:
            gen = torch.Generator(device=device).manual_seed(0)
            inputs = surface.make_inputs(surface.cases[case], torch.bfloat16, device, gen)
            flops = surface.flops(inputs) if surface.flops else None
            moved = surface.bytes_moved(inputs) if surface.bytes_moved else None
            dense = dense_equivalent_tflops(flops) if name == "moe_experts" else None
            for backend_name in backends:
                backend = catalog.backend(name, backend_name)
                why = rejection(backend, facts, "bfloat16")
                if why is not None:
                    rows.append({"surface": name, "case": case, "backend": backend_name,
                                 "skipped": why})
                    continue
                t = time_fwd_bwd(backend.fn, inputs, surface.grad_args, device, repeats=10)
                row = {"surface": name, "case": case, "backend": backend_name,
                       "role": backend.role, "ms": t.median_ms,
                       "peak_extra_gib": t.peak_extra_bytes / 2**30}
                if flops:
                    row["tflops"] = flops / t.median_ms / 1e9
                    row["of_matmul_peak"] = row["tflops"] / ceil["matmul_tflops"]
                if moved:
                    row["gbs"] = moved / t.median_ms / 1e6
                    row["of_copy_peak"] = row["gbs"] / ceil["copy_gbs"]
                if dense:
                    row["dense_equiv_tflops"] = dense
                    row["of_dense_equiv"] = row["tflops"] / dense
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps({"ceilings": ceil, "device": facts.to_dict(),
                                                  "rows": rows}, indent=2))
    _receipts(out, ceil, rows)
    return rows


def _receipts(out: Path, ceil: dict[str, float], rows: list[dict]) -> None:
    from megacpp.receipts import write_receipt

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "ms" in r:
            groups.setdefault((r["surface"], r["case"]), []).append(r)
    for (surface, case), group in groups.items():
        metrics = {f"{r['backend']}/ms": r["ms"] for r in group}
        metrics.update({f"{r['backend']}/peak_extra_gib": r["peak_extra_gib"] for r in group})
        metrics.update({f"ceiling/{k}": v for k, v in ceil.items()})
        write_receipt(out / f"{surface}_{case}.receipt.json", "bench",
                      {"script": "benchmarks/kernels.py", "surface": surface, "case": case,
                       "dtype": "bfloat16"}, metrics,
                      kernels={r["backend"]: r["role"] for r in group})


def print_table(rows: list[dict]) -> None:
    print(f"{'surface':22} {'case':8} {'backend':15} {'ms':>9} {'GiB':>6} {'TFLOP/s':>8} {'GB/s':>7}")
    for r in rows:
        if "ms" not in r:
            print(f"{r['surface']:22} {r['case']:8} {r['backend']:15} skipped: {r['skipped']}")
            continue
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        gb = f"{r['gbs']:.0f}" if "gbs" in r else ""
        print(f"{r['surface']:22} {r['case']:8} {r['backend']:15} {r['ms']:9.3f} "
              f"{r['peak_extra_gib']:6.2f} {tf:>8} {gb:>7}")


def plot(results: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in json.loads(results.read_text())["rows"] if "ms" in r]
    groups = sorted({(r["surface"], r["case"]) for r in rows}, key=str)
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.6))
    for ax, (surface, case) in zip(axes, groups):
        group = [r for r in rows if (r["surface"], r["case"]) == (surface, case)]
        ax.bar([r["backend"] for r in group], [r["ms"] for r in group],
               color=["tab:green" if r["role"] == "chosen" else "tab:gray" for r in group])
        ax.set_title(f"{surface}\n{case}", fontsize=9)
        ax.set_ylabel("fwd+bwd ms")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    png = results.with_suffix(".png")
    fig.savefig(png, dpi=120)
    return png


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels"))
    parser.add_argument("--plot", type=Path, help="only draw the PNG from a kernels.json")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return 0
    if not torch.cuda.is_available():
        print("error: benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    rows = run(args.out)
    print_table(rows)
    try:
        print(plot(args.out / "kernels.json"))
    except ImportError:
        print("matplotlib not importable here: run --plot on the JSON elsewhere")
    return 0


if __name__ == "__main__":
    sys.exit(main())
