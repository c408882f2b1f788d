"""Kernel benchmark: ours vs reference vs peer, fwd+bwd, on one GPU, in one process.

    PYTHONPATH=src python benchmarks/kernels.py
    python benchmarks/kernels.py --plot benchmarks/results/kernels/h100/kernels.json  # PNG only
    ... --name mamba3_scan_seq8192 --surfaces mamba3_scan --cases seq8192 \
        --backends triton_chunked,mamba_ssm                                      # a subset
    ... --name mamba3_mimo_scan --surfaces mamba3_mimo_scan                    # MIMO vs mamba_ssm

Measures the device ceilings first (a 1 GiB device-to-device copy, counting bytes read plus
written; an 8192^3 bf16 matmul), then every surface with a fast backend at its bench case(s).
Each backend's forward+backward (the forward alone for a surface without autograd, such as
muon_polynomial) is timed two ways (medians of CUDA events):

  ms          per call, as Python issues it: what an eager training step sees, the GPU idle
              while the host enqueues a backend of many small launches
  graphed_ms  replays of one call captured as a CUDA graph: the GPU's own time, launch gaps
              gone (--no-graphed skips it). A backend that cannot be captured (a host sync
              such as .item()/.tolist(), a capture error) gets ``graphed_failed``, the reason

Rates come in both flavours: tflops/gbs and their ratios to the ceilings (of_*) per call,
graphed_tflops/graphed_gbs/graphed_of_* from the replays. Prints a table and writes, to
``--out`` (default ``benchmarks/results/kernels/<device>``), ``<name>.json``, one ``bench``
receipt per surface/case under ``receipts/<name>/`` (metrics ``<backend>/ms`` and
``<backend>/graphed_ms``), ``<name>.png`` (when matplotlib is importable; else rerun with
--plot where it is) and the command (``command.txt``, or ``<name>.command.txt`` for a
``--name`` other than ``kernels``). A JSON without the graphed keys (``--no-graphed``) plots too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from megacpp.kernels.catalog import device_facts, rejection
from megacpp.kernels.registry import default_catalog
from megacpp.kernels.timing import cuda_times_ms, time_fwd_bwd, time_fwd_bwd_graphed

BENCH = {  # surface -> (cases, backends in table order)
    "rmsnorm": (["bench"], ["triton_fused", "torch_compile", "reference"]),
    "linear_cross_entropy": (["bench"], ["triton_chunked", "torch_plain", "liger"]),
    "moe_experts": (["e64_k8", "e16_k2"], ["grouped_mm", "reference"]),
    "attention": (["bench"], ["sdpa_flash", "reference"]),
    # the nam56r-350m step's attention over packed rows (12 / 2 heads, L 2048, two documents)
    "document_attention": (["step"], ["flex", "reference"]),
    # DSA's attention over the selected keys at nam56r-cut13's widths (8 heads, kv_lora_rank
    # 128, rope 32, top_k 512) over an 8k-token row, with the indexer KL's head-mean probs
    "sparse_attention": (["cut13_8k"], ["triton", "reference"]),
    # the nam56r R mixer's q | k | v conv: 16k tokens, 1024 channels of the in_proj output
    "short_conv": (["nam56r"], ["triton", "torch_compile", "reference"]),
    # nam56r presets' R mixer (4 heads, K 64, V 128) at 4k and 8k tokens; fla's 16 x 128 shape
    "gated_delta": (["nam56r_4k", "nam56r_8k", "h16_d128_4k"],
                    ["triton_chunked", "fla", "reference"]),
    # batch 8, 32 heads x 64, d_state 128, chunk 64 (the Mamba-3 target's shape); peer:
    # mamba_ssm 2.3.2
    "mamba3_scan": (["seq4096", "seq8192"], ["triton_chunked", "mamba_ssm", "reference"]),
    # Mamba-3 MIMO, rank 4, chunk 16 (mamba_ssm's tuned MIMO shape): ours (the intra-chunk
    # form in Triton, the rest PyTorch) against mamba_ssm's TileLang op
    "mamba3_mimo_scan": (["seq4096"], ["triton_intra", "mamba_ssm", "reference"]),
    # one Mamba-3 SISO decode step between in_proj and out_proj at nam56r-350m's M layers (24
    # heads x 64, d_state 64, 16 rotated pairs), batch 1 and 64; forward only (decode):
    # the fused kernel against the mixer's decode path (gather, ~100 small ops, scatter)
    "mamba3_step": (["nam56r_b1", "nam56r_b64"], ["triton_fused", "reference"]),
    # one Gated DeltaNet decode step between in_proj and o_proj at nam56r-350m's R layers (4
    # heads, K 64, V 128, 4 conv taps), batch 1 and 64; forward only (decode): the fused
    # kernel against the mixer's decode path (gather, conv step, norms, gates, rule, scatter)
    "gated_delta_step": (["nam56r_b1", "nam56r_b64"], ["triton_fused", "reference"]),
    # decode attention over the engine's paged K/V pool at nam56r-350m's A layers (12 / 2
    # heads of 64, 16-token blocks, ~384 tokens of context), batch 1 and 64; forward only:
    # the kernel (K/V read through the block table) against the gather + mask + einsum path
    "paged_attention_decode": (["nam56r_b1", "nam56r_b64"], ["triton", "reference"]),
    # Newton-Schulz's polynomial at nam56r-350m's Muon batches; forward only (no autograd).
    # FLOPs count A A whole (2 m^3 a matrix): the symmetric kernel's rate is an effective one
    "muon_polynomial": (["nam56r_moe_in", "nam56r_moe_out", "nam56r_dense"],
                        ["triton_symmetric", "reference"]),
}


def _median_ms(fn, repeats: int = 20) -> float:
    return statistics.median(cuda_times_ms(fn, warmup=3, iters=repeats))


def ceilings() -> dict[str, float]:
    """Copy bandwidth (GB/s, read+write) and bf16 matmul rate (TFLOP/s) on random data."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b)
    return {"copy_gbs": 2 * src.numel() * 4 / copy_ms / 1e6, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}


