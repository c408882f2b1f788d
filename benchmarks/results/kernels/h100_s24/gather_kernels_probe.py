"""The expert GEMM kernels with their permuted operand gathered through the plan, against the
same kernel reading rows written out by the scatter (and the scatter itself), one process, at
the bench's e64_k8 / e16_k2 and the nam56r-350m step's MoE shapes: the gate|up + SwiGLU kernel
and d hidden (grouped_mm, A gathered; software-pipelining depths), dw_in and dw_out (wgrad,
B gathered; depths). us per call: 10 calls back to back between two CUDA events, median of 5.
Every gathered result is compared bit for bit with the written-out one. Writes OUT.json and a
bench receipt.

    PYTHONPATH=src python benchmarks/results/kernels/h100_s24/gather_kernels_probe.py OUT.json
"""

import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

from megacpp.kernels.ops.moe import triton as K
from megacpp.kernels.ops.moe.grouped import dispatch_plan
from megacpp.receipts import write_receipt

CASES = {  # tokens, d, experts, top_k, ffn
    "e64_k8": (16384, 1024, 64, 8, 512),
    "e16_k2": (16384, 1024, 16, 2, 2048),
    "step": (16384, 768, 16, 2, 272),
}


def us(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        torch.cuda.synchronize()
        runs.append(a.elapsed_time(b) * 100)  # ms per 10 calls -> us per call
    return statistics.median(runs)


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    rows, metrics = [], {}

    def say(case, what, t, exact=None):
        row = {"case": case, "what": what, "us": round(t, 2), "exact": exact}
        rows.append(row)
        metrics[f"{case}/{what}_us"] = t
        print(json.dumps(row), flush=True)

    for case, (t, d, e, k, f) in CASES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        idx = torch.rand(t, e, generator=g, device=dev).topk(k, dim=-1).indices
        w = torch.rand(t, k, generator=g, device=dev) + 0.1
        order, inv, offs, w_sorted = dispatch_plan(idx, e, w)
        x = torch.randn(t, d, generator=g, device=dev).bfloat16()
        dout = torch.randn(t, d, generator=g, device=dev).bfloat16()
        w_in = (torch.randn(e, 2 * f, d, generator=g, device=dev) * d**-0.5).bfloat16()
        w_out = (torch.randn(e, d, f, generator=g, device=dev) * f**-0.5).bfloat16()
        n = t * k
        dgu = torch.randn(n, 2 * f, generator=g, device=dev).bfloat16()
        hidden = torch.randn(n, f, generator=g, device=dev).bfloat16()
        x_sorted = K.scatter_rows_triton(x, inv)
        dy_sorted = K.scatter_rows_triton(dout, inv)
        say(case, "scatter", us(partial(K.scatter_rows_triton, x, inv)))
        # gate|up + SwiGLU (where a setting ships), else the plain gate|up kernel's shape
        if (2 * f, d) in K.SWIGLU_CONFIGS:
            base = dict(K.SWIGLU_CONFIGS[(2 * f, d)])
            ref = K.grouped_swiglu_triton(x_sorted, w_in, offs, w_sorted)
            say(case, "gate_up_swiglu/written", us(
                partial(K.grouped_swiglu_triton, x_sorted, w_in, offs, w_sorted)))
            for stages in (3, 4):
                K.SWIGLU_CONFIGS[(2 * f, d)] = {**base, "num_stages": stages}
                fn = partial(K.grouped_swiglu_triton, x, w_in, offs, w_sorted, order=order,
                             top_k=k)
                say(case, f"gate_up_swiglu/gathered_s{stages}", us(fn), same(fn(), ref))
            K.SWIGLU_CONFIGS[(2 * f, d)] = base
        if (f, d) in K.GROUPED_CONFIGS:  # d hidden = dy_sorted @ w_out[e]
            base = dict(K.GROUPED_CONFIGS[(f, d)])
            ref = K.grouped_mm_triton(dy_sorted, w_out, offs, False)
            say(case, "d_hidden/written", us(
                partial(K.grouped_mm_triton, dy_sorted, w_out, offs, False)))
            for stages in sorted({base["num_stages"], 3}):
                K.GROUPED_CONFIGS[(f, d)] = {**base, "num_stages": stages}
                fn = partial(K.grouped_mm_triton, dout, w_out, offs, False, order=order, top_k=k)
                say(case, f"d_hidden/gathered_s{stages}", us(fn), same(fn(), ref))
            K.GROUPED_CONFIGS[(f, d)] = base
        for what, a, src, b_sorted, t_out in (("dw_in", dgu, x, x_sorted, False),
                                              ("dw_out", hidden, dout, dy_sorted, True)):
            ref = K.grouped_wgrad_triton(a, b_sorted, offs, torch.float32, t_out)
            say(case, f"{what}/written", us(
                partial(K.grouped_wgrad_triton, a, b_sorted, offs, torch.float32, t_out)))
            for stages in (4, 5, 6):
                K.WGRAD_GATHER_STAGES = stages
                fn = partial(K.grouped_wgrad_triton, a, src, offs, torch.float32, t_out, order,
                             k)
                say(case, f"{what}/gathered_s{stages}", us(fn), same(fn(), ref))
            K.WGRAD_GATHER_STAGES = 5
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    write_receipt(out.with_suffix(".receipt.json"), "bench",
                  {"script": "benchmarks/results/kernels/h100_s24/gather_kernels_probe.py",
                   "dtype": "bfloat16", "cases": CASES}, metrics, [out])


if __name__ == "__main__":
    main()
