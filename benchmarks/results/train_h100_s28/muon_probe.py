"""Session 28, call 2: where the fused Muon passes' "CUDA error: invalid argument" (call 1: the
trainer at its third step, muon_step.py after a capture) comes from. Runs the nam56r-350m
AdamW + Muon step under MEGACPP_KERNELS=fast in several settings, synchronizing after each
call and printing the first exception per setting."""

import sys
import traceback

import torch

from megacpp.kernels.runtime import kernel_mode_override
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from megacpp.train.config import OptimSection
from megacpp.train.optim import Optimizers


def setting(name, fn):
    try:
        fn()
        torch.cuda.synchronize()
        print(f"{name}: ok", flush=True)
    except Exception:  # noqa: BLE001
        print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
        sys.exit(1)


cuda = torch.device("cuda")
model = HybridLM(load_config(sys.argv[1] if len(sys.argv) > 1 else "nam56r-350m")).to(cuda)
for p in model.parameters():
    p.grad = torch.randn_like(p) * 1e-3
with kernel_mode_override("fast"):
    opts = Optimizers(model, OptimSection(lr=1e-3), cuda, capturable=True)

    def steps(n):
        for i in range(n):
            opts.step()
            torch.cuda.synchronize()
            print(f"  step {i} ok", flush=True)

    setting("default stream, 3 steps", lambda: steps(3))
    side = torch.cuda.Stream()

    def on_side():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            steps(3)
        torch.cuda.current_stream().wait_stream(side)

    setting("side stream, 3 steps", on_side)
    setting("pinned allocations after", lambda: [torch.zeros(1000).pin_memory() for _ in range(50)])
    for p in model.parameters():  # new gradient tensors, as an eager run's zero_grad gives
        p.grad = torch.randn_like(p) * 1e-3
    setting("new gradients, 2 steps", lambda: steps(2))
