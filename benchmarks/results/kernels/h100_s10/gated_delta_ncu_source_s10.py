"""_fwd_state (BV 32 at 2 and at 4 warps) and fla's fwd_h at nam56r 4k, one forward each inside
a cudaProfilerStart/Stop range, for ncu's source-level sections."""
import torch

import megacpp.kernels.ops.gated_delta.triton as gdt
from megacpp.kernels.peers import fla_chunk_gated_delta_rule
from megacpp.kernels.registry import default_catalog

surface = default_catalog().surface("gated_delta")
gen = torch.Generator("cuda").manual_seed(0)
inp = surface.make_inputs(surface.cases["nam56r_4k"], torch.bfloat16, torch.device("cuda"), gen)
args = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in inp.items()}
VARIANTS = [(32, 2, 3), (32, 4, 3)]
with torch.no_grad():
    for _ in range(3):
        fla_chunk_gated_delta_rule(**args)
    for bv, w, s in VARIANTS:
        gdt.SMALL_GRID["fwd_state"] = {"BV": bv, "num_warps": w, "num_stages": s}
        gdt.gated_delta_rule_triton(**args)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for bv, w, s in VARIANTS:
        gdt.SMALL_GRID["fwd_state"] = {"BV": bv, "num_warps": w, "num_stages": s}
        gdt.gated_delta_rule_triton(**args)
    fla_chunk_gated_delta_rule(**args)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
