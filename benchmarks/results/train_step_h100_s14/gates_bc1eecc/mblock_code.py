"""Inductor's generated code for one compiled Mamba-3 block (fast kernels), fwd + bwd."""
import torch
from megacpp.kernels.runtime import set_kernel_mode
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
set_kernel_mode("fast")
cfg = load_config("nam56r-350m")
model = HybridLM(cfg).cuda()
block = next(b for b in model.blocks if b.letter == "M")
block.compile()
x = torch.randn(8, 2048, cfg.d_model, device="cuda", requires_grad=True)
for _ in range(2):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = block(x)
    y.backward(torch.randn_like(y))
torch.cuda.synchronize()
print("done")