def dense_same_gemms_tflops(inputs: dict) -> float:
    """Rate of the MoE case's six GEMMs (fwd: x@W1^T, h@W2^T; bwd: dh, dW2, dx, dW1) run
    dense, as if all N = T*k rows went to one expert: same shapes, FLOPs and dtype, no
    routing, permutation or SwiGLU. The fair "dense rate" for the grouped path."""
    n = inputs["expert_idx"].numel()
    two_f, d = inputs["w_in"].shape[1:]
    f = two_f // 2
    shapes = [(n, d), (two_f, d), (d, f), (n, f), (n, d), (n, two_f)]
    x, w1, w2, h, dy, da = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes)

    def gemms() -> None:
        x @ w1.t(), h @ w2.t()  # forward
        dy @ w2, dy.t() @ h, da @ w1, da.t() @ x  # backward: dh, dW2, dx, dW1

    return 3 * 2 * n * d * (two_f + f) / _median_ms(gemms) / 1e9


def dense_equivalent_tflops(flops: float) -> float:
    """Rate of one dense bf16 GEMM doing ``flops`` (square-ish M x 4096 x 1024 shape)."""
    m = max(256, int(flops / 3 / (2 * 4096 * 1024)))
    a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    return 2 * m * 4096 * 1024 / _median_ms(lambda: a @ b) / 1e9


def rates(ms: float, flops: float | None, moved: float | None, ceil: dict[str, float],
          dense: float | None, same: float | None) -> dict[str, float]:
    """Achieved rates of a backend taking ``ms`` per fwd+bwd, and their ratios to the ceilings."""
    r: dict[str, float] = {}
    if flops:
        r["tflops"] = flops / ms / 1e9
        r["of_matmul_peak"] = r["tflops"] / ceil["matmul_tflops"]
    if moved:
        r["gbs"] = moved / ms / 1e6
        r["of_copy_peak"] = r["gbs"] / ceil["copy_gbs"]
    if dense:
        r["of_dense_equiv"] = r["tflops"] / dense
    if same:
        r["of_dense_same_gemms"] = r["tflops"] / same
    return r


