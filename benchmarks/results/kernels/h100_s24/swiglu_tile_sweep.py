"""Launch settings of the gate|up GEMM with the SwiGLU in its epilogue (grouped_swiglu_triton)
beyond session 23's four: row blocks of 256 (two warpgroups), K blocks of 32 and 128, 4 warps,
2 stages. At the bench's e64_k8 / e16_k2 shapes and the nam56r-350m step's, against the shipped
setting and torch._grouped_mm followed by the SwiGLU kernel, all in one process. Each is timed
as a CUDA graph of 10 calls (no host launch cost: this host's launches outran the step shape's
~80 us kernels), replayed 20 times, median, divided by 10; gate|up and hidden compared bit for
bit with the shipped setting's. Writes OUT.json and a bench receipt.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s24/swiglu_tile_sweep.py OUT.json
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from megacpp.kernels import timing
from megacpp.kernels.ops.moe import triton as K
from megacpp.kernels.ops.moe.grouped import dispatch_plan, grouped_mm_torch
from megacpp.receipts import write_receipt

CASES = {  # tokens, d, experts, top_k, ffn
    "e64_k8": (16384, 1024, 64, 8, 512),
    "e16_k2": (16384, 1024, 16, 2, 2048),
    "step": (16384, 768, 16, 2, 272),
}
SETTINGS = {  # name -> (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    "shipped": None,
    "m256_n64_w8_s3": (256, 64, 64, 8, 3),
    "m256_n64_w8_s2": (256, 64, 64, 8, 2),
    "m128_n64_k32_w8_s5": (128, 64, 32, 8, 5),
    "m128_n64_k128_w8_s2": (128, 64, 128, 8, 2),
    "m128_n64_w4_s3": (128, 64, 64, 4, 3),
    "m128_n64_w8_s2": (128, 64, 64, 8, 2),
    "m256_n32_w8_s3": (256, 32, 64, 8, 3),
    "m64_n128_w4_s3": (64, 128, 64, 4, 3),
}


def graph_us(fn, calls: int = 10) -> float:
    graph, _ = timing.capture_graph(lambda: [fn() for _ in range(calls)])
    return statistics.median(timing.cuda_times_ms(graph.replay, warmup=3, iters=20)) * 1e3 / calls


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    rows, metrics = [], {}
    for case, (t, d, e, k, f) in CASES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        idx = torch.rand(t, e, generator=g, device=dev).topk(k, dim=-1).indices
        w = torch.rand(t, k, generator=g, device=dev) + 0.1
        _order, inv, offs, w_sorted = dispatch_plan(idx, e, w)
        x = torch.randn(t, d, generator=g, device=dev).bfloat16()
        x_sorted = K.scatter_rows_triton(x, inv)
        w_in = (torch.randn(e, 2 * f, d, generator=g, device=dev) * d**-0.5).bfloat16()
        key = (2 * f, d)
        shipped = dict(K.SWIGLU_CONFIGS[key])

        def separate(x_sorted=x_sorted, w_in=w_in, offs=offs, w_sorted=w_sorted):
            gate_up = grouped_mm_torch(x_sorted, w_in, offs, True)
            return gate_up, K.swiglu_weighted_triton(gate_up, w_sorted)

        ref = None
        for name, s in {"separate (torch._grouped_mm + SwiGLU kernel)": "sep", **SETTINGS}.items():
            if s == "sep":
                fn = separate
            else:
                K.SWIGLU_CONFIGS[key] = shipped if s is None else {
                    "BLOCK_M": s[0], "BLOCK_N": s[1], "BLOCK_K": s[2], "num_warps": s[3],
                    "num_stages": s[4]}
                fn = (lambda x_sorted=x_sorted, w_in=w_in, offs=offs, w_sorted=w_sorted:
                      K.grouped_swiglu_triton(x_sorted, w_in, offs, w_sorted))
            try:
                got = fn()
                us = graph_us(fn)
            except Exception as exc:  # noqa: BLE001 (a setting that does not compile is a result)
                row = {"case": case, "setting": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            if s is None:
                ref = got
            exact = None if ref is None or s == "sep" else all(
                torch.equal(a, b) for a, b in zip(got, ref))
            row = {"case": case, "setting": name, "us": round(us, 2), "exact_vs_shipped": exact}
            rows.append(row)
            metrics[f"{case}/{name}_us"] = us
            print(json.dumps(row), flush=True)
        K.SWIGLU_CONFIGS[key] = shipped
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s24/swiglu_tile_sweep.py",
                   "dtype": "bfloat16", "cases": CASES,
                   "settings": {k: v for k, v in SETTINGS.items() if v}}, metrics, [out])


if __name__ == "__main__":
    main()
