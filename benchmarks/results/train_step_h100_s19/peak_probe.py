"""The MFU denominator's spread: matmul_peak_tflops as it is now (2 s of back-to-back GEMMs
before timing) and as it was (settle_s=0: only the warm-up call), alternately, four times
each in one process, on a card that idled before the call.
usage: python benchmarks/results/train_step_h100_s19/peak_probe.py"""
import json

import torch

from megacpp.kernels.timing import matmul_peak_tflops

rows = []
for i in range(4):
    for settle in (0.0, 2.0):
        rows.append({"round": i, "settle_s": settle, "tflops": matmul_peak_tflops(
            iters=30 if settle == 0 else 100, settle_s=settle)})
        print(json.dumps(rows[-1]), flush=True)
print(torch.cuda.get_device_name())
for settle in (0.0, 2.0):
    v = [r["tflops"] for r in rows if r["settle_s"] == settle]
    print(f"settle {settle:.0f} s: {min(v):.0f}-{max(v):.0f} TFLOP/s")
