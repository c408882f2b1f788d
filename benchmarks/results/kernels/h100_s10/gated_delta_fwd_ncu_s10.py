"""Session 10: one forward of our gated delta rule and of fla's at the nam56r 4k shape (bf16),
inside a cudaProfilerStart/Stop range (both warmed up first: Triton compilation and fla's
autotuning happen outside it). Run as
    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... python3 THIS"""
import torch

from megacpp.kernels.ops.gated_delta.triton import gated_delta_rule_triton
from megacpp.kernels.peers import fla_chunk_gated_delta_rule
from megacpp.kernels.registry import default_catalog

surface = default_catalog().surface("gated_delta")
gen = torch.Generator("cuda").manual_seed(0)
inp = surface.make_inputs(surface.cases["nam56r_4k"], torch.bfloat16, torch.device("cuda"), gen)
args = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in inp.items()}
with torch.no_grad():
    for _ in range(3):
        fla_chunk_gated_delta_rule(**args)
        gated_delta_rule_triton(**args)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    gated_delta_rule_triton(**args)
    fla_chunk_gated_delta_rule(**args)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
print("done")
