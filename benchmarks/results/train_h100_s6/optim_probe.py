"""Device probe: the graphed optimizer step (AdamW + Muon, as megacpp train runs it) of
nam56r-350m, and AdamW alone, timed by CUDA-graph replay (median of 20)."""
import json
import statistics

import torch

from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from megacpp.train.config import OptimSection
from megacpp.train.optim import Optimizers

dev = torch.device("cuda")
torch.manual_seed(0)
model = HybridLM(load_config("nam56r-350m")).to(dev)
for p in model.parameters():
    p.grad = torch.randn_like(p) * 1e-3
rows = {}
for muon in (True, False):
    opts = Optimizers(model, OptimSection(muon=muon), dev, capturable=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opts.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with opts.device_lr(dev), torch.cuda.graph(g):
        opts.step()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    rows["adamw+muon" if muon else "adamw_only"] = round(statistics.median(times), 2)
    del g, opts
print(json.dumps({"optimizer_step_graphed_ms": rows}))
