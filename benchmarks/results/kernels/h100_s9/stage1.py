"""Is _fwd_state at num_stages 1 still wrong (session 8: a fault; session 9 run 1: 27% off)?
fwd+bwd with the working tree's kernels, CONFIG fwd_state num_stages 1 vs 2, compared.
    python stage1.py h16_d128_4k | small"""
import sys, os
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
import gated_delta_tune as tune
import megacpp.kernels.ops.gated_delta.triton as gd
from tests.kernels.test_gated_delta_triton import make_inputs
case = sys.argv[1] if len(sys.argv) > 1 else "h16_d128_4k"
if case == "small":
    x = make_inputs(1, 256, 1, 128, 128, device="cuda", seed=3)
    inputs = {n: (t.to(torch.bfloat16) if n in "qkv" else t) for n, t in x.items()
              if n not in ("initial_state",)}
else:
    inputs = tune._inputs(case)
do = torch.randn_like(inputs["v"])
base = tune._fwd_bwd(inputs, do)
torch.cuda.synchronize()
for stages in (1, 3):
    gd.CONFIG["fwd_state"] = {**gd.CONFIG["fwd_state"], "num_stages": stages}
    out = tune._fwd_bwd(inputs, do)
    torch.cuda.synchronize()
    print(case, f"fwd_state num_stages {stages} vs 2: max rel diff",
          [f"{tune._rel(a, b):.1e}" for a, b in zip(out, base)], flush=True)
