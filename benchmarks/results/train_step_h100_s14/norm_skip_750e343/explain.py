"""Graph breaks per block family of nam56r-350m with the fast kernels (torch._dynamo.explain)."""
import sys
import torch
from megacpp.kernels.runtime import set_kernel_mode
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM

set_kernel_mode("fast")
cfg = load_config("nam56r-350m")
model = HybridLM(cfg).cuda()
seen = set()
for i, block in enumerate(model.blocks):
    if block.letter in seen:
        continue
    seen.add(block.letter)
    x = torch.randn(8, 2048, cfg.d_model, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(block)(x)
    print(f"block {i} {block.letter}: graphs {ex.graph_count} breaks {ex.graph_break_count} "
          f"ops {ex.op_count}", flush=True)
    for r in ex.break_reasons:
        print("   reason:", str(r.reason)[:400].replace("\n", " | "))
        for fr in r.user_stack[-3:]:
            print("      at", fr.filename.split("megacpp/")[-1], fr.lineno, fr.name)
    torch._dynamo.reset()
