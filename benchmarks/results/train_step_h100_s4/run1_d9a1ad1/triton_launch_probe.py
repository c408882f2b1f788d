"""Host cost of one Triton launch on this machine: JITFunction.run vs the compiled handle."""
import cProfile, pstats, time, io, sys, json
import torch, triton
from megacpp.kernels.ops.moe import triton as mt
from megacpp.kernels.ops.moe.grouped import dispatch_plan

dev = "cuda"
def host_us(fn, n=400):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / n * 1e6

src = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
idx = torch.randint(0, 64, (64,), device=dev)
out = torch.empty(64, 256, device=dev, dtype=torch.bfloat16)
grid = (8,)
kw = dict(BLOCK_R=8, BLOCK_C=256, C_CONST=0, num_warps=4)
def jit(): mt._gather_rows_kernel[grid](src, idx, out, 64, 256, **kw)
ck = mt._gather_rows_kernel[grid](src, idx, out, 64, 256, **kw)
args = (src, idx, out, 64, 256, 8, 256, 0)
runner = ck[(8, 1, 1)]
def handle(): runner(*args)
ck._init_handles()
stream = torch.cuda.current_stream().cuda_stream
def direct(): ck.run(8, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *args)
x = torch.zeros(64, device=dev)
def tadd(): x.add_(1)
res = {"jit_us": host_us(jit), "handle_us": host_us(handle), "direct_us": host_us(direct), "torch_add_us": host_us(tadd)}
ids = torch.randint(0, 16, (16384, 2), device=dev); wts = torch.rand(16384, 2, device=dev)
res["plan_e16_us"] = host_us(lambda: dispatch_plan(ids, 16, wts), 200)
xx = torch.randn(16384, 1024, device=dev, dtype=torch.bfloat16)
res["gather_rows_call_us"] = host_us(lambda: mt.gather_rows_triton(src, idx))
print(json.dumps(res))
pr = cProfile.Profile(); pr.enable()
for _ in range(300): jit()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:5000])
import os; print("cpu:", open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0], os.cpu_count())
