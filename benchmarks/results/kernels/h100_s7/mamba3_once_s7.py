"""One (or N) fwd+bwd of our Mamba-3 scan at the benchmark shape (L from argv), for ncu / the
torch profiler. PYTHONPATH=$PWD/src python3 .device-carry/s7/once.py [L] [prof]"""
import sys
import torch
from megacpp.kernels.ops.mamba3_scan.triton import mamba3_scan_triton
from megacpp.kernels.registry import _mamba3_inputs

L = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
PROF = len(sys.argv) > 2 and sys.argv[2] == "prof"
case = {"batch": 8, "seq": L, "groups": 1, "heads": 32, "d_state": 128, "headdim": 64,
        "angles": 32, "chunk": 64}
gen = torch.Generator(device="cuda").manual_seed(0)
inp = _mamba3_inputs(case, torch.bfloat16, "cuda", gen)
names = [n for n in inp if n != "chunk_size"]
dy = torch.randn_like(inp["v"])


def step():
    y, _ = mamba3_scan_triton(**{n: inp[n] for n in names}, chunk_size=64)
    torch.autograd.grad(y, [inp[n] for n in names], dy)


step()
torch.cuda.synchronize()
if PROF:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
