"""_fwd_state launch settings at the nam56r 4k shape under ncu: one forward per SMALL_GRID
setting inside a cudaProfilerStart/Stop range (each warmed up first)."""
import torch

import megacpp.kernels.ops.gated_delta.triton as gdt
from megacpp.kernels.registry import default_catalog

VARIANTS = [(32, 2, 3), (32, 4, 3), (32, 4, 2), (32, 4, 4), (64, 4, 2), (32, 8, 3), (16, 2, 3),
            (16, 4, 3)]
surface = default_catalog().surface("gated_delta")
gen = torch.Generator("cuda").manual_seed(0)
inp = surface.make_inputs(surface.cases["nam56r_4k"], torch.bfloat16, torch.device("cuda"), gen)
args = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in inp.items()}
ref = None
with torch.no_grad():
    for bv, w, s in VARIANTS:
        gdt.SMALL_GRID["fwd_state"] = {"BV": bv, "num_warps": w, "num_stages": s}
        for _ in range(2):
            o, _ = gdt.gated_delta_rule_triton(**args)
        ref = o if ref is None else ref
        print((bv, w, s), "max |o - o_first|", float((o.float() - ref.float()).abs().max()))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for bv, w, s in VARIANTS:
        gdt.SMALL_GRID["fwd_state"] = {"BV": bv, "num_warps": w, "num_stages": s}
        gdt.gated_delta_rule_triton(**args)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