def check_selection(surfaces: list[str] | None, cases: list[str] | None,
                    backends: list[str] | None) -> None:
    """Exit with the known names if ``--surfaces``, ``--cases`` or ``--backends`` names one
    the benchmark does not have (before any GPU work)."""
    for flag, given, known in (
            ("surfaces", surfaces, set(BENCH)),
            ("cases", cases, {c for cs, _ in BENCH.values() for c in cs}),
            ("backends", backends, {b for _, bs in BENCH.values() for b in bs})):
        unknown = sorted(set(given or ()) - known)
        if unknown:
            raise SystemExit(f"error: unknown --{flag} {unknown}; known: {sorted(known)}")


def run(out: Path, surfaces: list[str] | None = None, stem: str = "kernels",
        cases: list[str] | None = None, graphed: bool = True,
        backends: list[str] | None = None) -> list[dict]:
    """Every selected surface, case and backend (names checked by ``check_selection``)."""
    catalog, device = default_catalog(), torch.device("cuda")
    facts = device_facts(device)
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s")
    rows = []
    for name, (bench_cases, all_backends) in BENCH.items():
        if surfaces and name not in surfaces:
            continue
        surface = catalog.surface(name)
        for case in bench_cases:
            if cases and case not in cases:
                continue
            gen = torch.Generator(device=device).manual_seed(0)
            inputs = surface.make_inputs(surface.cases[case], torch.bfloat16, device, gen)
            flops = surface.flops(inputs) if surface.flops else None
            moved = surface.bytes_moved(inputs) if surface.bytes_moved else None
            dense = dense_equivalent_tflops(flops) if name == "moe_experts" else None
            same = dense_same_gemms_tflops(inputs) if name == "moe_experts" else None
            for backend_name in all_backends:
                if backends and backend_name not in backends:
                    continue
                backend = catalog.backend(name, backend_name)
                why = rejection(backend, facts, "bfloat16")
                if why is not None:
                    rows.append({"surface": name, "case": case, "backend": backend_name,
                                 "skipped": why})
                    continue
                try:
                    t = time_fwd_bwd(backend.fn, inputs, surface.grad_args, device, repeats=10)
                except RuntimeError as exc:  # a peer that refuses this stack: say why, go on
                    rows.append({"surface": name, "case": case, "backend": backend_name,
                                 "skipped": f"error: {str(exc)[:200]}"})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                row = {"surface": name, "case": case, "backend": backend_name,
                       "role": backend.role, "ms": t.median_ms,
                       "peak_extra_gib": t.peak_extra_bytes / 2**30,
                       **rates(t.median_ms, flops, moved, ceil, dense, same)}
                if dense:
                    row["dense_equiv_tflops"] = dense
                if same:
                    row["dense_same_gemms_tflops"] = same
                if graphed:
                    g = time_fwd_bwd_graphed(backend.fn, inputs, surface.grad_args, device,
                                             repeats=10)
                    if g.median_ms is None:
                        row["graphed_failed"] = g.failure
                    else:
                        row["graphed_ms"] = g.median_ms
                        row.update({f"graphed_{k}": v for k, v in
                                    rates(g.median_ms, flops, moved, ceil, dense, same).items()})
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
            # after every case: a run cut short by a time limit keeps what it measured
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{stem}.json").write_text(json.dumps(
                {"ceilings": ceil, "device": facts.to_dict(), "rows": rows}, indent=2))
            _receipts(out / "receipts" / stem, ceil,
                      [r for r in rows if (r["surface"], r["case"]) == (name, case)])
    return rows


def _receipts(out: Path, ceil: dict[str, float], rows: list[dict]) -> None:
    from megacpp.receipts import write_receipt

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "ms" in r:
            groups.setdefault((r["surface"], r["case"]), []).append(r)
    for (surface, case), group in groups.items():
        metrics = {f"{r['backend']}/ms": r["ms"] for r in group}
        metrics.update({f"{r['backend']}/graphed_ms": r["graphed_ms"] for r in group
                        if "graphed_ms" in r})
        metrics.update({f"{r['backend']}/peak_extra_gib": r["peak_extra_gib"] for r in group})
        metrics.update({f"ceiling/{k}": v for k, v in ceil.items()})
        write_receipt(out / f"{surface}_{case}.receipt.json", "bench",
                      {"script": "benchmarks/kernels.py", "surface": surface, "case": case,
                       "dtype": "bfloat16"}, metrics,
                      kernels={r["backend"]: r["role"] for r in group})


