"""The MFU denominator again (session 19's probe; its results did not come back): four rounds,
in one process, of matmul_peak_tflops without and with its 2 s settle, and then the rate of the
step's commonest dense GEMM ([16384, 768] x [768, 1536], bf16; 42 calls per step) right after
the settled peak: 100 calls back to back between two CUDA events (a 57 us kernel timed one call
per event pair would include its launch).
usage: PYTHONPATH=$PWD/src python benchmarks/results/train_step_h100_s20/peak_probe.py"""
import json

import torch

from megacpp.kernels.timing import matmul_peak_tflops

a = torch.randn(16384, 768, device="cuda", dtype=torch.bfloat16)
b = torch.randn(768, 1536, device="cuda", dtype=torch.bfloat16)
rows = []
for i in range(4):
    for settle in (0.0, 2.0):
        rows.append({"round": i, "settle_s": settle, "tflops": matmul_peak_tflops(
            iters=30 if settle == 0 else 100, settle_s=settle)})
        print(json.dumps(rows[-1]), flush=True)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(100):
        a @ b
    end.record()
    torch.cuda.synchronize()
    ms = begin.elapsed_time(end) / 100
    rows.append({"round": i, "step_gemm_tflops": 2 * 16384 * 768 * 1536 / (ms * 1e-3) / 1e12})
    print(json.dumps(rows[-1]), flush=True)
print(torch.cuda.get_device_name())
for settle in (0.0, 2.0):
    v = [r["tflops"] for r in rows if r.get("settle_s") == settle]
    print(f"settle {settle:.0f} s: {min(v):.0f}-{max(v):.0f} TFLOP/s")
v = [r["step_gemm_tflops"] for r in rows if "step_gemm_tflops" in r]
print(f"step GEMM 16384x768x1536: {min(v):.0f}-{max(v):.0f} TFLOP/s")
