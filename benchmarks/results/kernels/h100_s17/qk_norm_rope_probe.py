"""QK-norm + RoPE at the nam56r-350m attention's shape (batch 8, seq 2048, 12 query heads and
2 kv heads of 64, read in place from the bf16 projections), fwd+bwd, CUDA-graph replays:

  fused      rmsnorm_triton(x, w, rope=(cos, sin)): the rotation in both norm kernels
  separate   rmsnorm_triton(x, w), then apply_rope under torch.compile (the path before)
  compiled   torch.compile of rmsnorm_reference with rope (Inductor's own fusion; the peer)

    PYTHONPATH=src python benchmarks/results/kernels/h100_s17/qk_norm_rope_probe.py
"""

from __future__ import annotations

import statistics

import torch

from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference
from megacpp.kernels.ops.rmsnorm.triton import rmsnorm_triton
from megacpp.kernels.timing import time_fwd_bwd_graphed
from megacpp.model.rope import apply_rope, rope_range

B, L, D = 8, 2048, 64
dev = torch.device("cuda")
cos, sin = rope_range(0, L, D, 10000.0, torch.float32, dev)
rope_c = torch.compile(apply_rope, dynamic=False)
ref_c = torch.compile(rmsnorm_reference, dynamic=False)
VIEWS = {"q": lambda t: t[..., :12 * D].view(B, L, 12, D).transpose(1, 2),
         "k": lambda t: t[..., 12 * D:].view(B, L, 2, 2, D).unbind(2)[0].transpose(1, 2)}
FNS = {
    "fused": lambda x, w: rmsnorm_triton(x, w, None, 1e-5, None, False, 1, (cos, sin))[0],
    "separate": lambda x, w: rope_c(rmsnorm_triton(x, w)[0], cos, sin),
    "compiled": lambda x, w: ref_c(x, w, None, 1e-5, None, False, 1, (cos, sin))[0],
}
gen = torch.Generator(dev).manual_seed(0)
base = torch.randn(B, L, 16 * D, device=dev, generator=gen).bfloat16().requires_grad_()
w = (1 + 0.1 * torch.randn(D, device=dev, generator=gen)).requires_grad_()
for part, view in VIEWS.items():
    times = {}
    for name, fn in FNS.items():
        runs = [time_fwd_bwd_graphed(lambda base, w, fn=fn, view=view: fn(view(base), w),
                                     {"base": base, "w": w}, ("base", "w"), dev,
                                     repeats=50).median_ms
                for _ in range(3)]
        times[name] = statistics.median(runs)
    line = "  ".join(f"{k} {v * 1e3:7.1f} us" for k, v in times.items())
    print(f"{part} [{B}, {view(base).shape[1]}, {L}, {D}]: {line}  "
          f"separate/fused {times['separate'] / times['fused']:.2f}x  "
          f"compiled/fused {times['compiled'] / times['fused']:.2f}x", flush=True)