def print_table(rows: list[dict]) -> None:
    """Per-call and (graph) replay columns side by side; capture failures listed below."""
    print(f"{'surface':22} {'case':8} {'backend':15} {'ms':>9} {'(graph)':>9} {'GiB':>6} "
          f"{'TFLOP/s':>8} {'(graph)':>8} {'GB/s':>7} {'(graph)':>7}")
    for r in rows:
        if "ms" not in r:
            print(f"{r['surface']:22} {r['case']:8} {r['backend']:15} skipped: {r['skipped']}")
            continue
        gms = (f"{r['graphed_ms']:.3f}" if "graphed_ms" in r else
               "failed" if "graphed_failed" in r else "")
        tf, gtf, gb, ggb = (f"{r[k]:.0f}" if k in r else "" for k in
                            ("tflops", "graphed_tflops", "gbs", "graphed_gbs"))
        print(f"{r['surface']:22} {r['case']:8} {r['backend']:15} {r['ms']:9.3f} {gms:>9} "
              f"{r['peak_extra_gib']:6.2f} {tf:>8} {gtf:>8} {gb:>7} {ggb:>7}")
    for r in rows:
        if "graphed_failed" in r:
            print(f"no graph for {r['surface']}/{r['case']}/{r['backend']}: {r['graphed_failed']}")


def plot(results: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in json.loads(results.read_text())["rows"] if "ms" in r]
    groups = sorted({(r["surface"], r["case"]) for r in rows}, key=str)
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.6), squeeze=False)
    for ax, (surface, case) in zip(axes[0], groups):
        group = [r for r in rows if (r["surface"], r["case"]) == (surface, case)]
        colors = ["tab:green" if r["role"] == "chosen" else "tab:gray" for r in group]
        x = range(len(group))
        if any("graphed_ms" in r for r in group):  # per call solid, graph replay hatched
            ax.bar([i - 0.2 for i in x], [r["ms"] for r in group], 0.4, color=colors,
                   label="per call")
            ax.bar([i + 0.2 for i in x], [r.get("graphed_ms", 0.0) for r in group], 0.4,
                   color=colors, alpha=0.5, hatch="//", label="graph replay")
            ax.legend(fontsize=6)
        else:
            ax.bar(x, [r["ms"] for r in group], color=colors)
        ax.set_xticks(list(x), [r["backend"] for r in group])
        ax.set_title(f"{surface}\n{case}", fontsize=9)
        ax.set_ylabel("fwd+bwd ms" if default_catalog().surface(surface).grad_args else "fwd ms")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    png = results.with_suffix(".png")
    fig.savefig(png, dpi=120)
    return png


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default: benchmarks/results/kernels/<device>)")
    parser.add_argument("--plot", type=Path, help="only draw the PNG from a kernels.json")
    parser.add_argument("--surfaces", help="comma-separated surfaces to run (default: all)")
    parser.add_argument("--cases", help="comma-separated cases to run (default: all of each surface)")
    parser.add_argument("--name", default="kernels", help="stem of the JSON/PNG written")
    parser.add_argument("--backends",
                        help="comma-separated backends to time (default: all of each surface; "
                             "e.g. leave out the slow reference with triton_chunked,mamba_ssm)")
    parser.add_argument("--no-graphed", action="store_true",
                        help="skip the CUDA-graph replay timing (per-call times only)")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return 0
    surfaces, cases, backends = (v.split(",") if v else None
                                 for v in (args.surfaces, args.cases, args.backends))
    check_selection(surfaces, cases, backends)
    if not torch.cuda.is_available():
        print("error: benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    from megacpp.receipts.results import begin, results_dir

    args.out = begin(args.out or results_dir("kernels"), args.name, "kernels")
    rows = run(args.out, surfaces, args.name, cases, graphed=not args.no_graphed,
               backends=backends)
    print_table(rows)
    try:
        print(plot(args.out / f"{args.name}.json"))
    except ImportError:
        print("matplotlib not importable here: run --plot on the JSON elsewhere")
    return 0


if __name__ == "__main__":
    sys.exit(main())
